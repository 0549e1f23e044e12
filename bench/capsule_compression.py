"""How far a capsule's bytes would shrink compressed, and what compressing and decompressing cost.

ColdSnap's capsules carry uncompressed layers (their digest is the diff id, and a restore reads the
CRIU image straight from the unpacked layer). This bench measures what a compressed copy would save
for moving a capsule between hosts or through a registry: for every regular file under PATH (a
capsule's OCI layout, a CRIU image directory, a unit's state), each codec's output size and its
compress and decompress rates, against reading the same bytes from the page cache in the same run
(the baseline). Codecs: gzip levels 1 and 6 (what ``docker push`` makes of a layer; Python's zlib,
one thread), what ``coldsnap publish`` pushes for an OCI capsule (gzip members compressed on all
cores, ``capsule/wire.py``; inflated on all cores and hashed as a pull does), and zstd levels 1 and 3 (the
``zstd`` command, one thread and all cores) where ``zstd`` is installed.

Usage: ``python bench/capsule_compression.py PATH [--model-bytes N] [--json OUT]``.
``--model-bytes`` adds each codec's output as a fraction of the model's bytes (the capsule target of
issue 18 is stated that way). Prints a markdown table and JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

CHUNK = 8 << 20


def files_under(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def read_all(files: list[Path]) -> tuple[int, float]:
    """Bytes read and seconds: the baseline (page cache → user space, one thread)."""
    total, t0 = 0, time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(CHUNK):
                total += len(chunk)
    return total, time.perf_counter() - t0


def gzip_level(files: list[Path], level: int) -> tuple[int, float, float]:
    """Compressed bytes, compress seconds, decompress seconds (zlib's gzip container, one thread)."""
    out, t_comp, t_dec = 0, 0.0, 0.0
    for f in files:
        parts: list[bytes] = []
        t0 = time.perf_counter()
        comp = zlib.compressobj(level, zlib.DEFLATED, 31)
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(CHUNK):
                parts.append(comp.compress(chunk))
        parts.append(comp.flush())
        t_comp += time.perf_counter() - t0
        out += sum(len(p) for p in parts)
        t0 = time.perf_counter()
        dec = zlib.decompressobj(31)
        for p in parts:
            dec.decompress(p)
        dec.flush()
        t_dec += time.perf_counter() - t0
    return out, t_comp, t_dec


class _Sink:
    """Counts what is written (a pull writes the layer to disk; here only the decompression is timed)."""

    def write(self, data: bytes) -> int:
        return len(data)


def wire_gzip(files: list[Path]) -> tuple[int, float, float]:
    """ColdSnap's publication path: ``wire.compress`` and ``wire.gunzip`` of the announced members (both on all
    cores; each side hashed, as a publish and a pull do)."""
    import io

    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import wire

    out, t_comp, t_dec = 0, 0.0, 0.0
    for f in files:
        buf = io.BytesIO()
        t0 = time.perf_counter()
        with open(f, "rb") as fh:
            members = wire.compress(fh, buf).members
        t_comp += time.perf_counter() - t0
        out += buf.tell()
        buf.seek(0)
        t0 = time.perf_counter()
        wire.gunzip(buf, _Sink(), limit=f.stat().st_size, what=str(f), members=members)
        t_dec += time.perf_counter() - t0
    return out, t_comp, t_dec


def zstd_level(files: list[Path], level: int, threads: int, scratch: Path) -> tuple[int, float, float]:
    """The same with the ``zstd`` command (``-T threads``; 0 = all cores); output kept in ``scratch``."""
    out, t_comp, t_dec = 0, 0.0, 0.0
    target = scratch / "blob.zst"
    for f in files:
        t0 = time.perf_counter()
        subprocess.run(["zstd", "-q", "-f", f"-{level}", f"-T{threads}", str(f), "-o", str(target)], check=True)
        t_comp += time.perf_counter() - t0
        out += target.stat().st_size
        t0 = time.perf_counter()
        subprocess.run(["zstd", "-q", "-d", "-c", f"-T{threads}", str(target)], check=True,
                       stdout=subprocess.DEVNULL)
        t_dec += time.perf_counter() - t0
        target.unlink()
    return out, t_comp, t_dec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", type=Path)
    ap.add_argument("--model-bytes", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    files = files_under(args.path)
    if not files:
        ap.error(f"no files under {args.path}")
    read_all(files)  # into the page cache
    total, t_read = read_all(files)
    base_rate = total / t_read
    rows = []

    def row(codec: str, size: int, t_comp: float, t_dec: float) -> None:
        rows.append({"codec": codec, "bytes": size, "ratio": size / total,
                     "of_model": size / args.model_bytes if args.model_bytes else None,
                     "compress_GBps": total / t_comp / 1e9, "decompress_GBps": total / t_dec / 1e9,
                     "compress_vs_read": (total / t_comp) / base_rate,
                     "decompress_vs_read": (total / t_dec) / base_rate})

    for level in (1, 6):
        row(f"gzip -{level} (zlib, 1 thread)", *gzip_level(files, level))
    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.wire import LEVEL

    row(f"coldsnap publish/pull: gzip -{LEVEL} members, all cores, hashed", *wire_gzip(files))
    if shutil.which("zstd"):
        with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
            for level, threads in ((1, 1), (3, 1), (3, 0)):
                label = f"zstd -{level} ({'1 thread' if threads == 1 else 'all cores'})"
                row(label, *zstd_level(files, level, threads, Path(tmp)))
    else:
        print("zstd is not installed: gzip only", file=sys.stderr)
    result = {"path": str(args.path), "files": len(files), "bytes": total, "model_bytes": args.model_bytes or None,
              "read_GBps": base_rate / 1e9, "cores": os.cpu_count(), "codecs": rows}
    print(f"{len(files)} files, {total / 1e9:.3f} GB; page cache read {base_rate / 1e9:.2f} GB/s (baseline)\n")
    print("| codec | compressed / raw | compressed / model bytes | compress GB/s (vs read) | decompress GB/s (vs read) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        of_model = f"{r['of_model']:.3f}" if r["of_model"] is not None else "—"
        print(f"| {r['codec']} | {r['ratio']:.3f} | {of_model} | {r['compress_GBps']:.2f} ({r['compress_vs_read']:.3f}) "
              f"| {r['decompress_GBps']:.2f} ({r['decompress_vs_read']:.3f}) |")
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
