"""Hydration: rebuild every stable allocation, byte for byte, at the captured layout.

Two providers fill the same allocations:

* native: model extents from the verified pack fd + residual extents from ``weights.blob``;
* recovery: model extents from the pinned safetensors files through the replay
  plan + the same residual; every extent is checked against its captured SHA-256.

Everything that can be wrong (maps with gaps or overlaps, extents past an
allocation's end, a size or identity change, a residual or checkpoint that is
not the captured one) is refused before the sink writes its first byte. The
sink decides how bytes move: :class:`MemorySink` ``preadv``s straight into
memoryviews of the engine's arenas; :class:`MappingSink` maps the verified pack
copy-on-write over private CPU arenas where the pages line up and copies the rest
(``mapfill``); ``cuda.CudaSink`` streams through pinned buffers to device memory.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import mapfill
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import Allocation, FileRef
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.manifest import (
    NativeManifest,
    check_plan_matches,
    load_manifest,
    load_replay_plan,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.records import FileIdentity
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.recovery_source import check_pin
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.streams import (
    Progress,
    hash_fd,
    read_exact_into,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import VerifiedPayload

__all__ = [
    "AllocationSink",
    "FillJob",
    "HydrationStats",
    "MappingSink",
    "MemorySink",
    "Piece",
    "hydrate_native",
    "hydrate_recovery",
    "load_manifest",
]

SPLIT = 16 << 20


@dataclass(frozen=True)
class Piece:
    """``size`` bytes of file ``fd`` at ``offset``."""

    fd: int
    offset: int
    size: int


@dataclass(frozen=True)
class FillJob:
    """Fill ``allocation[offset:offset+size]`` with the concatenation of ``pieces``.

    With ``sha256`` the filled range must hash to it (recovery checks each
    extent); such a job is filled in order by one worker.
    """

    allocation: str
    offset: int
    size: int
    pieces: tuple[Piece, ...]
    sha256: str | None = None
    what: str = ""


class AllocationSink(Protocol):
    """Where hydrated bytes go (process memory, device memory)."""

    def check_allocations(self, allocations: Sequence[Allocation]) -> None:
        """Raise IntegrityError unless the sink holds exactly these allocations with these sizes."""

    def fill(self, jobs: Sequence[FillJob], *, progress: Progress | None = None) -> None:
        """Copy every job's pieces into place; raise on any failure."""


@dataclass(frozen=True)
class HydrationStats:
    """What one hydration did."""

    provider: str
    model_bytes: int
    residual_bytes: int
    extents: int
    seconds: float
    fill: str = "python"  # which copy loop ran: the sink's ``engine`` ("native": native/fill.c; "map", "map+python")
    mapped_bytes: int = 0  # model bytes mapped from the pack instead of copied (MappingSink)
    map_fallback: str | None = None  # why model bytes were copied where a MappingSink could map
    # seconds of page-locking still running when the fill started (CudaSink.for_restore; the
    # fill's lanes that were ready copied meanwhile)
    staging_wait: float | None = None

    @property
    def bytes(self) -> int:
        return self.model_bytes + self.residual_bytes

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {"provider": self.provider, "model_bytes": self.model_bytes, "residual_bytes": self.residual_bytes,
                "extents": self.extents, "seconds": round(self.seconds, 6), "gb_per_s": round(self.gb_per_s, 3),
                "fill": self.fill, "mapped_bytes": self.mapped_bytes,
                **({"map_fallback": self.map_fallback} if self.map_fallback else {}),
                **({"staging_wait_s": round(self.staging_wait, 6)} if self.staging_wait is not None else {})}


def split_jobs(jobs: Sequence[FillJob], chunk: int = SPLIT) -> list[FillJob]:
    """Cut unhashed jobs into pieces of at most ``chunk`` destination bytes so workers share big extents."""
    out: list[FillJob] = []
    for job in jobs:
        if job.sha256 is not None or job.size <= chunk:
            out.append(job)
            continue
        pos = job.offset
        cur: list[Piece] = []
        cur_size = 0
        for p in job.pieces:
            off, left = p.offset, p.size
            while left:
                n = min(left, chunk - cur_size)
                cur.append(Piece(p.fd, off, n))
                cur_size += n
                off += n
                left -= n
                if cur_size == chunk:
                    out.append(FillJob(job.allocation, pos, cur_size, tuple(cur), None, job.what))
                    pos += cur_size
                    cur, cur_size = [], 0
        if cur:
            out.append(FillJob(job.allocation, pos, cur_size, tuple(cur), None, job.what))
    return out


class _Counter:
    def __init__(self, cb: Progress | None, total: int) -> None:
        self.cb, self.total, self.done = cb, total, 0
        self.lock = threading.Lock()

    def add(self, n: int) -> None:
        with self.lock:
            self.done += n
            if self.cb:
                self.cb(self.done, self.total)


