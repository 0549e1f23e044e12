"""The optional native fill (``native/fill.c``): file -> small page-locked ring -> device, without the GIL.

Python reader threads reach about 0.6-0.8 of the pinned host->device rate; the limit is
not the page cache but host memory: with large staging buffers every byte crosses memory
three times (page cache read, staging write, DMA read). ``fill.c`` keeps a ring small
enough (threads x 2 x 4 MiB) to stay in the last-level cache, so the copy engine reads
the staging from the cache, and it runs the per-chunk loop in C threads, where a chunk
of 4 MiB costs no interpreter time (BENCHMARKS.md, "GPU hydration").

The library is built from ``native/fill.c`` at the collection root with the host's C
compiler (``build``; ``scripts/setup-venv.sh`` does it) into
``native/build/libcoldsnap_fill-<abi>-<digest>.so``, named by the source's digest so a stale
build is never loaded. ``COLDSNAP_NATIVE_LIB`` points at a library elsewhere. When
neither exists, :func:`load` returns None and ``CudaSink`` uses its Python path: the
native fill is a speed-up, never a requirement.

With ``ctx=None`` the same pipeline copies into host memory: that is how it is tested
on machines without a GPU.
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.hydrate import (
    FillJob,
    check_extent_digest,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.streams import Progress, truncated

ABI = 4
ENV_LIB = "COLDSNAP_NATIVE_LIB"
SLOTS = 2
CHUNK = 4 << 20
# Error kinds of struct cs_error (fill.c).
SHORT_READ, READ_ERRNO, CUDA, NOMEM, ARGS, CRYPTO = 1, 2, 3, 4, 5, 6


def source_path() -> Path:
    """``native/fill.c`` of this collection checkout (it may be absent in an installed collection)."""
    return Path(__file__).resolve().parents[3] / "native" / "fill.c"


def default_library_path(source: Path | None = None) -> Path | None:
    """Where :func:`build` puts the library for the current source, or None without a source."""
    source = source or source_path()
    try:
        digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    except OSError:
        return None
    return source.parent / "build" / f"libcoldsnap_fill-{ABI}-{digest}.so"


def compiler() -> str | None:
    """``$CC``, else ``cc`` or ``gcc`` on PATH."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return shutil.which("cc") or shutil.which("gcc")


