"""Stable weight allocations: memory at a fixed virtual address that can be released
before a snapshot and re-created at the same address on restore.

CPU: a private anonymous mmap. ``release`` drops its pages (MADV_DONTNEED) so the
CRIU image does not carry them; CRIU restores the mapping at the same address,
zero-filled, ready to hydrate.
CUDA: a VMM reservation (cuMemAddressReserve) with physical memory mapped into it.
``release`` unmaps and frees the physical memory but keeps the reservation;
``recreate`` maps new memory at the same address after the CUDA restore.
"""

from __future__ import annotations

import ctypes
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
        """Drop the pages: the mapping stays (same address), contents become zero."""
        self._mm.madvise(mmap.MADV_DONTNEED)
        self.resident = False

    def recreate(self) -> None:
        """Nothing to map on CPU: the restored mapping is already there, zero-filled."""
        self.resident = True

    def current_address(self) -> int:
        return ctypes.addressof(ctypes.c_char.from_buffer(self._mm))


class _CudaArrayView:
    """Minimal __cuda_array_interface__ exporter so torch can alias VMM memory."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def _check(result):
    from cuda.bindings import driver as cu

    err = result[0] if isinstance(result, tuple) else result
    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(err)[1]
        raise RuntimeError(f"CUDA driver call failed: {name.decode() if isinstance(name, bytes) else name}")
    if isinstance(result, tuple):
        return result[1] if len(result) == 2 else result[1:]
    return None


class CudaArena:
    """A stable GPU allocation: CUDA VMM reservation + physical memory mapped at it."""

    device = "cuda"

    def __init__(self, arena_id: str, size: int, device_index: int) -> None:
        from cuda.bindings import driver as cu

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
        raw = torch.as_tensor(_CudaArrayView(self.address + offset, nbytes), device=f"cuda:{self.device_index}")
        return raw.view(dtype).view(shape)

    def read(self, offset: int, size: int) -> bytes:
        """Copy bytes to the host (capture-time export)."""
        from cuda.bindings import driver as cu

        buf = bytearray(size)
        c_buf = (ctypes.c_char * size).from_buffer(buf)
        _check(cu.cuMemcpyDtoH(ctypes.addressof(c_buf), self.address + offset, size))
        return bytes(buf)

    def release(self) -> None:
        """Unmap and free the physical memory; keep the virtual reservation."""
        from cuda.bindings import driver as cu

        _check(cu.cuCtxSynchronize())
        _check(cu.cuMemUnmap(self.address, self.mapped_size))
        _check(cu.cuMemRelease(self._handle))
        self._handle = None
        self.resident = False

    def recreate(self) -> None:
        """Map new physical memory at the same address (after CUDA restore)."""
        if self._handle is None:
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
