"""vLLM on CPU: the weights in one stable allocation, the KV cache released in place.

vLLM's CPU worker allocates everything with PyTorch's default allocator (no sleep
mode, no pluggable allocator), so ColdSnap provides the stable allocation itself:

* :func:`relocate_parameters` runs in the loader after the model is built and
  before the checkpoint is read: every parameter moves into one page-aligned
  private mapping (:class:`~coldsnap_engines.common.arena.CpuArena`; a parameter of a
  page or more starts on a page boundary, so hydration can map it from the pack), so the
  loader's writes land there, the observer classifies them, and release /
  hydration act on one allocation whose address a CRIU restore keeps. Buffers
  (rotary tables and other computed state) stay where they are: they are not in
  the checkpoint, so they stay in the process image.
* vLLM's packed copies of the linear weights (``cpu_packed``) are dropped with the
  arena by a sleep (and by a snapshot where the unit sets ``COLDSNAP_VLLM_CPU_PACKED=release``)
  and packed again from it after hydration.
* :func:`release_kv` drops the pages of the KV cache storages (page-aligned
  interiors): after a restore they read back as zeros, which is their initial
  state (the prefix cache is reset first, so no block is believed to hold data).
"""

from __future__ import annotations

from coldsnap_engines.common.allocations import AllocationTable, LiveAllocation
from coldsnap_engines.common.arena import PAGE, CpuArena, release_interior

ALIGN = 256
ARENA_ID = "weights.0"


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class WeightArena:
    """The parameters of one CPU worker, in one stable allocation."""

    def __init__(self, arena: CpuArena, entries: dict[str, tuple[int, tuple[int, ...], object]]) -> None:
        self.arena = arena
        self.entries = entries  # parameter name -> (offset in the arena, shape, dtype), as relocated

    def table(self) -> AllocationTable:
        a = self.arena
        return AllocationTable([LiveAllocation(a.id, "cpu", a.address, a.size, a.view(), private_mapping=True)])

    def release(self) -> int:
        self.arena.release()
        return self.arena.size


def relocate_parameters(model) -> WeightArena:
    """Move every parameter of ``model`` (each storage once) into one new arena; tensors keep their
    shapes, dtypes and identities (``param.data`` is replaced in place)."""
    params = []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if p.device.type != "cpu" or id(p) in seen or p.numel() == 0:
            continue
        seen.add(id(p))
        params.append((name, p))
    offsets = []
    size = 0
    for _name, p in params:
        nbytes = p.numel() * p.element_size()
        size = _align(size, PAGE if nbytes >= PAGE else ALIGN)  # page-aligned: hydration can map it from the pack
        offsets.append(size)
        size += nbytes
    arena = CpuArena(ARENA_ID, max(_align(size, PAGE), PAGE))
    for (name, p), off in zip(params, offsets, strict=True):
        dest = arena.tensor(off, tuple(p.shape), p.dtype)
        if dest.data_ptr() != arena.address + off:
            raise RuntimeError(f"{name}: the arena view does not alias its stable allocation")
        dest.copy_(p.data)
        p.data = dest
    return WeightArena(arena, {name: (off, tuple(p.shape), p.dtype)
                               for (name, p), off in zip(params, offsets, strict=True)})


def kv_storages(model_runner) -> list[tuple[int, int]]:
    """(address, bytes) of each distinct storage behind the runner's KV cache tensors."""
    seen: dict[int, int] = {}
    for t in getattr(model_runner, "kv_caches", []) or []:
        for x in (t if isinstance(t, list | tuple) else [t]):
            s = x.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sorted(seen.items())


def release_kv(model_runner) -> int:
    """Drop the KV cache's pages (they come back as zeros); returns the bytes released."""
    return sum(release_interior(addr, n) for addr, n in kv_storages(model_runner))
