"""Capture side: split resident allocations into the model pack, the residual blob and their maps.

``write_worker_payload`` is what an engine integration calls at capture, with
the live allocation map and the loader writes it observed. The same canonical
pack writer serves ``write_pack_from_resident`` (materialization after a
recovery restore), so both produce the identical object for identical bytes.

Two passes over model bytes: the first hashes every extent (the pack order
is by extent SHA-256), the second streams them in pack order into the cache
while hashing the whole file. A CRC-32 per extent taken in the first pass is
re-checked in the second, so bytes that change between the passes (an engine
that was not quiesced) fail the capture instead of producing a pack whose
manifest lies.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from ansible_collections.coldsnap.fleet.plugins.module_utils.common import fsutil
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
    space_error,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.schema import validate_document
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import (
    MANIFEST_NAME,
    PACK_ALIGNMENT,
    REPLAY_PLAN_NAME,
    RESIDUAL_NAME,
    Allocation,
    FileRef,
    ModelExtent,
    PackedExtent,
    PackRef,
    ResidualExtent,
    check_allocations,
    pack_order,
    pack_size,
    padded,
    residual_complement,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.manifest import (
    MODEL,
    NativeManifest,
    ReplayEntry,
    ReplayPlan,
    check_rel_file,
    load_manifest,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.streams import Progress
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.writer import PackWriter

READ_CHUNK = 16 << 20
_ZEROS = bytes(PACK_ALIGNMENT)


class AllocationReader(Protocol):
    """Reads resident allocation bytes. A returned memoryview may be reused by the next call."""

    def read(self, allocation: str, offset: int, size: int) -> bytes | memoryview: ...


class MemoryReader:
    """AllocationReader over in-process buffers (anonymous mmaps, bytearrays): zero-copy slices."""

    def __init__(self, views: dict[str, memoryview | bytearray | mmap.mmap]) -> None:
        self.views = {k: memoryview(v).cast("B") for k, v in views.items()}

    def read(self, allocation: str, offset: int, size: int) -> memoryview:
        view = self.views[allocation]
        if offset + size > len(view):
            raise IntegrityError(f"read of {allocation}[{offset}:{offset + size}] is past its {len(view)} bytes",
                                 fix="the allocation map does not match the resident allocation")
        return view[offset:offset + size]


class FileAllocationReader:
    """AllocationReader over raw per-allocation dump files (``coldsnap payload build``, tests)."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.fds = {}
        try:
            for k, p in files.items():
                self.fds[k] = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            self.close()
            raise ColdSnapError(f"allocation bytes file {exc.filename} does not exist",
                                fix="give one raw byte file per allocation") from None
        except PermissionError as exc:
            self.close()
            raise ColdSnapError(f"allocation bytes file {exc.filename} cannot be read by this user: permission denied",
                                fix="make it readable by this user") from None
        self._buf = bytearray(READ_CHUNK)

    def read(self, allocation: str, offset: int, size: int) -> memoryview:
        if size > len(self._buf):
            self._buf = bytearray(size)
        view = memoryview(self._buf)[:size]
        n = os.preadv(self.fds[allocation], [view], offset)
        if n != size:
            raise IntegrityError(f"allocation bytes file for {allocation!r} ends before byte {offset + size}",
                                 fix="the file must hold the whole allocation")
        return view

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


@dataclass(frozen=True)
class WorkerPayload:
    """What capture wrote for one worker."""

    pack: PackRef | None
    residual: FileRef
    manifest: FileRef
    replay: FileRef
    model_bytes: int
    residual_bytes: int
    allocations: int
    pack_size: int
    model_extents: int
    pack_reused: bool = False  # an identical pack was already in the cache (another worker wrote it)

    def artifact_fields(self, owner: str) -> dict:
        """The artifact v9 ``weights.workers[]`` fields this payload provides (worker/unit/rank/role are the caller's)."""
        return {
            "payload": ({"owner": owner, "size": self.pack.size, "sha256": self.pack.sha256, "path": self.pack.path}
                        if self.pack else None),
            "residual": self.residual.as_dict(),
            "manifest": self.manifest.as_dict(),
            "replay": self.replay.as_dict(),
            "allocations": self.allocations,
            "model_bytes": self.model_bytes,
            "residual_bytes": self.residual_bytes,
        }


