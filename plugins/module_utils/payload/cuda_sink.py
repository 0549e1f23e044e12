"""GPU side of hydration and capture through cuda-python's driver API (``cuda.bindings.driver``).

:class:`CudaSink` streams file bytes into device allocations through page-locked
staging: reader threads ``pread`` a chunk into a staging slot, queue
``cuMemcpyHtoDAsync`` of it on their own stream, and wait on the slot's event
before refilling it, so reads of the next chunk overlap the DMA of the previous
one. Two engines run that loop:

* ``native`` (``native_fill``, the C library built from ``native/fill.c``): C threads
  and a ring small enough to stay in the CPU's last-level cache; used whenever the
  library is built (strategy ``auto``);
* ``python``: the same loop in Python threads with larger buffers; always available.

Recovery's hash-checked extents are hashed from the staged bytes, the very bytes copied.

:class:`CudaReader` reads device allocations back through a pinned buffer
(capture and materialization of GPU-resident weights).

cuda-python is optional: importing this module needs nothing; creating a
sink or reader without it raises a clear "missing library" error.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import native_fill
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.hydrate import (
    FillJob,
    _check_ids_sizes,
    check_extent_digest,
    split_jobs,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import Allocation
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.streams import Progress, read_exact_into

DEFAULT_CHUNK = 32 << 20
RESTORE_CHUNK = 4 << 20  # see CudaSink.for_restore
PYTHON_RESTORE_LANES = 8  # the Python loop's fastest first fill (its lanes page-lock as they start copying)
ENV_LANES = "COLDSNAP_GPU_FILL_LANES"  # the fill threads of a hydration (default: default_lanes())
STRATEGIES = ("auto", "native", "pread", "register")
PAGE = 4096


def _round_page(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def default_lanes(most: int = 16) -> int:
    """Fill threads for this host: ``$COLDSNAP_GPU_FILL_LANES``, else three quarters of the cores, at most ``most``.

    Page-cache reads run ~4-7 GB/s per thread; a pinned H2D link takes ~50 GB/s: use most of
    the cores, not all (12 beat 16 readers on a 16-core H200 host, 16 beat 24 and 32 on a
    32-core one: the copy engine and the page cache share the memory bus; BENCHMARKS.md).
    """
    raw = os.environ.get(ENV_LANES, "").strip()
    if not raw:
        return max(1, min(most, (os.cpu_count() or 1) * 3 // 4))
    if not raw.isdigit() or not 1 <= int(raw) <= 64:
        raise ColdSnapError(f"{ENV_LANES}={raw!r} is not a number of fill threads from 1 to 64",
                            fix=f"set {ENV_LANES} to 1-64, or unset it for three quarters of the cores")
    return int(raw)


def _libc() -> Any:
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return lib


def _libc_mmap(size: int, fd: int) -> int:
    """A read-only shared mapping of the whole file (its address, for cuMemHostRegister)."""
    import mmap as _mmap

    addr = _libc().mmap(None, size, _mmap.PROT_READ, _mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        err = ctypes.get_errno()
        raise ColdSnapError(f"mmap of the hydration source failed: {os.strerror(err)}",
                            fix="use strategy 'pread'")
    return int(addr)


def _libc_munmap(addr: int, size: int) -> None:
    _libc().munmap(addr, size)


def driver() -> Any:
    """The cuda-python driver module (``cuda.bindings.driver``, or ``cuda.cuda`` on cuda-python < 12.6)."""
    try:
        from cuda.bindings import driver as drv
    except ImportError:
        try:
            from cuda import cuda as drv  # type: ignore[no-redef]
        except ImportError:
            raise ColdSnapError("GPU hydration needs cuda-python (module cuda.bindings.driver)",
                                fix="pip install cuda-python on the GPU host") from None
    return drv


def error_name(err: Any) -> str:
    """``CUDA_ERROR_...`` for a CUresult (or its integer value)."""
    drv = driver()
    try:
        _e, name = drv.cuGetErrorName(drv.CUresult(err) if isinstance(err, int) else err)
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        return str(err)


def check(result: Any, what: str) -> Any:
    """Unpack a cuda-python ``(CUresult, *values)`` tuple; raise on any error."""
    drv = driver()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise ColdSnapError(f"CUDA {what} failed: {error_name(err)}",
                            fix="check the GPU, the driver and free device memory")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


class _Context:
    """The device's primary context (shared with torch when torch uses the same device)."""

    def __init__(self, device: int) -> None:
        self.drv = driver()
        try:
            result = self.drv.cuInit(0)
        except Exception as exc:  # cuda-python raises its own loader errors when libcuda is absent
            raise ColdSnapError(f"the NVIDIA driver library could not be loaded ({type(exc).__name__}: {exc})",
                                fix="run GPU hydration on a host with the NVIDIA driver installed") from None
        check(result, "cuInit")
        self.dev = check(self.drv.cuDeviceGet(device), f"cuDeviceGet({device})")
        self.ctx = check(self.drv.cuDevicePrimaryCtxRetain(self.dev), "cuDevicePrimaryCtxRetain")

    def make_current(self) -> None:
        check(self.drv.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def release(self) -> None:
        check(self.drv.cuDevicePrimaryCtxRelease(self.dev), "cuDevicePrimaryCtxRelease")


class _Pinned:
    """One page-locked host buffer with a memoryview over it."""

    def __init__(self, drv: Any, size: int) -> None:
        self.drv = drv
        self.size = size
        self.ptr = int(check(drv.cuMemHostAlloc(size, 0), f"cuMemHostAlloc({size})"))
        self.view = memoryview((ctypes.c_ubyte * size).from_address(self.ptr)).cast("B")

    def free(self) -> None:
        if self.ptr:
            self.view.release()
            check(self.drv.cuMemFreeHost(self.ptr), "cuMemFreeHost")
            self.ptr = 0


class _Lane:
    """A reader thread's resources: one stream, two pinned buffers, one event per buffer."""

    def __init__(self, drv: Any, chunk: int) -> None:
        self.drv = drv
        flags = drv.CUstream_flags.CU_STREAM_NON_BLOCKING
        self.stream = check(drv.cuStreamCreate(flags), "cuStreamCreate")
        self.bufs = [_Pinned(drv, chunk), _Pinned(drv, chunk)]
        ev_flags = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.events = [check(drv.cuEventCreate(ev_flags), "cuEventCreate") for _buf in self.bufs]
        self.slot = 0
        self.registered: list[tuple[Any, int]] = []  # (event, host address) of in-place registered chunks

    def free(self) -> None:
        check(self.drv.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
        for ev in self.events:
            check(self.drv.cuEventDestroy(ev), "cuEventDestroy")
        for b in self.bufs:
            b.free()
        check(self.drv.cuStreamDestroy(self.stream), "cuStreamDestroy")


class CudaSink:
    """Hydrate into device memory: ``ptrs`` maps allocation id -> device address on ``device``.

    ``sizes`` (optional) are the allocations' byte sizes; without them each
    ``[ptr, ptr + size)`` from the manifest must lie inside the device
    allocation that contains ``ptr`` (``cuMemGetAddressRange``). Buffers and
    streams are created on first use and reused until :meth:`close`.

    ``strategy``: ``"auto"`` (default) is ``"native"`` when the native fill library is
    built (:func:`native_fill.load`) and ``"pread"`` otherwise; ``"native"`` requires the
    library; ``"pread"`` is the Python loop; ``"register"`` (experimental, slow: page-locking
    the page cache costs more than copying it) maps the source file and page-locks each
    4 KiB-aligned chunk in place (``cuMemHostRegister`` READ_ONLY) for the DMA to read.
    Hash-checked (recovery) jobs are hashed from the staged bytes before their copy: by the
    native fill through OpenSSL's libcrypto, or by the Python loop where libcrypto is not found.
    ``engine`` says which loop runs the plain jobs (``"native"`` or ``"python"``).
    Without ``threads`` the sink takes :func:`default_lanes`, at most ``python_lanes`` for the
    Python loop.
    """

    def __init__(self, ptrs: dict[str, int], device: int = 0, *, sizes: dict[str, int] | None = None,
                 threads: int | None = None, chunk: int | None = None, strategy: str = "auto",
                 python_lanes: int = 16) -> None:
        if strategy not in STRATEGIES:
            raise ColdSnapError(f"CUDA hydration strategy {strategy!r} is unknown",
                                fix=f"use one of {', '.join(STRATEGIES)}")
        lib = None
        if strategy in ("auto", "native"):
            lib = native_fill.load()
            if lib is None and strategy == "native":
                raise ColdSnapError("the native fill library is not built",
                                    fix="build it (scripts/setup-venv.sh, or native_fill.ensure_built()) or use strategy "
                                        "'auto'")
        self.strategy = "native" if lib is not None else ("pread" if strategy == "auto" else strategy)
        self.engine = "native" if lib is not None else "python"
        self.maps: dict[int, tuple[int, int]] = {}
        self.ptrs = {k: int(v) for k, v in ptrs.items()}
        self.sizes = dict(sizes) if sizes is not None else None
        self.threads = threads or default_lanes(16 if lib is not None else python_lanes)
        self.chunk = chunk or (native_fill.CHUNK if lib is not None else DEFAULT_CHUNK)
        try:
            self.ctx = _Context(device)
        except BaseException:
            if lib is not None:
                native_fill.unload(lib)
            raise
        self.drv = self.ctx.drv
        try:
            self.native = (native_fill.NativeLanes(lib, int(self.ctx.ctx), threads=self.threads, chunk=self.chunk)
                           if lib is not None else None)
        except BaseException:
            self.ctx.release()
            raise
        self.lanes: list[_Lane | None] = [None] * self.threads  # lane i belongs to fill thread i
        self._map_lock = threading.Lock()
        self._staging = False  # stage() started page-locking the native lanes' staging
        # seconds of that staging still to run when fill() started (its lanes that were ready copied meanwhile)
        self.staging_wait: float | None = None

    @classmethod
    def for_restore(cls, ptrs: dict[str, int], device: int = 0, *, sizes: dict[str, int] | None = None,
                    threads: int | None = None) -> CudaSink:
        """A sink for one fill into a freshly restored process.

        Every restore page-locks its staging afresh (a snapshot must not carry pinned memory).
        The native fill page-locks it from here on, in the background (:meth:`stage`), while the
        caller still checks the manifest and the payload, so the fill finds it (nearly) ready (its
        lanes start as their own staging is ready) and can use as many lanes as a steady-state
        fill; the Python loop, whose lanes page-lock their staging (``cuMemHostAlloc``,
        serialized) as they start copying, keeps to ``PYTHON_RESTORE_LANES`` unless told
        (BENCHMARKS.md, "GPU hydration").
        """
        sink = cls(ptrs, device, sizes=sizes, chunk=RESTORE_CHUNK, threads=threads, python_lanes=PYTHON_RESTORE_LANES)
        sink.stage()
        return sink

    def stage(self) -> None:
        """Start page-locking every lane's staging now on C threads (native fill; the Python loop
        allocates each lane's on first use), so that it overlaps the caller's own work. A
        :meth:`fill` may begin before it is done: each fill thread waits for its own lane only.
        :meth:`close` waits for it."""
        if self.native is None or self._staging:
            return
        self.native.stage_start()
        self._staging = True

    def staged(self, fill_started: float | None = None) -> None:
        """Wait for :meth:`stage`'s threads (if any) and raise their failure. ``fill_started``
        (``time.monotonic()``): record in :attr:`staging_wait` how much staging was left then."""
        if not self._staging:
            return
        self._staging = False
        ended = self.native.stage_wait(cuda_error=error_name)
        if fill_started is not None:
            self.staging_wait = max(0.0, ended - fill_started) if ended is not None else 0.0

    def check_allocations(self, allocations: Sequence[Allocation]) -> None:
        if self.sizes is not None:
            _check_ids_sizes(self.sizes, allocations)
            return
        want = {a.id: a.size for a in allocations}
        _check_ids_sizes({k: want.get(k, -1) for k in self.ptrs}, allocations)
        self.ctx.make_current()
        for a in allocations:
            base, rsize = check(self.drv.cuMemGetAddressRange(self.ptrs[a.id]), f"cuMemGetAddressRange({a.id})")
            base = int(base)
            if self.ptrs[a.id] + a.size > base + int(rsize):
                raise IntegrityError(
                    f"device allocation {a.id!r} at {self.ptrs[a.id]:#x} has {base + int(rsize) - self.ptrs[a.id]} "
                    f"bytes, the manifest says {a.size}",
                    fix="the restored process does not match the capture (size change); recapture")

    def _lane(self, i: int) -> _Lane:
        """Lane ``i``, created by fill thread ``i`` itself on first use: page-locking the staging
        buffers is the slow part of a first fill (a restore's), so the lanes do it in parallel
        and the first ones start copying while the others still allocate."""
        lane = self.lanes[i]
        if lane is None:
            lane = self.lanes[i] = _Lane(self.drv, self.chunk)
        return lane

    def fill(self, jobs: Sequence[FillJob], *, progress: Progress | None = None) -> None:
        started = time.monotonic()
        total = sum(j.size for j in jobs)
        done = 0
        if self.native is not None:
            native = [j for j in jobs if j.sha256 is None or self.native.hashes]
            jobs = [j for j in jobs if not (j.sha256 is None or self.native.hashes)]
            if native:  # runs alongside what is left of stage(): each lane waits for its own staging
                self.native.fill(native, self.ptrs, progress=(lambda n, _t: progress(n, total)) if progress else None,
                                 cuda_error=error_name)
            done = sum(j.size for j in native)
            try:
                self.staged(started)
            except ColdSnapError:
                pass  # moot after a fill that landed: each of its lanes allocated what the staging had not
        if jobs:
            self._python_fill(jobs, progress, total, done)

    def _python_fill(self, jobs: Sequence[FillJob], progress: Progress | None, total: int, done: int) -> None:
        work: queue.SimpleQueue = queue.SimpleQueue()
        for job in split_jobs(jobs, self.chunk):
            work.put(job)
        lock = threading.Lock()
        state = {"done": done}
        errors: list[BaseException] = []

        def report(n: int) -> None:
            with lock:
                state["done"] += n
                if progress:
                    progress(state["done"], total)

        def run(i: int) -> None:
            try:
                self.ctx.make_current()
                lane = None
                while not errors:
                    try:
                        job = work.get_nowait()
                    except queue.Empty:
                        break
                    lane = lane or self._lane(i)  # no staging for a thread that finds no work
                    if self._registrable(job):
                        self._register_job(lane, job, report)
                    else:
                        self._copy_job(lane, job, report)
                if lane is not None:
                    check(self.drv.cuStreamSynchronize(lane.stream), "cuStreamSynchronize")
                    self._unregister_done(lane, keep=0)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,), name=f"coldsnap-cuda-{i}", daemon=True)
                   for i in range(self.threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def _registrable(self, job: FillJob) -> bool:
        if self.strategy != "register" or job.sha256 is not None or len(job.pieces) != 1:
            return False
        piece = job.pieces[0]
        if piece.offset % PAGE:
            return False
        size = self._map_size(piece.fd)
        return piece.offset + _round_page(piece.size) <= size

    def _map_size(self, fd: int) -> int:
        with self._map_lock:
            if fd not in self.maps:
                size = os.fstat(fd).st_size
                addr = _libc_mmap(size, fd)
                self.maps[fd] = (addr, size)
            return self.maps[fd][1]

    def _register_job(self, lane: _Lane, job: FillJob, report) -> None:
        drv = self.drv
        piece = job.pieces[0]
        base = self.maps[piece.fd][0]
        src = base + piece.offset
        length = _round_page(piece.size)
        flags = getattr(drv, "CU_MEMHOSTREGISTER_READ_ONLY", 8)
        check(drv.cuMemHostRegister(src, length, flags), "cuMemHostRegister (read-only file mapping)")
        ev = check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        check(drv.cuMemcpyHtoDAsync(self.ptrs[job.allocation] + job.offset, src, piece.size, lane.stream),
              "cuMemcpyHtoDAsync")
        check(drv.cuEventRecord(ev, lane.stream), "cuEventRecord")
        lane.registered.append((ev, src))
        self._unregister_done(lane, keep=2)
        report(piece.size)

    def _unregister_done(self, lane: _Lane, *, keep: int) -> None:
        while len(lane.registered) > keep:
            ev, src = lane.registered.pop(0)
            check(self.drv.cuEventSynchronize(ev), "cuEventSynchronize")
            check(self.drv.cuMemHostUnregister(src), "cuMemHostUnregister")
            check(self.drv.cuEventDestroy(ev), "cuEventDestroy")

    def _copy_job(self, lane: _Lane, job: FillJob, report) -> None:
        drv = self.drv
        hasher = hashlib.sha256() if job.sha256 is not None else None
        dst = self.ptrs[job.allocation] + job.offset
        pieces = [(p.fd, p.offset, p.size) for p in job.pieces]
        i = 0
        while i < len(pieces):
            buf = lane.bufs[lane.slot]
            event = lane.events[lane.slot]
            check(drv.cuEventSynchronize(event), "cuEventSynchronize")  # the buffer's last copy is done
            used = 0
            while i < len(pieces) and used < buf.size:
                fd, off, n = pieces[i]
                take = min(n, buf.size - used)
                read_exact_into(fd, buf.view[used:used + take], off, what=job.what or "hydration source")
                used += take
                if take < n:
                    pieces[i] = (fd, off + take, n - take)
                else:
                    i += 1
            if hasher is not None:
                hasher.update(buf.view[:used])
            check(drv.cuMemcpyHtoDAsync(dst, buf.ptr, used, lane.stream), "cuMemcpyHtoDAsync")
            check(drv.cuEventRecord(event, lane.stream), "cuEventRecord")
            lane.slot ^= 1
            dst += used
            report(used)
        if hasher is not None:
            check_extent_digest(job, "sha256:" + hasher.hexdigest())

    def close(self) -> None:
        """Wait for outstanding copies; free streams, events, pinned buffers, file mappings, the native
        library; release the context."""
        if self.native is not None:  # waits for stage()'s threads, if they still run
            self.native.close()
            self.native = None
        if any(self.lanes):
            self.ctx.make_current()
            for lane in self.lanes:
                if lane is not None:
                    self._unregister_done(lane, keep=0)
                    lane.free()
            self.lanes = [None] * self.threads
        for addr, size in self.maps.values():
            _libc_munmap(addr, size)
        self.maps = {}
        if self.ctx is not None:
            self.ctx.release()
            self.ctx = None  # type: ignore[assignment]

    def __enter__(self) -> CudaSink:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class CudaReader:
    """AllocationReader over device allocations (capture, materialization); returns views of a pinned buffer.

    The returned memoryview is valid until the next :meth:`read`.
    """

    def __init__(self, ptrs: dict[str, int], device: int = 0, *, chunk: int = DEFAULT_CHUNK) -> None:
        self.ptrs = {k: int(v) for k, v in ptrs.items()}
        self.ctx = _Context(device)
        self.drv = self.ctx.drv
        self.ctx.make_current()
        self.buf = _Pinned(self.drv, chunk)

    def read(self, allocation: str, offset: int, size: int) -> memoryview:
        self.ctx.make_current()
        if size > self.buf.size:
            self.buf.free()
            self.buf = _Pinned(self.drv, size)
        check(self.drv.cuMemcpyDtoH(self.buf.ptr, self.ptrs[allocation] + offset, size), "cuMemcpyDtoH")
        return self.buf.view[:size]

    def close(self) -> None:
        if self.ctx is not None:
            self.ctx.make_current()
            self.buf.free()
            self.ctx.release()
            self.ctx = None  # type: ignore[assignment]
