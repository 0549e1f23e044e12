"""The live stable-allocation table of one worker, and where it comes from.

A stable allocation keeps its virtual address while its memory is released and
re-created (CUDA VMM under vLLM's CuMemAllocator or torch_memory_saver; a
private mmap on CPU). The table maps allocation ids to (device, address, size)
and gives the payload library what it needs: ``Allocation`` records, a reader
for capture/materialization and a sink for hydration.

Ids are ``<tag>.<n>`` in creation order, so a process that re-creates the same
layout (the ``coldsnap`` load format on a template restore) gets the same ids.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import IntegrityError
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import Allocation


@dataclass(frozen=True, eq=False)
class LiveAllocation:
    """One stable allocation: ``device`` is 'cpu' or 'cuda:N'; CPU ones carry a writable view.

    ``private_mapping``: a CPU allocation that is a whole private mapping its owner created
    and releases by mapping anonymous memory over it (``CpuArena``), so hydration may map the
    verified pack over its pages instead of copying (``payload.mapfill``).
    """

    id: str
    device: str
    address: int
    size: int
    view: memoryview | None = field(default=None, repr=False)
    private_mapping: bool = False

    @property
    def device_index(self) -> int:
        return int(self.device.split(":", 1)[1]) if ":" in self.device else 0


class AllocationTable:
    """The stable weight allocations of one worker, in creation order."""

    def __init__(self, allocations: Iterable[LiveAllocation]) -> None:
        self.allocations = list(allocations)
        self.by_id = {a.id: a for a in self.allocations}
        if len(self.by_id) != len(self.allocations):
            raise IntegrityError("the live allocation table lists an allocation id twice",
                                 fix="give every stable allocation its own id")
        devices = {a.device for a in self.allocations}
        if len(devices) > 1:
            raise IntegrityError(f"one worker's stable allocations span devices {sorted(devices)}",
                                 fix="a worker hydrates one device; split the table per device")
        self.device = next(iter(devices), "cpu")
        self._index: dict[str, tuple[list[int], list[LiveAllocation]]] = {}
        for dev in devices:
            items = sorted((a for a in self.allocations if a.device == dev), key=lambda a: a.address)
            self._index[dev] = ([a.address for a in items], items)

    def __len__(self) -> int:
        return len(self.allocations)

    def payload_allocations(self) -> list[Allocation]:
        """The allocation map for the payload writer (captured addresses)."""
        return [Allocation(id=a.id, address=a.address, size=a.size) for a in self.allocations]

    def locate(self, device: str, address: int, size: int) -> tuple[LiveAllocation, int] | None:
        """(allocation, offset) holding all of ``[address, address + size)`` on ``device``."""
        idx = self._index.get(device)
        if idx is None:
            return None
        starts, items = idx
        i = bisect.bisect_right(starts, address) - 1
        if i < 0:
            return None
        a = items[i]
        if address + size <= a.address + a.size:
            return a, address - a.address
        return None

    def total_bytes(self) -> int:
        return sum(a.size for a in self.allocations)

    # ---------------------------------------------------------- vs manifest
    def check_manifest(self, allocations: Sequence[Allocation], *, relocatable: bool) -> None:
        """Refuse hydration unless the manifest's allocations are this table's (ids, sizes, and
        addresses unless ``relocatable``: a rebuilt layout may sit at new virtual addresses)."""
        if len(allocations) != len(self.allocations):
            raise IntegrityError(
                f"the manifest lists {len(allocations)} stable allocations, the process has {len(self.allocations)}",
                fix="restore the capsule that belongs to this manifest (same engine build, model and options)")
        for want in allocations:
            have = self.by_id.get(want.id)
            if have is None or have.size != want.size or (not relocatable and have.address != want.address):
                got = f"{have.address:#x}, {have.size} bytes" if have else "absent"
                raise IntegrityError(
                    f"allocation {want.id!r} in the manifest ({want.address:#x}, {want.size} bytes) does not match "
                    f"the process ({got})", fix="restore the capsule that belongs to this manifest")

    # ------------------------------------------------------- readers/sinks
    def reader(self):
        """AllocationReader for the payload writer; call ``close_io`` on it when done."""
        if self.device == "cpu":
            from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.pack import MemoryReader

            return MemoryReader({a.id: a.view for a in self.allocations})
        from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cuda_sink import CudaReader

        return CudaReader({a.id: a.address for a in self.allocations}, self.allocations[0].device_index)

    def sink(self):
        """AllocationSink for hydration (pinned staging on GPU; on CPU the pack mapped over private
        mappings where the pages line up, preadv into views for the rest)."""
        if self.device == "cpu":
            from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.hydrate import (
                MappingSink,
                MemorySink,
            )

            views = {a.id: a.view for a in self.allocations}
            regions = {a.id: (a.address, a.size) for a in self.allocations if a.private_mapping}
            return MappingSink(views, regions) if regions else MemorySink(views)
        from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cuda_sink import CudaSink

        return CudaSink.for_restore({a.id: a.address for a in self.allocations}, self.allocations[0].device_index,
                                    sizes={a.id: a.size for a in self.allocations})


def close_io(obj) -> None:
    """Free a reader's or sink's staging buffers (pinned host memory must not reach a snapshot)."""
    fn = getattr(obj, "close", None)
    if callable(fn):
        fn()


def zero(table: AllocationTable) -> None:
    """Zero every allocation of the table (KV re-zero after a wake or restore)."""
    if table.device == "cpu":
        for a in table.allocations:
            a.view[:] = bytes(a.size)  # type: ignore[index]
        return
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cuda_sink import check, driver

    drv = driver()
    for a in table.allocations:
        check(drv.cuMemsetD8(a.address, 0, a.size), f"cuMemsetD8({a.id})")
    check(drv.cuCtxSynchronize(), "cuCtxSynchronize")


# ----------------------------------------------------------------- sources
def from_cumem(allocator, tag: str) -> AllocationTable:
    """The allocations of vLLM's ``CuMemAllocator`` with ``tag`` ('weights', 'kv_cache').

    ``pointer_to_data`` is insertion-ordered (malloc order); each entry's handle
    is ``(device, aligned_size, address, physical_handle)`` and its address is
    the VMM reservation that sleep/wake keep.
    """
    items = []
    n = 0
    for ptr, data in allocator.pointer_to_data.items():
        if data.tag != tag:
            continue
        device, size = int(data.handle[0]), int(data.handle[1])
        items.append(LiveAllocation(f"{tag}.{n}", f"cuda:{device}", int(ptr), size))
        n += 1
    return AllocationTable(items)


def from_segments(tensors: Iterable, tag: str, snapshot: list[dict] | None = None) -> AllocationTable:
    """The caching-allocator segments that hold ``tensors`` (e.g. a model's parameters and buffers).

    For engines whose weights live in a pausable pool (SGLang's torch_memory_saver
    region): each segment is one cudaMalloc'd range the pool pauses and resumes at the
    same address. Order follows the segments' addresses, which the memory-saver keeps.
    """
    import torch

    segs = snapshot if snapshot is not None else torch.cuda.memory_snapshot()
    spans = sorted((int(s["address"]), int(s["total_size"]), int(s.get("device", 0))) for s in segs)
    starts = [s[0] for s in spans]
    used: dict[int, tuple[int, int, int]] = {}
    for t in tensors:
        if t.device.type != "cuda" or t.numel() == 0:
            continue
        p = t.data_ptr()
        i = bisect.bisect_right(starts, p) - 1
        if i >= 0 and p < spans[i][0] + spans[i][1]:
            used[spans[i][0]] = spans[i]
    return AllocationTable(LiveAllocation(f"{tag}.{n}", f"cuda:{dev}", addr, size)
                           for n, (addr, size, dev) in enumerate(sorted(used.values())))