def run_jobs(jobs: Sequence[FillJob], work, threads: int) -> None:
    """Run ``work(job)`` on a thread pool; the first failure cancels the rest and is raised."""
    if threads <= 1 or len(jobs) <= 1:
        for job in jobs:
            work(job)
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="coldsnap-hydrate") as pool:
        futures = [pool.submit(work, job) for job in jobs]
        done, _pending = wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:
            f.cancel()
        for f in done:
            exc = f.exception()
            if exc is not None:
                raise exc


def check_extent_hash(job: FillJob, data) -> None:
    check_extent_digest(job, "sha256:" + hashlib.sha256(data).hexdigest())


def check_extent_digest(job: FillJob, actual: str) -> None:
    """A hash-checked job's bytes hashed to ``actual``: refuse anything but the digest the capture recorded."""
    if actual != job.sha256:
        raise IntegrityError(f"{job.what or 'extent'} -> {job.allocation}[{job.offset}:{job.offset + job.size}] "
                             f"hashes to {actual}, the capture recorded {job.sha256}",
                             fix="the checkpoint is not the pinned revision this artifact was captured from")


class MemorySink:
    """Hydrate into process memory: ``views`` maps allocation id -> writable buffer of the allocation's size."""

    def __init__(self, views: dict, *, threads: int | None = None) -> None:
        self.views = {k: memoryview(v).cast("B") for k, v in views.items()}
        for k, v in self.views.items():
            if v.readonly:
                raise ColdSnapError(f"allocation {k!r} is read-only", fix="pass a writable buffer (mmap, bytearray)")
        self.threads = threads or min(8, os.cpu_count() or 1)

    def check_allocations(self, allocations: Sequence[Allocation]) -> None:
        _check_ids_sizes({k: len(v) for k, v in self.views.items()}, allocations)

    def fill(self, jobs: Sequence[FillJob], *, progress: Progress | None = None) -> None:
        counter = _Counter(progress, sum(j.size for j in jobs))

        def work(job: FillJob) -> None:
            dest = self.views[job.allocation][job.offset:job.offset + job.size]
            pos = 0
            for p in job.pieces:
                read_exact_into(p.fd, dest[pos:pos + p.size], p.offset, what=job.what or "hydration source")
                pos += p.size
            if job.sha256 is not None:
                check_extent_hash(job, dest)
            counter.add(job.size)

        run_jobs(split_jobs(jobs), work, self.threads)


class MappingSink(MemorySink):
    """A :class:`MemorySink` that maps the verified pack over ``regions`` (allocation id -> (address, size)
    of private CPU mappings the engine owns) wherever the pages line up, and copies everything else.

    :func:`hydrate_native` offers the verified pack (:meth:`offer`); without an offer (recovery
    replay), with ``COLDSNAP_CPU_MAP=0`` or where nothing lines up it is a MemorySink. After a fill,
    ``mapped_bytes``, ``engine`` ("map", "map+python" or "python") and ``map_fallback`` say what
    happened; :meth:`discard` undoes the mappings of a hydration that failed afterwards.
    """

    def __init__(self, views: dict, regions: dict[str, tuple[int, int]], *, threads: int | None = None) -> None:
        super().__init__(views, threads=threads)
        self.regions = dict(regions)
        self.source: VerifiedPayload | None = None
        self.mapped_bytes = 0
        self.engine = "python"
        self.map_fallback: str | None = None
        self._runs: list[mapfill.Run] = []

    def offer(self, payload: VerifiedPayload) -> None:
        """The verified pack whose bytes may be mapped instead of copied (jobs reading its fd)."""
        self.source = payload

    def _legal_regions(self) -> tuple[dict[str, tuple[int, int]], str | None]:
        try:
            maps = mapfill._maps()
        except OSError as exc:
            return {}, f"cannot read the process's mappings ({exc.strerror})"
        legal = {k: r for k, r in self.regions.items() if k in self.views and mapfill.is_private_mapping(*r, maps)}
        return legal, (None if legal else "no allocation is a page-aligned private CPU mapping")

    def fill(self, jobs: Sequence[FillJob], *, progress: Progress | None = None) -> None:
        self.mapped_bytes, self._runs, self.engine = 0, [], "python"
        for address, size in self.regions.values():
            if mapfill.in_range(address, mapfill.page_span(size)):  # mapped by an earlier hydration
                mapfill.anonymize(address, mapfill.page_span(size))
                mapfill.forget_range(address, mapfill.page_span(size))
        if self.source is None:
            self.map_fallback = "no verified pack to map (recovery replay copies)"
            return super().fill(jobs, progress=progress)
        if not mapfill.enabled():
            self.map_fallback = f"mapping turned off ({mapfill.ENV_SWITCH}=0)"
            return super().fill(jobs, progress=progress)
        legal, why = self._legal_regions()
        runs, copies, reasons = mapfill.plan(jobs, legal, self.source.fd)
        if why:
            reasons = {why: sum(reasons.values())}
        done: list[mapfill.Run] = []
        try:
            for r in runs:
                try:
                    mapfill.map_file(r.address, r.size, self.source.fd, r.file_offset)
                except OSError as exc:
                    mapfill.anonymize(r.address, r.size)  # a failed MAP_FIXED may have unmapped the range
                    copies.append(FillJob(r.allocation, r.offset, r.size, (Piece(self.source.fd, r.file_offset, r.size),),
                                          None, "model payload"))
                    reason = mapfill.describe_errno(exc)
                    reasons[reason] = reasons.get(reason, 0) + r.size
                    continue
                done.append(r)
            self._runs = done
            if done:
                mapfill.hold(self.source, [(r.address, r.size) for r in done])
            self.mapped_bytes = sum(r.size for r in done)
            if progress is not None and self.mapped_bytes:
                progress(self.mapped_bytes, self.mapped_bytes + sum(j.size for j in copies))
            super().fill(copies, progress=(lambda n, t: progress(self.mapped_bytes + n, self.mapped_bytes + t))
                         if progress is not None else None)
        except BaseException:
            self.discard()
            raise
        copied_model = sum(reasons.values()) if reasons else 0
        self.engine = ("map+python" if copied_model else "map") if done else "python"
        self.map_fallback = "; ".join(sorted(reasons)) if reasons else None

    def discard(self) -> None:
        """Turn every page this sink mapped back into anonymous memory (zeros) and drop its lease."""
        for r in self._runs:
            mapfill.anonymize(r.address, r.size)
            mapfill.forget_range(r.address, r.size)
        self._runs = []
        self.mapped_bytes = 0
        self.engine = "python"


