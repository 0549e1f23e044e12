"""Model-payload benchmarks: every figure is a ratio against a baseline measured in the same run.

1. verify GB/s (PayloadVerifier full SHA-256 of a pack in the page cache) vs one-core hashlib over
   the same bytes already in memory; and several packs at once (``verify_many``, ``--files`` packs
   holding the same total bytes) vs cores x that one-core hashlib figure, and vs ``jobs`` threads
   of hashlib over the same bytes in memory (what the machine gives at that moment);
2. warm validation-record check vs full hash of the same pack;
3. CPU hydration GB/s (pack + residual -> anonymous mmaps, MemorySink) vs a plain memcpy of the
   same bytes from memory into the same (pre-touched) mappings;
4. recovery (safetensors through the replay plan, every extent hash-checked) vs native hydration.

Run: ``.venv/bin/python bench/bench_payload.py [--gib 1] [--files N] [--jobs N] [--json out.json]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / ".venv" / "collections"))

from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache  # noqa: E402
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.hydrate import (  # noqa: E402
    MemorySink,
    hydrate_native,
    hydrate_recovery,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import (  # noqa: E402
    Allocation,
    ModelExtent,
    TensorSource,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.pack import (  # noqa: E402
    MemoryReader,
    write_worker_payload,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.safetensors import (  # noqa: E402
    write_safetensors,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.streams import default_jobs  # noqa: E402
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import PayloadVerifier  # noqa: E402

MODEL = {"id": "coldsnap/bench", "revision": "0" * 40}


def best(fn, repeat: int) -> float:
    times = []
    for _i in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def build_worker(root: Path, total: int, rng: np.random.Generator):
    """Two arenas of bf16 'weights' (~95% model bytes, the rest residual), checkpoint in two files."""
    n_tensors = 16
    rows, cols = 1024, max(1, total // (n_tensors * 1024 * 2) // 1)
    per = rows * cols * 2
    tensors, extents, bufs = {}, [], {"arena0": bytearray(), "arena1": bytearray()}
    for i in range(n_tensors):
        raw = rng.integers(0, 256, per, dtype=np.uint8).tobytes()
        name = f"layers.{i}.weight"
        tensors[name] = ("BF16", (rows, cols), raw)
        arena = f"arena{i % 2}"
        bufs[arena] += rng.integers(0, 256, per // 40 + 123, dtype=np.uint8).tobytes()  # residual
        # every 4th tensor is a tensor-parallel shard along dim 1 (strided reads in recovery)
        if i % 4 == 3:
            half = cols // 2
            shard = np.frombuffer(raw, dtype=np.uint16).reshape(rows, cols)[:, half:].tobytes()
            src = TensorSource(f"model-{i % 2}.safetensors", name, "BF16", (rows, cols), (1, half, cols))
            data = shard
        else:
            src = TensorSource(f"model-{i % 2}.safetensors", name, "BF16", (rows, cols), None)
            data = raw
        extents.append(ModelExtent(arena, len(bufs[arena]), len(data), src))
        bufs[arena] += data
    for k in range(2):
        write_safetensors(root / f"model-{k}.safetensors",
                          {n: t for i, (n, t) in enumerate(tensors.items()) if i % 2 == k})
    allocs = [Allocation("arena0", 0x7F0000000000, len(bufs["arena0"])),
              Allocation("arena1", 0x7F8000000000, len(bufs["arena1"]))]
    return allocs, extents, bufs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="model bytes to generate (default 1 GiB)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="hydration threads (default: min(8, cpus))")
    ap.add_argument("--files", type=int, default=None,
                    help="packs verified at once in the across-files figure (default: the usable CPUs)")
    ap.add_argument("--jobs", type=int, default=None, help="verify_many jobs (default: the usable CPUs)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--dir", help="scratch directory (default: a temp dir)")
    args = ap.parse_args()
    total = int(args.gib * (1 << 30))
    rng = np.random.default_rng(1)
    results: dict = {"host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                              "python": platform.python_version()}, "bytes": total}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        # 1 + 2: verifier vs hashlib, warm record vs full hash; 1b: several packs at once
        data = rng.integers(0, 256, total, dtype=np.uint8).tobytes()
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        cache = NodeCache(root / "state")
        path = cache.path_for(digest)
        path.parent.mkdir(parents=True)
        path.write_bytes(data)
        cores = default_jobs()
        n_files = args.files or cores
        jobs = args.jobs or cores
        per = total // n_files // 4096 * 4096
        parts = [memoryview(data)[i * per:(i + 1) * per] for i in range(n_files)]
        many = []
        for part in parts:
            d = "sha256:" + hashlib.sha256(part).hexdigest()
            cache.path_for(d).write_bytes(part)
            many.append((cache, d, per))

        def full_verify() -> None:
            with PayloadVerifier().verify(cache, digest, total, rehash=True):
                pass

        def verify_all() -> None:
            for v in PayloadVerifier().verify_many(many, jobs=args.jobs, rehash=True):
                v.close()

        def hashlib_parallel() -> None:  # what this machine gives ``jobs`` hashing threads over bytes in memory
            with ThreadPoolExecutor(jobs) as pool:
                list(pool.map(lambda b: hashlib.sha256(b).digest(), parts))

        # Interleaved rounds, so that background load hits the baselines and the measurements alike.
        rounds: dict[str, list[float]] = {"hashlib": [], "verify": [], "many": [], "parallel": []}
        for _i in range(args.repeat):
            for key, fn in (("hashlib", lambda d=data: hashlib.sha256(d).digest()), ("verify", full_verify),
                            ("many", verify_all), ("parallel", hashlib_parallel)):
                t = time.perf_counter()
                fn()
                rounds[key].append(time.perf_counter() - t)
        t_hashlib, t_verify, t_many, t_parallel = (min(rounds[k]) for k in ("hashlib", "verify", "many", "parallel"))

        def warm_check() -> None:
            with PayloadVerifier().verify(cache, digest, total) as v:
                assert v.reused_record

        t_warm = best(warm_check, max(args.repeat, 5))
        for part in parts:
            part.release()
        del data
        os.unlink(path)
        for _c, d, _s in many:
            os.unlink(cache.path_for(d))
        one_core = total / t_hashlib / 1e9
        many_gbps = per * n_files / t_many / 1e9
        results["verify"] = {"verifier_gbps": total / t_verify / 1e9, "hashlib_one_core_gbps": one_core,
                             "ratio": t_hashlib / t_verify, "rounds": rounds}
        results["verify_many"] = {"files": n_files, "file_bytes": per, "jobs": jobs, "cores": cores,
                                  "verifier_gbps": many_gbps, "hashlib_one_core_gbps": one_core,
                                  "ratio_vs_cores_x_one_core": many_gbps / (cores * one_core),
                                  "hashlib_parallel_gbps": per * n_files / t_parallel / 1e9,
                                  "ratio_vs_hashlib_parallel": t_parallel / t_many}
        results["warm_record"] = {"warm_check_ms": t_warm * 1e3, "full_hash_s": t_verify,
                                  "speedup": t_verify / t_warm}

        # 3 + 4: hydration
        ckpt = root / "ckpt"
        ckpt.mkdir()
        allocs, extents, bufs = build_worker(ckpt, total, rng)
        t0 = time.perf_counter()
        wp = write_worker_payload(root / "unit", allocs, extents, MemoryReader(bufs), export_pack=True,
                                  cache=cache, model=MODEL, safetensors_dir=ckpt)
        t_capture = time.perf_counter() - t0
        moved = sum(a.size for a in allocs)
        dest = {a.id: mmap.mmap(-1, a.size) for a in allocs}
        for m in dest.values():
            m.write(b"\x01" * len(m))  # pre-touch: the baseline and hydration both write resident pages
        views = {k: memoryview(m) for k, m in dest.items()}
        src_views = {k: memoryview(b) for k, b in bufs.items()}

        def memcpy() -> None:
            for k, view in views.items():
                view[:] = src_views[k]

        t_memcpy = best(memcpy, args.repeat)
        sink = MemorySink(dest, threads=args.threads)
        manifest = root / "unit" / "native-manifest.json"

        def native() -> None:
            with PayloadVerifier().verify(cache, wp.pack.sha256, wp.pack.size) as v:
                hydrate_native(manifest, v, root / "unit" / "weights.blob", sink)

        t_native = best(native, args.repeat)

        def native_fill() -> None:  # the copy alone (residual digest trusted, as after a digest-pinned pull)
            with PayloadVerifier().verify(cache, wp.pack.sha256, wp.pack.size) as v:
                hydrate_native(manifest, v, root / "unit" / "weights.blob", sink, verify_residual=False)

        t_fill = best(native_fill, args.repeat)
        for a in allocs:
            assert views[a.id] == src_views[a.id], "native hydration must rebuild the allocation"

        def recovery() -> None:
            hydrate_recovery(manifest, root / "unit" / "replay-plan.json", ckpt, root / "unit" / "weights.blob", sink)

        t_recovery = best(recovery, args.repeat)
        for a in allocs:
            assert views[a.id] == src_views[a.id], "recovery hydration must rebuild the allocation"
        results["capture"] = {"seconds": t_capture, "model_bytes": wp.model_bytes, "residual_bytes": wp.residual_bytes,
                              "pack_bytes": wp.pack.size, "gbps": moved / t_capture / 1e9}
        results["cpu_hydration"] = {"native_gbps": moved / t_native / 1e9, "memcpy_gbps": moved / t_memcpy / 1e9,
                                    "ratio": t_memcpy / t_native, "threads": sink.threads,
                                    "fill_only_gbps": moved / t_fill / 1e9, "fill_only_ratio": t_memcpy / t_fill}
        results["recovery_vs_native"] = {"native_s": t_native, "recovery_s": t_recovery,
                                         "recovery_gbps": moved / t_recovery / 1e9,
                                         "ratio": t_recovery / t_native}
        for v in sink.views.values():
            v.release()
        for v in views.values():
            v.release()
        for v in src_views.values():
            v.release()
        for m in dest.values():
            m.close()

    print(json.dumps(results, indent=2))
    v, w, h, r = results["verify"], results["warm_record"], results["cpu_hydration"], results["recovery_vs_native"]
    print()
    print(f"| measure ({total / 2**30:.2f} GiB, {os.cpu_count()} CPUs) | ColdSnap | baseline (same run) | ratio |")
    print("| --- | --- | --- | --- |")
    print(f"| payload verify (full SHA-256, page cache) | {v['verifier_gbps']:.2f} GB/s | one-core hashlib "
          f"{v['hashlib_one_core_gbps']:.2f} GB/s | {v['ratio']:.2f} |")
    m = results["verify_many"]
    print(f"| verify {m['files']} packs at once ({m['jobs']} jobs, {m['cores']} CPUs) | {m['verifier_gbps']:.2f} GB/s | "
          f"{m['cores']} x one-core hashlib {m['cores'] * m['hashlib_one_core_gbps']:.2f} GB/s | "
          f"{m['ratio_vs_cores_x_one_core']:.2f} |")
    print(f"| verify {m['files']} packs at once, vs what the machine gave {m['jobs']} hashlib threads | "
          f"{m['verifier_gbps']:.2f} GB/s | {m['jobs']} threads of hashlib over the bytes in memory "
          f"{m['hashlib_parallel_gbps']:.2f} GB/s | {m['ratio_vs_hashlib_parallel']:.2f} |")
    print(f"| warm validation-record check | {w['warm_check_ms']:.2f} ms | full hash {w['full_hash_s']:.2f} s | "
          f"{w['speedup']:.0f}x faster |")
    print(f"| CPU hydration, end to end (manifest + residual SHA-256 + copy, {h['threads']} threads) | "
          f"{h['native_gbps']:.2f} GB/s | memcpy {h['memcpy_gbps']:.2f} GB/s | {h['ratio']:.2f} |")
    print(f"| CPU hydration, copy only (residual digest trusted) | {h['fill_only_gbps']:.2f} GB/s | "
          f"memcpy {h['memcpy_gbps']:.2f} GB/s | {h['fill_only_ratio']:.2f} |")
    print(f"| recovery (safetensors, hash-checked) vs native | {r['recovery_s']:.2f} s | native {r['native_s']:.2f} s"
          f" | {r['ratio']:.2f}x the time |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
