"""Stable allocations: memory at a fixed virtual address that can be released before a
snapshot and re-created at the same address on restore (the reference engine's arenas,
and the vLLM integration's weight arena on CPU).

CPU: a private anonymous mmap. Hydration may map the verified pack copy-on-write over
its pages (``payload.mapfill``). ``release`` maps fresh anonymous memory over the whole
arena at the same address (dropping its pages and any mapping of the pack) so the CRIU
image carries neither; CRIU restores the mapping at the same address, zero-filled,
ready to hydrate.
CUDA: a VMM reservation (cuMemAddressReserve) with physical memory mapped into it.
``release`` unmaps and frees the physical memory but keeps the reservation;
``recreate`` maps new memory at the same address after the CUDA restore.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
from dataclasses import dataclass


def _torch():
    import torch

    return torch


@dataclass(frozen=True)
class ArenaInfo:
    id: str
    address: int
    size: int
    device: str


class CpuArena:
    """A stable CPU allocation backed by a private anonymous mapping."""

    device = "cpu"

    def __init__(self, arena_id: str, size: int) -> None:
        self.id = arena_id
        self.size = size
        self._mm = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        self.resident = True

    def info(self) -> ArenaInfo:
        return ArenaInfo(self.id, self.address, self.size, self.device)

    @property
    def span(self) -> int:
        """Bytes of the mapping (the size rounded up to whole pages)."""
        return (max(self.size, 1) + PAGE - 1) // PAGE * PAGE

    def view(self) -> memoryview:
        """Writable bytes of the whole arena."""
        return memoryview(self._mm)[: self.size]

    def tensor(self, offset: int, shape: tuple[int, ...], dtype) -> object:
        """A torch tensor aliasing ``arena[offset : offset + nbytes]``."""
        torch = _torch()
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        raw = torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes, offset=offset)
        return raw.view(dtype).view(shape)

    def read(self, offset: int, size: int) -> memoryview:
        return memoryview(self._mm)[offset: offset + size]

    def release(self) -> None:
        """Drop the pages: fresh private anonymous memory at the same address, contents zero.

        Not MADV_DONTNEED: after a hydration that mapped the pack over the arena, that would
        only drop the copied-on-write pages and leave the file mapping (and the pack's bytes)
        for the snapshot. The pack's lease, if any, is dropped with it.
        """
        remap_anonymous(self.address, self.span)
        _forget_pack_mappings(self.address, self.span)
        self.resident = False

    def recreate(self) -> None:
        """Nothing to map on CPU: the restored mapping is already there, zero-filled."""
        self.resident = True

    def current_address(self) -> int:
        return ctypes.addressof(ctypes.c_char.from_buffer(self._mm))


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_KDL_CUDA, _KDL_UINT = 2, 1
_DLPACK_KEEP: list = []  # the C structs must outlive the tensors that alias them


def _alias_device_memory(ptr: int, nbytes: int, device_index: int):
    """A uint8 CUDA tensor that aliases ``[ptr, ptr + nbytes)`` exactly (DLPack, zero copy).

    ``torch.as_tensor`` on a ``__cuda_array_interface__`` object may copy memory it
    does not recognise (VMM mappings), which would move the weights out of the
    stable allocation; a DLPack capsule is always taken as is.
    """
    torch = _torch()
    shape = (ctypes.c_int64 * 1)(nbytes)
    managed = _DLManagedTensor()
    managed.dl_tensor = _DLTensor(ctypes.c_void_p(ptr), _DLDevice(_KDL_CUDA, device_index), 1,
                                  _DLDataType(_KDL_UINT, 8, 1), shape, None, 0)
    managed.manager_ctx = None
    managed.deleter = None
    _DLPACK_KEEP.append((managed, shape))
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    capsule = new_capsule(ctypes.addressof(managed), b"dltensor", None)
    return torch.utils.dlpack.from_dlpack(capsule)


def _check(result):
    from cuda.bindings import driver as cu

    err = result[0] if isinstance(result, tuple) else result
    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(err)[1]
        raise RuntimeError(f"CUDA driver call failed: {name.decode() if isinstance(name, bytes) else name}")
    if isinstance(result, tuple):
        return result[1] if len(result) == 2 else result[1:]
    return None


def _ensure_context(device_index: int) -> None:
    """Make the device's primary context current in this thread (driver calls need it)."""
    torch = _torch()
    torch.cuda.set_device(device_index)
    torch.cuda.current_stream(device_index)
    torch.empty(1, device=f"cuda:{device_index}")


class CudaArena:
    """A stable GPU allocation: CUDA VMM reservation + physical memory mapped at it."""

    device = "cuda"

    def __init__(self, arena_id: str, size: int, device_index: int) -> None:
        from cuda.bindings import driver as cu

        _ensure_context(device_index)
        self.id = arena_id
        self.device_index = device_index
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device_index
        self._prop = prop
        gran = _check(cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        self.size = size
        self.mapped_size = max(gran, (size + gran - 1) // gran * gran)
        self.address = int(_check(cu.cuMemAddressReserve(self.mapped_size, gran, 0, 0)))
        self._handle = None
        self._map()
        self.resident = True

    def _map(self) -> None:
        from cuda.bindings import driver as cu

        self._handle = _check(cu.cuMemCreate(self.mapped_size, self._prop, 0))
        _check(cu.cuMemMap(self.address, self.mapped_size, 0, self._handle, 0))
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device_index
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _check(cu.cuMemSetAccess(self.address, self.mapped_size, [access], 1))

    def info(self) -> ArenaInfo:
        return ArenaInfo(self.id, self.address, self.size, self.device)

    def tensor(self, offset: int, shape: tuple[int, ...], dtype) -> object:
        torch = _torch()
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        raw = _alias_device_memory(self.address + offset, nbytes, self.device_index)
        return raw.view(dtype).view(shape)

    def read(self, offset: int, size: int) -> bytes:
        """Copy bytes to the host (capture-time export)."""
        from cuda.bindings import driver as cu

        _ensure_context(self.device_index)
        buf = bytearray(size)
        c_buf = (ctypes.c_char * size).from_buffer(buf)
        _check(cu.cuMemcpyDtoH(ctypes.addressof(c_buf), self.address + offset, size))
        return bytes(buf)

    def release(self) -> None:
        """Unmap and free the physical memory; keep the virtual reservation."""
        from cuda.bindings import driver as cu

        _ensure_context(self.device_index)
        _check(cu.cuCtxSynchronize())
        _check(cu.cuMemUnmap(self.address, self.mapped_size))
        _check(cu.cuMemRelease(self._handle))
        self._handle = None
        self.resident = False

    def recreate(self) -> None:
        """Map new physical memory at the same address (after CUDA restore)."""
        if self._handle is None:
            _ensure_context(self.device_index)
            self._map()
        self.resident = True

    def current_address(self) -> int:
        return self.address


def make_arena(arena_id: str, size: int, device: str):
    """A CPU or CUDA arena for ``device`` ('cpu' or 'cuda[:N]')."""
    if device == "cpu":
        return CpuArena(arena_id, size)
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    return CudaArena(arena_id, size, index)


PAGE = mmap.PAGESIZE


@functools.cache
def _libc():
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    return libc


_MAP_FIXED = 0x10
_MAP_FAILED = ctypes.c_void_p(-1).value
MAPFILL_MODULE = "ansible_collections.coldsnap.fleet.plugins.module_utils.payload.mapfill"


def remap_anonymous(address: int, length: int) -> None:
    """Map fresh private anonymous memory over ``[address, address + length)`` (page-aligned), same address."""
    libc = _libc()
    got = libc.mmap(address, length, mmap.PROT_READ | mmap.PROT_WRITE,
                    mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED, -1, 0)
    if got == _MAP_FAILED or got != address:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap(MAP_FIXED | MAP_ANONYMOUS) of {length} bytes at {address:#x} failed")


def _forget_pack_mappings(address: int, length: int) -> None:
    """Drop the leases of pack mappings that lay in the range (only a process that hydrated through
    ``payload.mapfill`` has any: the module is then loaded)."""
    import sys

    mod = sys.modules.get(MAPFILL_MODULE)
    if mod is not None:
        mod.forget_range(address, length)


def release_interior(address: int, size: int) -> int:
    """Drop the pages wholly inside ``[address, address + size)`` (MADV_DONTNEED): they leave the
    process image and read back as zeros, the mapping stays. For memory ColdSnap did not allocate
    (an engine's KV cache); returns the bytes released."""
    lo = (address + PAGE - 1) // PAGE * PAGE
    hi = (address + size) // PAGE * PAGE
    if hi <= lo:
        return 0
    if _libc().madvise(lo, hi - lo, mmap.MADV_DONTNEED) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(MADV_DONTNEED) of {hi - lo} bytes at {lo:#x} failed")
    return hi - lo


def free_host_memory() -> None:
    """Collect garbage and give freed host (and cached GPU) memory back to the system, so a snapshot
    taken next does not carry it."""
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    torch = _torch_if_loaded()
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _torch_if_loaded():
    import sys

    return sys.modules.get("torch")