def _check_ids_sizes(have: dict[str, int], allocations: Sequence[Allocation]) -> None:
    want = {a.id: a.size for a in allocations}
    if set(have) != set(want):
        missing = sorted(set(want) - set(have))
        extra = sorted(set(have) - set(want))
        raise IntegrityError(f"the process holds allocations {sorted(have)}, the manifest lists {sorted(want)} "
                             f"(missing {missing}, unexpected {extra})",
                             fix="the restored process does not match the capture; recapture")
    for k, size in want.items():
        if have[k] != size:
            raise IntegrityError(f"allocation {k!r} has {have[k]} bytes, the manifest says {size}",
                                 fix="the restored process does not match the capture (size change); recapture")


class _OpenFile:
    """A source file opened once, checked (size, optional digest) and re-checked after use."""

    def __init__(self, path: Path, ref: FileRef, *, what: str, verify: bool = True) -> None:
        self.path, self.what = Path(path), what
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO never blocks
        except FileNotFoundError:
            raise ColdSnapError(f"{what} {self.path} does not exist", fix="check the unit's capsule state") from None
        try:
            st = os.fstat(self.fd)
            if not stat.S_ISREG(st.st_mode):
                raise IntegrityError(f"{what} {self.path} is not a regular file", fix="recapture")
            if st.st_size != ref.size:
                raise IntegrityError(f"{what} {self.path} has {st.st_size} bytes, the manifest says {ref.size}",
                                     fix="the capsule state is damaged; pull the capsule again or recapture")
            self.identity = FileIdentity.of(st)
            actual = "sha256:" + hash_fd(self.fd, ref.size, what=f"{what} {self.path}") if verify else ref.sha256
            if actual != ref.sha256:
                raise IntegrityError(f"{what} {self.path} hashes to {actual}, the manifest says {ref.sha256}",
                                     fix="the capsule state is damaged; pull the capsule again or recapture")
        except BaseException:
            os.close(self.fd)
            raise

    def recheck(self) -> None:
        if FileIdentity.of_fd(self.fd) != self.identity:
            raise IntegrityError(f"{self.what} {self.path} changed during hydration",
                                 fix="nothing may write the capsule state of a running unit; restore again")

    def close(self) -> None:
        os.close(self.fd)


def _residual_jobs(manifest: NativeManifest, fd: int) -> list[FillJob]:
    return [FillJob(e.allocation, e.offset, e.size, (Piece(fd, e.blob_offset, e.size),), None, "weights.blob")
            for e in manifest.residual_extents]