class _Progress:
    def __init__(self, cb: Progress | None, total: int) -> None:
        self.cb, self.total, self.done = cb, total, 0

    def add(self, n: int) -> None:
        self.done += n
        if self.cb:
            self.cb(self.done, self.total)


def _chunks(offset: int, size: int):
    end = offset + size
    while offset < end:
        n = min(READ_CHUNK, end - offset)
        yield offset, n
        offset += n


def _read(reader: AllocationReader, alloc: str, offset: int, size: int) -> memoryview:
    data = memoryview(reader.read(alloc, offset, size)).cast("B")
    if data.nbytes != size:
        raise IntegrityError(f"reader returned {data.nbytes} bytes for {alloc}[{offset}:{offset + size}]",
                             fix="the allocation reader must return exactly the requested range")
    return data


def _check_extents(by_id: dict[str, Allocation], extents: Sequence[ModelExtent]) -> None:
    for e in extents:
        where = f"model extent {e.allocation}[{e.offset}:{e.offset + e.size}]"
        if e.allocation not in by_id:
            raise IntegrityError(f"{where} names an unknown allocation",
                                 fix="observe loader writes only into the listed stable allocations")
        check_rel_file(e.source.file, what=f"{where} checkpoint file")
        try:
            want = e.source.nbytes()
        except IntegrityError as exc:
            raise IntegrityError(f"{where} (tensor {e.source.tensor!r}): {exc.problem}", fix=exc.fix) from None
        if want != e.size:
            raise IntegrityError(
                f"{where} holds {e.size} bytes but its source tensor {e.source.tensor!r} "
                f"({e.source.dtype}, shape {list(e.source.shape)}, slice {e.source.slice}) has {want}",
                fix="recovery copies checkpoint bytes verbatim: record the loader write of the exact (sliced) tensor")


def _file_table(extents: Sequence[ModelExtent], safetensors_dir: Path | None) -> dict[str, dict]:
    files: dict[str, dict] = {e.source.file: {"size": None, "header_sha256": None} for e in extents}
    if safetensors_dir is None:
        return files
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.safetensors import SafetensorsFile

    for name in files:
        with SafetensorsFile(Path(safetensors_dir) / name) as st:
            files[name] = {"size": st.size, "header_sha256": st.header_sha256}
            for e in extents:
                if e.source.file != name:
                    continue
                info = st.tensor(e.source.tensor)
                if info.dtype != e.source.dtype or info.shape != tuple(e.source.shape):
                    raise IntegrityError(
                        f"tensor {e.source.tensor!r} in {name} is {info.dtype} {list(info.shape)}, the loader "
                        f"observer recorded {e.source.dtype} {list(e.source.shape)}",
                        fix="record the checkpoint tensor's own dtype and shape")
    return files


def _json_bytes(doc: dict) -> bytes:
    import json

    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


class _Temps(dict):
    """The outputs written so far under temporary names (final name -> temp), each flocked until
    :meth:`release`: a later writer into the same directory removes only temps whose writer is gone."""

    def __init__(self) -> None:
        super().__init__()
        self.locks: list[int] = []

    def release(self) -> None:
        for fd in self.locks:
            os.close(fd)
        self.locks.clear()


def _clean_dead_temps(out_dir: Path) -> None:
    """Remove what a killed writer of these outputs left in ``out_dir`` (its temps are no longer locked)
    before this one needs the space."""
    prefixes = tuple(f".{name}{fsutil.TEMP_MARKER}" for name in (RESIDUAL_NAME, MANIFEST_NAME, REPLAY_PLAN_NAME))
    with os.scandir(out_dir) as entries:
        for entry in entries:
            if entry.name.startswith(prefixes):
                fsutil.remove_if_abandoned(entry.path)


@contextlib.contextmanager
def _temp_output(final: Path, temps: _Temps, what: str) -> Iterator[IO[bytes]]:
    """Write ``final``'s bytes under a temporary name beside it (0600, fsynced, flocked while ``temps``
    holds it); :func:`_publish` renames it into place. The temp is listed in ``temps`` from its creation,
    so the caller removes it on any failure."""
    tmp = fsutil.temp_path_for(final)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise space_error(exc, what=what, path=final.parent) from None
    temps[final.name] = tmp
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        temps.locks.append(os.dup(fd))  # the lock lives as long as this open file does
    except BaseException:
        os.close(fd)
        raise
    try:
        with os.fdopen(fd, "wb", closefd=True) as fh:
            os.fchmod(fh.fileno(), 0o600)  # not subject to umask
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        raise space_error(exc, what=what, path=final) from None


