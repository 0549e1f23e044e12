"""The observing loader: places every weight in stable arenas and records each
checkpoint-to-destination write, so model bytes are classified from loader
behaviour (extents), never from parameter names.

Layout per worker: arena "params" holds the rank's weight shards (a shard of a
page or more starts on a page boundary, a smaller one on 256 bytes; the
alignment gaps are residual bytes), arena "derived" holds tables computed at
load (RoPE), which are residual bytes too. Page-aligned shards line up with the
pack's 4 KiB-aligned extents, so CPU hydration can map them instead of copying.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from coldsnap_engines.common.arena import make_arena
from coldsnap_engines.reference.config import ModelConfig
from coldsnap_engines.reference.model import local_shape, rope_tables, shard_slice

ALIGN = 256
PAGE = 4096
ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class ParamPlan:
    name: str
    file: str
    full_shape: tuple[int, ...]
    slice: tuple[int, int, int] | None
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class LoadedWeights:
    """Arenas, the tensors that alias them, and what the observer saw."""

    config: ModelConfig
    arenas: dict[str, object]
    weights: dict[str, torch.Tensor]
    rope: tuple[torch.Tensor, torch.Tensor]
    plan: list[ParamPlan]
    extents: list = field(default_factory=list)  # payload.layout.ModelExtent
    model_dir: str = ""

    def allocations(self) -> list:
        from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import Allocation

        return [Allocation(id=a.id, address=a.address, size=a.size) for a in self.arenas.values()]

    def read(self, allocation: str, offset: int, size: int):
        """AllocationReader for the payload writer."""
        return self.arenas[allocation].read(offset, size)


def tensor_index(model_dir: Path) -> dict[str, str]:
    """Tensor name -> safetensors file, read from the files' own headers."""
    index: dict[str, str] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name in header:
            if name != "__metadata__":
                index[name] = f.name
    return index


def plan_layout(config: ModelConfig, index: dict[str, str], rank: int, world: int) -> tuple[list[ParamPlan], int]:
    """Offsets of this rank's shards in the params arena, and the arena size."""
    dtype = getattr(torch, config.dtype)
    esize = torch.empty((), dtype=dtype).element_size()
    plans = []
    off = 0
    for name, full in config.tensor_shapes().items():
        if name not in index:
            raise FileNotFoundError(f"tensor {name!r} is missing from the checkpoint")
        sl = shard_slice(name, full, rank, world)
        shape = local_shape(full, sl)
        nbytes = esize
        for d in shape:
            nbytes *= d
        off = _align(off, PAGE if nbytes >= PAGE else ALIGN)
        plans.append(ParamPlan(name, index[name], tuple(full), sl, shape, off, nbytes))
        off += nbytes
    return plans, _align(max(off, 1), PAGE)


def load(model_dir: Path, config: ModelConfig, *, rank: int, world: int, device: str, observe: bool = True,
         read: bool = True) -> LoadedWeights:
    """Allocate arenas, copy this rank's shards from safetensors, record every write.

    ``read=False`` only allocates the arenas and lays the tensors out in them (the same layout,
    from the checkpoint's headers): a template restore then fills them by hydration."""
    from safetensors import safe_open

    observe = observe and read

    if observe:
        from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import (
            ModelExtent,
            TensorSource,
        )

    model_dir = Path(model_dir)
    index = tensor_index(model_dir)
    plan, params_size = plan_layout(config, index, rank, world)
    dtype = getattr(torch, config.dtype)
    half = config.head_dim // 2
    rope_bytes = config.max_seq * half * 4
    derived_size = _align(2 * _align(rope_bytes, ALIGN), PAGE)
    arenas = {"params": make_arena("params", params_size, device), "derived": make_arena("derived", derived_size, device)}
    weights: dict[str, torch.Tensor] = {}
    extents = []
    by_file: dict[str, list[ParamPlan]] = {}
    for p in plan:
        by_file.setdefault(p.file, []).append(p)
    for fname, items in sorted(by_file.items()):
        if not read:
            for p in items:
                weights[p.name] = arenas["params"].tensor(p.offset, p.shape, dtype)
            continue
        with safe_open(str(model_dir / fname), framework="pt", device="cpu") as f:
            for p in items:
                sl = f.get_slice(p.name)
                if p.slice is None:
                    src = sl[:]
                elif p.slice[0] == 0:
                    src = sl[p.slice[1]: p.slice[2]]
                else:
                    src = sl[:, p.slice[1]: p.slice[2]]
                if src.dtype != dtype:
                    raise ValueError(f"{p.name}: checkpoint dtype {src.dtype} differs from config dtype {dtype}")
                dest = arenas["params"].tensor(p.offset, p.shape, dtype)
                if dest.data_ptr() != arenas["params"].address + p.offset:
                    # A framework that copied instead of aliasing would keep the weights outside the
                    # stable allocation: the snapshot would carry them and hydration would miss them.
                    raise RuntimeError(f"{p.name}: tensor does not alias its stable allocation "
                                       f"({dest.data_ptr():#x} != {arenas['params'].address + p.offset:#x})")
                dest.copy_(src.contiguous())
                weights[p.name] = dest
                if observe:
                    extents.append(ModelExtent(
                        allocation="params", offset=p.offset, size=p.nbytes,
                        source=TensorSource(file=fname, tensor=p.name, dtype=ST_DTYPES[dtype], shape=p.full_shape,
                                            slice=p.slice)))
                del src
    cos, sin = rope_tables(config, "cpu")
    rope_off = _align(rope_bytes, ALIGN)
    cos_t = arenas["derived"].tensor(0, (config.max_seq, half), torch.float32)
    sin_t = arenas["derived"].tensor(rope_off, (config.max_seq, half), torch.float32)
    cos_t.copy_(cos)
    sin_t.copy_(sin)
    if device != "cpu":
        torch.cuda.synchronize()
    return LoadedWeights(config, arenas, weights, (cos_t, sin_t), plan, extents, str(model_dir))