def hydrate_native(manifest: NativeManifest | Path | str, payload: VerifiedPayload | None, residual_path: Path,
                   sink: AllocationSink, *, progress: Progress | None = None,
                   verify_residual: bool = True) -> HydrationStats:
    """Fill every allocation from the verified pack (its open fd, never the path) and the residual blob.

    The residual's size is always checked; its SHA-256 too unless ``verify_residual`` is False
    (for callers whose capsule, which holds the residual, was already verified by image digest).
    """
    if not isinstance(manifest, NativeManifest):
        manifest = load_manifest(manifest)
    started = time.monotonic()
    if manifest.model_extents:
        if manifest.pack_sha256 is None:
            raise ColdSnapError("this capture has no native model payload (it was not exported)",
                                fix="restore with weights mode 'recovery' or 'auto'")
        if payload is None:
            raise ColdSnapError(f"native hydration needs the verified model payload {manifest.pack_sha256}",
                                fix="stage and verify it first (coldsnap.fleet.payload_stage)")
        if payload.sha256 != manifest.pack_sha256 or payload.size != manifest.pack_size:
            raise IntegrityError(f"the verified payload is {payload.sha256} ({payload.size} bytes), the manifest "
                                 f"binds {manifest.pack_sha256} ({manifest.pack_size} bytes)",
                                 fix="stage the payload this capture references")
        payload.recheck()
    residual = _OpenFile(Path(residual_path), manifest.residual, what="residual blob", verify=verify_residual)
    try:
        sink.check_allocations(manifest.allocations)
        jobs = [FillJob(e.allocation, e.offset, e.size, (Piece(payload.fd, e.pack_offset, e.size),), None,  # type: ignore[union-attr]
                        "model payload") for e in manifest.model_extents]
        offer = getattr(sink, "offer", None)
        if offer is not None and payload is not None and manifest.model_extents:
            offer(payload)
        jobs += _residual_jobs(manifest, residual.fd)
        try:
            sink.fill(jobs, progress=progress)
            residual.recheck()
            if payload is not None and manifest.model_extents:
                payload.recheck()  # mapped pages read this inode later: it must still be the verified one now
        except BaseException:
            discard = getattr(sink, "discard", None)
            if discard is not None:
                discard()
            raise
    finally:
        residual.close()
    return _stats("native", manifest, len(manifest.model_extents), started, sink)


def _stats(provider: str, manifest: NativeManifest, extents: int, started: float, sink) -> HydrationStats:
    return HydrationStats(provider, manifest.model_bytes, manifest.residual_bytes, extents, time.monotonic() - started,
                          getattr(sink, "engine", "python"), getattr(sink, "mapped_bytes", 0),
                          getattr(sink, "map_fallback", None) if getattr(sink, "regions", None) else None,
                          getattr(sink, "staging_wait", None))


def hydrate_recovery(manifest: NativeManifest | Path | str, replay_plan_path: Path, safetensors_dir: Path,
                     residual_path: Path, sink: AllocationSink, *, progress: Progress | None = None,
                     verify_extents: bool = True, verify_residual: bool = True) -> HydrationStats:
    """Fill every allocation from the pinned safetensors files (through the replay plan) and the residual blob.

    Every extent is checked against its captured SHA-256 unless ``verify_extents`` is False.
    """
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.safetensors import (
        SafetensorsFile,
        slice_ranges,
    )

    if not isinstance(manifest, NativeManifest):
        manifest = load_manifest(manifest)
    plan = load_replay_plan(replay_plan_path)
    check_plan_matches(manifest, plan)
    started = time.monotonic()
    opened: dict[str, SafetensorsFile] = {}
    residual: _OpenFile | None = None
    try:
        for name, pin in sorted(plan.files.items()):
            st = SafetensorsFile(Path(safetensors_dir) / name)
            opened[name] = st
            check_pin(st, pin)
        jobs: list[FillJob] = []
        for e in plan.extents:
            st = opened[e.source.file]
            info = st.tensor(e.source.tensor)
            if info.dtype != e.source.dtype or info.shape != tuple(e.source.shape):
                raise IntegrityError(f"tensor {info.name!r} in {st.path} is {info.dtype} {list(info.shape)}, the replay "
                                     f"plan expects {e.source.dtype} {list(e.source.shape)}",
                                     fix="download the pinned model revision")
            pieces = tuple(Piece(st.fd, off, n) for off, n in slice_ranges(info, e.source.slice))
            jobs.append(FillJob(e.allocation, e.offset, e.size, pieces, e.sha256 if verify_extents else None,
                                f"tensor {info.name!r} of {e.source.file}"))
        residual = _OpenFile(Path(residual_path), manifest.residual, what="residual blob", verify=verify_residual)
        sink.check_allocations(manifest.allocations)
        jobs += _residual_jobs(manifest, residual.fd)
        sink.fill(jobs, progress=progress)
        residual.recheck()
    finally:
        for st in opened.values():
            st.close()
        if residual is not None:
            residual.close()
    return _stats("recovery", manifest, len(plan.extents), started, sink)
