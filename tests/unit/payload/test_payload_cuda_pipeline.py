"""CudaSink's pipeline logic (chunking, double buffering, event waits, extent hashing) on a CPU-only host.

The real driver is exercised by the ``gpu`` tests and bench/gpu_hydration.py. Here a small stand-in of
``cuda.bindings.driver`` keeps the semantics that matter for correctness: copies queued on a stream
read their pinned source only when the stream reaches them (at an event or stream synchronize), so
a staging buffer refilled before its copy completed would corrupt the result and fail these tests.
"""

from __future__ import annotations

import ctypes
import enum
import os
import sys
import threading
import types

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import cuda_sink as pcuda
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.hydrate import (
    hydrate_native,
    hydrate_recovery,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.pack import write_pack_from_resident
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import PayloadVerifier
from payload_testlib import capture, flip_checkpoint_byte, make_worker


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1


class DriverStandin:
    """Host-memory model of the driver calls CudaSink/CudaReader make."""

    def __init__(self) -> None:
        self.CUresult = CUresult
        self.CUstream_flags = types.SimpleNamespace(CU_STREAM_NON_BLOCKING=1)
        self.CUevent_flags = types.SimpleNamespace(CU_EVENT_DISABLE_TIMING=2)
        self.lock = threading.Lock()
        self.host: dict[int, ctypes.Array] = {}
        self.device: dict[int, ctypes.Array] = {}
        self.streams: dict[int, list] = {}
        self.copies = 0
        self.next_id = 1
        self.registered: dict[int, int] = {}  # page-locked file-mapping ranges: address -> length
        self.registrations = 0

    def _id(self) -> int:
        with self.lock:
            self.next_id += 1
            return self.next_id

    def device_alloc(self, size: int) -> int:
        buf = (ctypes.c_ubyte * size)()
        self.device[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def cuInit(self, flags):
        return (CUresult.CUDA_SUCCESS,)

    def cuDeviceGet(self, ordinal):
        return (CUresult.CUDA_SUCCESS, ordinal)

    def cuDevicePrimaryCtxRetain(self, dev):
        return (CUresult.CUDA_SUCCESS, "ctx")

    def cuDevicePrimaryCtxRelease(self, dev):
        return (CUresult.CUDA_SUCCESS,)

    def cuCtxSetCurrent(self, ctx):
        return (CUresult.CUDA_SUCCESS,)

    def cuGetErrorName(self, err):
        return (CUresult.CUDA_SUCCESS, CUresult(err).name.encode())

    def cuMemHostAlloc(self, size, flags):
        buf = (ctypes.c_ubyte * size)()
        self.host[ctypes.addressof(buf)] = buf
        return (CUresult.CUDA_SUCCESS, ctypes.addressof(buf))

    def cuMemFreeHost(self, ptr):
        del self.host[ptr]
        return (CUresult.CUDA_SUCCESS,)

    def cuStreamCreate(self, flags):
        sid = self._id()
        self.streams[sid] = []
        return (CUresult.CUDA_SUCCESS, sid)

    def cuStreamDestroy(self, sid):
        assert not self.streams.pop(sid), "destroying a stream with pending work"
        return (CUresult.CUDA_SUCCESS,)

    def cuEventCreate(self, flags):
        return (CUresult.CUDA_SUCCESS, {"stream": None, "upto": 0})

    def cuEventDestroy(self, ev):
        return (CUresult.CUDA_SUCCESS,)

    def _run(self, sid: int, upto: int | None = None) -> None:
        ops = self.streams[sid]
        while ops and (upto is None or ops[0][0] < upto):
            _seq, dst, src, n = ops.pop(0)
            assert self._pinned(src, n), "the copy's source was unpinned before the copy ran"
            if not self._inside(dst, n):
                raise AssertionError(f"copy to {dst:#x}+{n} is outside every device allocation")
            ctypes.memmove(dst, src, n)  # the source is read only now, as a DMA engine would

    def _inside(self, ptr: int, n: int) -> bool:
        return any(base <= ptr and ptr + n <= base + len(buf) for base, buf in self.device.items())

    def _pinned(self, src: int, n: int) -> bool:
        return any(b <= src and src + n <= b + len(v) for b, v in self.host.items()) or any(
            b <= src and src + n <= b + ln for b, ln in self.registered.items())

    def cuMemHostRegister(self, ptr, size, flags):
        ptr = int(ptr)
        assert ptr % 4096 == 0 and size % 4096 == 0 and flags == 8, "read-only, page-aligned registration"
        with self.lock:
            assert all(ptr + size <= b or b + ln <= ptr for b, ln in self.registered.items()), "overlap"
            self.registered[ptr] = size
            self.registrations += 1
        return (CUresult.CUDA_SUCCESS,)

    def cuMemHostUnregister(self, ptr):
        with self.lock:
            del self.registered[int(ptr)]
        return (CUresult.CUDA_SUCCESS,)

    def cuMemcpyHtoDAsync(self, dst, src, n, sid):
        assert self._pinned(int(src), int(n)), "HtoD from memory that is not page-locked"
        self.copies += 1
        self.streams[sid].append((self._id(), int(dst), int(src), int(n)))
        return (CUresult.CUDA_SUCCESS,)

    def cuEventRecord(self, ev, sid):
        ev["stream"], ev["upto"] = sid, self._id()
        return (CUresult.CUDA_SUCCESS,)

    def cuEventSynchronize(self, ev):
        if ev["stream"] is not None:
            self._run(ev["stream"], ev["upto"])
        return (CUresult.CUDA_SUCCESS,)

    def cuStreamSynchronize(self, sid):
        self._run(sid)
        return (CUresult.CUDA_SUCCESS,)

    def cuMemGetAddressRange(self, ptr):
        for base, buf in self.device.items():
            if base <= ptr < base + len(buf):
                return (CUresult.CUDA_SUCCESS, base, len(buf))
        return (CUresult.CUDA_ERROR_INVALID_VALUE, 0, 0)

    def cuMemcpyDtoH(self, dst, src, n):
        assert self._inside(int(src), n)
        ctypes.memmove(int(dst), int(src), n)
        return (CUresult.CUDA_SUCCESS,)


@pytest.fixture
def drv(monkeypatch):
    """The stand-in driver, and no native fill: the C library would call the real libcuda
    (its pipeline is tested on the CPU by test_native_fill.py, on a GPU by test_payload_cuda.py)."""
    monkeypatch.setattr(pcuda.native_fill, "load", lambda **_kw: None)
    d = DriverStandin()
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = d
    cuda_pkg = types.ModuleType("cuda")
    cuda_pkg.bindings = bindings
    monkeypatch.setitem(sys.modules, "cuda", cuda_pkg)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", d)
    return d


def _device_copy(drv, w):
    return {a.id: drv.device_alloc(a.size) for a in w.allocations}


def _read(drv, ptr, size):
    return ctypes.string_at(ptr, size)


@pytest.mark.parametrize("threads,chunk,strategy", [(1, 4096, "pread"), (3, 4096, "pread"), (4, 1 << 20, "pread"),
                                                    (3, 4096, "register"), (2, 1 << 20, "register")])
def test_cuda_sink_pipeline_native_and_recovery(tmp_path, drv, threads, chunk, strategy):
    w = make_worker(tmp_path)
    wp, out, cache = capture(tmp_path, w)
    for provider in ("native", "recovery"):
        ptrs = _device_copy(drv, w)
        with pcuda.CudaSink(ptrs, 0, threads=threads, chunk=chunk, strategy=strategy) as sink:
            if provider == "native":
                with PayloadVerifier().verify(cache, wp.pack.sha256, wp.pack.size) as v:
                    hydrate_native(out / "native-manifest.json", v, out / "weights.blob", sink)
            else:
                hydrate_recovery(out / "native-manifest.json", out / "replay-plan.json", w.ckpt_dir,
                                 out / "weights.blob", sink)
        for a in w.allocations:
            assert _read(drv, ptrs[a.id], a.size) == bytes(w.buffers[a.id]), (provider, a.id)
    assert drv.copies > len(w.extents), "small chunks must split extents into several copies"
    assert drv.host == {} and drv.registered == {}, "pinned buffers and registrations are released on close"
    assert (drv.registrations > 0) == (strategy == "register")


def test_cuda_sink_checks_device_allocation_sizes(tmp_path, drv):
    w = make_worker(tmp_path)
    wp, out, cache = capture(tmp_path, w)
    ptrs = _device_copy(drv, w)
    small = w.allocations[0]
    ptrs[small.id] = drv.device_alloc(small.size - 1)
    with pcuda.CudaSink(ptrs, 0, threads=2) as sink, \
            PayloadVerifier().verify(cache, wp.pack.sha256, wp.pack.size) as v, \
            pytest.raises(IntegrityError, match="size change"):
        hydrate_native(out / "native-manifest.json", v, out / "weights.blob", sink)


def test_cuda_sink_recovery_detects_a_wrong_checkpoint(tmp_path, drv):
    w = make_worker(tmp_path)
    _wp, out, _cache = capture(tmp_path, w)
    flip_checkpoint_byte(w)
    with pcuda.CudaSink(_device_copy(drv, w), 0, threads=2, chunk=4096) as sink, \
            pytest.raises(IntegrityError, match="pinned revision"):
        hydrate_recovery(out / "native-manifest.json", out / "replay-plan.json", w.ckpt_dir, out / "weights.blob",
                         sink)


def test_cuda_reader_materializes_the_capture_pack(tmp_path, drv):
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache

    w = make_worker(tmp_path)
    wp, out, _cache = capture(tmp_path, w)
    ptrs = _device_copy(drv, w)
    for a in w.allocations:
        ctypes.memmove(ptrs[a.id], bytes(w.buffers[a.id]), a.size)
    reader = pcuda.CudaReader(ptrs, 0, chunk=4096)
    try:
        ref = write_pack_from_resident(out / "native-manifest.json", reader, NodeCache(tmp_path / "gpu-host"))
    finally:
        reader.close()
    assert ref == wp.pack


def test_restore_sinks_take_the_hosts_lanes_or_the_ones_set(drv, monkeypatch):
    ptrs = {"a": drv.device_alloc(4096)}
    monkeypatch.delenv(pcuda.ENV_LANES, raising=False)
    with pcuda.CudaSink(ptrs, 0) as sink:  # steady fills: three quarters of the cores, at most 16
        assert sink.threads == max(1, min(16, (os.cpu_count() or 1) * 3 // 4))
    with pcuda.CudaSink.for_restore(ptrs, 0) as sink:  # the Python loop (no native library in these tests)
        assert sink.engine == "python"
        assert (sink.threads, sink.chunk) == (min(pcuda.PYTHON_RESTORE_LANES, max(1, (os.cpu_count() or 1) * 3 // 4)),
                                              pcuda.RESTORE_CHUNK)
    with pcuda.CudaSink.for_restore(ptrs, 0, threads=1) as sink:
        assert sink.threads == 1
    monkeypatch.setenv(pcuda.ENV_LANES, "5")
    with pcuda.CudaSink.for_restore(ptrs, 0) as sink:
        assert sink.threads == 5
    for bad in ("0", "65", "eight", "-3"):
        monkeypatch.setenv(pcuda.ENV_LANES, bad)
        with pytest.raises(ColdSnapError, match=f"COLDSNAP_GPU_FILL_LANES='{bad}' is not a number of fill threads "
                                                "from 1 to 64; set COLDSNAP_GPU_FILL_LANES to 1-64"):
            pcuda.CudaSink.for_restore(ptrs, 0)


def test_cuda_sink_strategies_without_the_native_library(drv):
    with pcuda.CudaSink({"a": drv.device_alloc(4096)}, 0) as sink:
        assert (sink.strategy, sink.engine) == ("pread", "python")
    with pytest.raises(ColdSnapError, match=r"native fill library is not built.*setup-venv"):
        pcuda.CudaSink({"a": 0}, 0, strategy="native")
    with pytest.raises(ColdSnapError, match="strategy 'dma' is unknown; use one of auto, native, pread, register"):
        pcuda.CudaSink({"a": 0}, 0, strategy="dma")