def _write_json(path: Path, doc: dict, temps: _Temps) -> FileRef:
    data = _json_bytes(doc)
    with _temp_output(path, temps, what=f"the document {path.name}") as fh:
        fh.write(data)
    return FileRef(path.name, len(data), "sha256:" + hashlib.sha256(data).hexdigest())


def _write_residual(path: Path, extents: Sequence[ResidualExtent], reader: AllocationReader,
                    prog: _Progress, temps: _Temps) -> FileRef:
    h = hashlib.sha256()
    total = 0
    with _temp_output(path, temps, what=f"the residual blob {path.name}") as fh:
        for e in extents:
            for off, n in _chunks(e.offset, e.size):
                data = _read(reader, e.allocation, off, n)
                h.update(data)
                fh.write(data)
                total += n
                prog.add(n)
    return FileRef(path.name, total, "sha256:" + h.hexdigest())


def _publish(out_dir: Path, temps: _Temps, names: Sequence[str]) -> None:
    """Rename the written temps into place, ``names`` in order (the manifest last: it is what binds the set).

    The old manifest goes first, so an interrupted publish leaves a set without a manifest (refused as
    incomplete), never a new blob described by the old manifest.
    """
    with contextlib.suppress(FileNotFoundError):
        os.unlink(out_dir / MANIFEST_NAME)
    for name in names:
        os.replace(temps[name], out_dir / name)
        del temps[name]
    fsutil.fsync_dir(out_dir)


def _write_canonical_pack(cache: NodeCache, ordered: Sequence[PackedExtent], reader: AllocationReader, *,
                          crcs: dict[tuple[str, int], int] | None, expected_sha256: str | None,
                          prog: _Progress):
    """Stream extents in pack order with zero padding into the cache; the one writer of packs."""
    size = pack_size(ordered)
    what = "materialized model payload" if expected_sha256 else "model payload"
    with PackWriter(cache, expected_sha256=expected_sha256, size=size, what=what) as w:
        for e in ordered:
            crc = 0
            ext_hash = hashlib.sha256() if crcs is None and expected_sha256 is None else None
            for off, n in _chunks(e.offset, e.size):
                data = _read(reader, e.allocation, off, n)
                w.write(data)
                if crcs is not None:
                    crc = zlib.crc32(data, crc)
                if ext_hash is not None:
                    ext_hash.update(data)
                prog.add(n)
            if crcs is not None and crcs[(e.allocation, e.offset)] != crc:
                raise IntegrityError(
                    f"model extent {e.allocation}[{e.offset}:{e.offset + e.size}] changed while the pack was written",
                    fix="the engine kept writing its weights during capture; quiesce it (no loads, no updates) "
                        "and capture again")
            if ext_hash is not None and "sha256:" + ext_hash.hexdigest() != e.sha256:
                raise IntegrityError(
                    f"resident model extent {e.allocation}[{e.offset}:{e.offset + e.size}] does not hold the "
                    f"captured bytes ({e.sha256})",
                    fix="the loaded weights differ from the capture; restore with the captured model revision")
            pad = padded(e.size) - e.size
            if pad:
                w.write(_ZEROS[:pad])
        return w.commit()