def build(out: Path | None = None, *, source: Path | None = None) -> Path:
    """Compile ``fill.c`` into ``out`` (default: :func:`default_library_path`); returns the path.

    The library is written under a temporary name and renamed, so a concurrent
    loader never sees a half-written file.
    """
    source = source or source_path()
    if not source.is_file():
        raise ColdSnapError(f"the native fill source {source} is missing",
                            fix="build from a full checkout of the collection (native/ is not in this copy)")
    out = Path(out) if out else default_library_path(source)
    if out is None:
        raise ColdSnapError(f"the native fill source {source} cannot be read", fix="check its permissions")
    cc = compiler()
    if cc is None:
        raise ColdSnapError("building the native fill needs a C compiler (none of $CC, cc, gcc found)",
                            fix="install gcc (Debian: apt-get install gcc) or set CC")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    os.close(fd)
    cmd = [cc, "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-pthread", "-shared", "-fPIC",
           "-o", tmp, str(source), "-ldl"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise ColdSnapError(f"compiling {source} failed: {proc.stderr.strip()[-800:]}",
                                fix="check the C compiler; the Python hydration path works without the native fill")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


class Plan:
    """Fill jobs as C arrays of groups: ``pieces`` holds (fd, offset, size, dst) per piece, group
    ``g`` is ``pieces[starts[g]:starts[g + 1]]`` (contiguous destination bytes), ``job_of[i]`` is the
    index in ``jobs`` of piece ``i``'s job.

    Plain jobs are cut into groups of at most ``chunk`` bytes, so the threads share big extents.
    Hashed jobs (``sha256`` set) stay whole, one group each (a digest covers the whole extent),
    largest first so the longest ones start early. Built with flat integer lists, not
    per-piece objects: a 100 GB model is ~25,000 groups.
    """

    def __init__(self, jobs: Sequence[FillJob], ptrs: dict[str, int], chunk: int, *, hashed: bool = False) -> None:
        flat: list[int] = []
        starts: list[int] = []
        job_of: list[int] = []
        order = range(len(jobs))
        if hashed:
            order = sorted(order, key=lambda j: -jobs[j].size)
        for j in order:
            job = jobs[j]
            if (job.sha256 is not None) != hashed:
                raise ColdSnapError(f"{job.what or 'a fill job'} is {'not ' if hashed else ''}hash-checked",
                                    fix="plan plain and hash-checked jobs separately")
            dst = ptrs[job.allocation] + job.offset
            room = 0  # bytes left in the current group (plain jobs)
            if hashed:
                starts.append(len(job_of))
            for p in job.pieces:
                off, left = p.offset, p.size
                while left:
                    if not hashed and room == 0:
                        starts.append(len(job_of))
                        room = chunk
                    n = left if hashed else min(left, room)
                    flat += (p.fd, off, n, dst)
                    job_of.append(j)
                    dst += n
                    off += n
                    left -= n
                    room -= n
        starts.append(len(job_of))
        self.jobs = jobs
        self.hashed = hashed
        self.group_jobs = [jobs[j] for j in order] if hashed else []
        self.groups = len(starts) - 1
        self.bytes = sum(job.size for job in jobs)
        self.job_of = job_of
        self.pieces = (CsPiece * max(1, len(job_of))).from_buffer(array.array("Q", flat or [0, 0, 0, 0]))
        self.starts = (ctypes.c_uint64 * len(starts)).from_buffer(array.array("Q", starts))
        self.digests = (ctypes.c_ubyte * (32 * self.groups))() if hashed else None

    def check_digests(self) -> None:
        """After a hashed fill: every job's bytes must hash to its recorded digest (fail closed)."""
        raw = bytes(self.digests or b"")
        for g, job in enumerate(self.group_jobs):
            check_extent_digest(job, "sha256:" + raw[32 * g: 32 * g + 32].hex())


class CsPiece(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int64), ("offset", ctypes.c_uint64), ("size", ctypes.c_uint64),
                ("dst", ctypes.c_uint64)]


class CsError(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("code", ctypes.c_int32), ("piece", ctypes.c_int64),
                ("at", ctypes.c_uint64), ("call", ctypes.c_char * 48)]


def _open(path: Path) -> ctypes.CDLL:
    """dlopen the library (each call takes its own reference; :func:`unload` drops it)."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise ColdSnapError(f"the native fill library {path} cannot be loaded: {exc}",
                            fix=f"rebuild it (scripts/setup-venv.sh) or unset {ENV_LIB}") from None
    lib.cs_abi.restype = ctypes.c_int
    if lib.cs_abi() != ABI:
        found = lib.cs_abi()
        unload(lib)
        raise ColdSnapError(f"the native fill library {path} has ABI {found}, this code needs {ABI}",
                            fix="rebuild it from this collection's native/fill.c")
    lib.cs_sink_new.restype = ctypes.c_void_p
    lib.cs_sink_new.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_uint64,
                                ctypes.POINTER(CsError)]
    lib.cs_fill.restype = ctypes.c_int
    lib.cs_fill.argtypes = [ctypes.c_void_p, ctypes.POINTER(CsPiece), ctypes.POINTER(ctypes.c_uint64),
                            ctypes.c_uint64, ctypes.POINTER(ctypes.c_ubyte), ctypes.POINTER(ctypes.c_uint64),
                            ctypes.POINTER(CsError)]
    lib.cs_sink_stage_start.restype = None
    lib.cs_sink_stage_start.argtypes = [ctypes.c_void_p]
    lib.cs_sink_stage_wait.restype = ctypes.c_int
    lib.cs_sink_stage_wait.argtypes = [ctypes.c_void_p, ctypes.POINTER(CsError), ctypes.POINTER(ctypes.c_uint64)]
    lib.cs_sha256_available.restype = ctypes.c_int
    lib.cs_sink_free.restype = None
    lib.cs_sink_free.argtypes = [ctypes.c_void_p]
    return lib


def unload(lib: ctypes.CDLL) -> None:
    """Drop this reference to the library; with the last one the library leaves the address space.

    A restored engine unloads it after hydration, so a later snapshot of that process
    (sleep, recapture) does not depend on the library file.
    """
    import _ctypes

    _ctypes.dlclose(lib._handle)


def ensure_built() -> Path:
    """The library's path, compiled now if this source has no build yet (``$COLDSNAP_NATIVE_LIB``
    when set: nothing is built then). What set-up steps and benchmarks call; loading is :func:`load`."""
    explicit = os.environ.get(ENV_LIB)
    if explicit:
        return Path(explicit)
    path = default_library_path()
    if path is None:
        return build()  # raises with the reason (no source in this copy of the collection)
    return path if path.is_file() else build(path)


def load() -> ctypes.CDLL | None:
    """The native fill library, or None when it is not built (the caller then keeps the Python loop).

    ``$COLDSNAP_NATIVE_LIB`` names a library explicitly: it must then load. The caller
    owns the returned reference (:func:`unload`).
    """
    explicit = os.environ.get(ENV_LIB)
    if explicit:
        return _open(Path(explicit))
    path = default_library_path()
    return _open(path) if path is not None and path.is_file() else None


class FillFailure(ColdSnapError):
    """A native fill stopped; ``kind`` and ``code`` are fill.c's error kind and errno/CUresult."""

    def __init__(self, message: str, *, fix: str, kind: int, code: int) -> None:
        super().__init__(message, fix=fix)
        self.kind = kind
        self.code = code


class NativeLanes:
    """A pool of C fill threads, each with ``slots`` staging buffers of ``chunk`` bytes.

    ``ctx`` is a CUcontext address (device destinations) or None (host destinations: the
    pipeline ends in memcpy). Staging is allocated by each thread on its first group (or all
    at once by :meth:`stage`) and kept until :meth:`close`, which also drops the library reference.
    """

    def __init__(self, lib: ctypes.CDLL, ctx: int | None, *, threads: int, chunk: int = CHUNK,
                 slots: int = SLOTS) -> None:
        self.lib = lib
        self.chunk = chunk
        err = CsError()
        handle = lib.cs_sink_new(ctx or None, threads, slots, chunk, ctypes.byref(err))
        if not handle:
            unload(lib)
            call = err.call.decode(errors="replace")
            raise ColdSnapError(f"the native fill could not start ({call}; threads={threads}, slots={slots}, "
                                f"chunk={chunk})",
                                fix="use 1-64 threads, 1-8 slots, chunks of at least 4 KiB, and a host with the "
                                    "NVIDIA driver for device destinations")
        self.handle = handle
        self.hashes = bool(lib.cs_sha256_available())  # hash-checked jobs can take the native fill

    def stage(self, *, cuda_error: Callable[[int], str] | None = None) -> None:
        """Allocate (page-lock) every lane's staging now, one C thread per lane, and wait for it."""
        self.stage_start()
        self.stage_wait(cuda_error=cuda_error)

    def stage_start(self) -> None:
        """Start allocating every lane's staging on C threads (one per lane) and return at once.

        A :meth:`fill` may start meanwhile: each of its threads waits for its own lane only, so the
        lanes that are ready copy while the others are still page-locked; a lane whose staging
        failed allocates it again itself (and the fill reports that failure if it recurs).
        """
        self._open()
        self.lib.cs_sink_stage_start(self.handle)

    def stage_wait(self, *, cuda_error: Callable[[int], str] | None = None) -> float | None:
        """Wait for :meth:`stage_start`'s threads; return when they were done (``time.monotonic()``
        seconds; None when no staging ran) or raise their first failure."""
        self._open()
        err = CsError()
        end_ns = ctypes.c_uint64(0)
        if self.lib.cs_sink_stage_wait(self.handle, ctypes.byref(err), ctypes.byref(end_ns)) != 0:
            raise self._error(err, None, cuda_error)
        return end_ns.value / 1e9 if end_ns.value else None

    def _open(self) -> None:
        if self.handle is None:
            raise ColdSnapError("the native fill was used after close()", fix="create a new sink")

    def fill(self, jobs: Sequence[FillJob], ptrs: dict[str, int], *, progress: Progress | None = None,
             cuda_error: Callable[[int], str] | None = None) -> None:
        """Copy every job into ``ptrs[job.allocation] + job.offset`` onward.

        Hash-checked jobs (``sha256`` set) are hashed from the very bytes copied and checked
        after the fill (IntegrityError on a mismatch, as the Python loop does); they need
        :attr:`hashes`. Raises :class:`FillFailure` for the first failure, or IntegrityError
        for a file shorter than its pieces say; copies queued before a failure have completed.
        """
        self._open()
        hashed = [j for j in jobs if j.sha256 is not None]
        if hashed and not self.hashes:
            raise ColdSnapError("the native fill cannot hash here (OpenSSL's libcrypto was not found)",
                                fix="fill hash-checked jobs through the Python loop (CudaSink does so itself)")
        total = sum(j.size for j in jobs)
        base = 0
        for plan in (Plan([j for j in jobs if j.sha256 is None], ptrs, self.chunk),
                     Plan(hashed, ptrs, self.chunk, hashed=True)):
            if plan.groups:
                self._run(plan, progress, base, total, cuda_error)
                plan.check_digests()
                base += plan.bytes

    def _run(self, plan: Plan, progress: Progress | None, base: int, total: int, cuda_error) -> None:
        done = ctypes.c_uint64(0)
        err = CsError()
        call = (self.handle, plan.pieces, plan.starts, plan.groups, plan.digests, ctypes.byref(done),
                ctypes.byref(err))
        if progress is None:
            rc = self.lib.cs_fill(*call)
        else:
            rc = self._fill_reporting(call, done, lambda n: progress(base + n, total))
        if rc != 0:
            raise self._error(err, plan, cuda_error)

    def _fill_reporting(self, call, done: ctypes.c_uint64, report: Callable[[int], None]) -> int:
        """Run the fill on a helper thread (ctypes drops the GIL) and report progress from this one."""
        result: list[int] = []
        worker = threading.Thread(target=lambda: result.append(self.lib.cs_fill(*call)),
                                  name="coldsnap-native-fill", daemon=True)
        worker.start()
        last = -1
        while True:
            worker.join(0.05)
            if done.value != last:  # checked once more after the fill ended: the last report is the total
                last = done.value
                report(last)
            if not worker.is_alive():
                return result[0]

    @staticmethod
    def _error(err: CsError, plan: Plan | None, cuda_error) -> ColdSnapError:
        call = err.call.decode(errors="replace")
        piece = plan.pieces[err.piece] if plan is not None and 0 <= err.piece < len(plan.job_of) else None
        what = (plan.jobs[plan.job_of[err.piece]].what if plan is not None and piece is not None else "") \
            or "hydration source"
        if err.kind == SHORT_READ and piece is not None:
            return truncated(what, err.at, piece.size, piece.offset)
        if err.kind == READ_ERRNO and piece is not None:
            return FillFailure(f"reading {what} at {err.at} failed: {os.strerror(err.code)}",
                               fix="check the disk and the file", kind=err.kind, code=err.code)
        if err.kind == CUDA:
            name = cuda_error(err.code) if cuda_error else f"CUresult {err.code}"
            return FillFailure(f"CUDA {call} failed: {name}", fix="check the GPU, the driver and free host memory",
                               kind=err.kind, code=err.code)
        if err.kind == CRYPTO:
            return FillFailure(f"SHA-256 through OpenSSL's libcrypto failed ({call})",
                               fix="check the host's OpenSSL; CudaSink(strategy='pread') hashes in Python",
                               kind=err.kind, code=err.code)
        if err.kind == NOMEM:
            return FillFailure(f"the native fill ran out of memory ({call})", fix="free host memory or use fewer threads",
                               kind=err.kind, code=err.code)
        return FillFailure(f"the native fill failed ({call}, kind {err.kind})", fix="report this as a bug",
                           kind=err.kind, code=err.code)

    def close(self) -> None:
        if self.handle is not None:
            self.lib.cs_sink_free(self.handle)
            self.handle = None
            unload(self.lib)

    def __enter__(self) -> NativeLanes:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