def write_worker_payload(out_dir: Path, allocations: list[Allocation], model_extents: list[ModelExtent],
                         reader: AllocationReader, *, export_pack: bool, cache: NodeCache | None, model: dict,
                         progress: Progress | None = None, safetensors_dir: Path | None = None) -> WorkerPayload:
    """Write ``weights.blob``, ``native-manifest.json``, ``replay-plan.json`` (and the pack) for one worker.

    ``allocations`` are the stable weight allocations (captured addresses),
    ``model_extents`` the observed loader writes; every other allocation byte
    is residual. The model and residual maps are disjoint and cover every
    allocation byte by construction; overlapping or out-of-bounds loader
    writes are refused before anything is written. With ``export_pack`` the
    pack goes into ``cache`` (content-addressed, with a validation record).
    ``safetensors_dir`` (optional) lets capture check each source tensor
    against the checkpoint header and pin each file's size and header digest.
    """
    out_dir = Path(out_dir)
    if export_pack and cache is None:
        raise ColdSnapError("exporting the model payload needs the node cache", fix="pass cache=NodeCache(state_root)")
    model = validate_document(MODEL, model, document="model identity")
    by_id = check_allocations(allocations)
    _check_extents(by_id, model_extents)
    residual = residual_complement(allocations, [(e.allocation, e.offset, e.size) for e in model_extents])
    files = _file_table(model_extents, safetensors_dir)
    model_bytes = sum(e.size for e in model_extents)
    residual_bytes = sum(e.size for e in residual)
    prog = _Progress(progress, model_bytes * (2 if export_pack else 1) + residual_bytes)

    # Pass 1: the SHA-256 of every extent decides the pack order.
    hashed: list[tuple[str, int, int, str]] = []
    crcs: dict[tuple[str, int], int] = {}
    for e in model_extents:
        h = hashlib.sha256()
        crc = 0
        for off, n in _chunks(e.offset, e.size):
            data = _read(reader, e.allocation, off, n)
            h.update(data)
            crc = zlib.crc32(data, crc)
            prog.add(n)
        hashed.append((e.allocation, e.offset, e.size, "sha256:" + h.hexdigest()))
        crcs[(e.allocation, e.offset)] = crc
    ordered = pack_order(hashed)

    if export_pack:
        if cache is None:
            raise AssertionError("export_pack needs a node cache")
        cache.ensure_dirs()  # a state root that cannot hold the pack fails before any output is written
        cache.clean_stale_temps()  # a killed writer's pack temp must not take the space the residual needs
    out_dir.mkdir(parents=True, exist_ok=True)
    # Every output is written under a temporary name and renamed into place only once all of them and the
    # pack are done: a failure before that leaves --out as it was (a previous set stays whole), never a mix.
    _clean_dead_temps(out_dir)
    temps = _Temps()
    try:
        residual_ref = _write_residual(out_dir / RESIDUAL_NAME, residual, reader, prog, temps)
        pack_ref = None
        reused = False
        if export_pack:
            result = _write_canonical_pack(cache, ordered, reader, crcs=crcs, expected_sha256=None, prog=prog)
            pack_ref, reused = result.pack, result.reused_existing

        manifest = NativeManifest(model, tuple(allocations), pack_ref.sha256 if pack_ref else None,
                                  pack_size(ordered), residual_ref, tuple(ordered), tuple(residual))
        manifest_ref = _write_json(out_dir / MANIFEST_NAME, manifest.as_dict(), temps)
        sha_of = {(a, o): s for a, o, _n, s in hashed}
        plan = ReplayPlan(model, tuple(allocations), files,
                          tuple(ReplayEntry(e.allocation, e.offset, e.size, sha_of[(e.allocation, e.offset)], e.source)
                                for e in sorted(model_extents, key=lambda x: (x.allocation, x.offset))),
                          residual_ref)
        replay_ref = _write_json(out_dir / REPLAY_PLAN_NAME, plan.as_dict(), temps)
        _publish(out_dir, temps, (RESIDUAL_NAME, REPLAY_PLAN_NAME, MANIFEST_NAME))
    except BaseException:
        for tmp in temps.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        raise
    finally:
        temps.release()
    return WorkerPayload(pack_ref, residual_ref, manifest_ref, replay_ref, model_bytes, residual_bytes,
                         len(allocations), pack_size(ordered), len(model_extents), reused)


def write_pack_from_resident(manifest: NativeManifest | Path | str, reader: AllocationReader, cache: NodeCache, *,
                             progress: Progress | None = None) -> PackRef:
    """Materialize the manifest's pack from resident allocations (after a recovery restore).

    Uses the capture's canonical writer. When the manifest binds a pack digest
    the result must equal it (else nothing is committed); without one, every
    extent is checked against its recorded SHA-256 instead.
    """
    if not isinstance(manifest, NativeManifest):
        manifest = load_manifest(manifest)
    if manifest.pack_sha256 and cache.contains(manifest.pack_sha256):
        from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import PayloadVerifier

        try:
            with PayloadVerifier().verify(cache, manifest.pack_sha256, manifest.pack_size):
                return PackRef.for_digest(manifest.pack_sha256, manifest.pack_size)
        except IntegrityError:
            pass  # quarantined; write a fresh one below
    prog = _Progress(progress, manifest.model_bytes)
    result = _write_canonical_pack(cache, manifest.model_extents, reader, crcs=None,
                                   expected_sha256=manifest.pack_sha256, prog=prog)
    return result.pack
