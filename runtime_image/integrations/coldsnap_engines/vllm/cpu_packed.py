"""vLLM's packed linear weights on CPU: dropped before a snapshot, packed again after hydration.

After loading, vLLM's CPU linear layers (``dispatch_cpu_unquantized_gemm`` in
``vllm/model_executor/layers/utils.py``) copy each weight into a layout its GEMM
kernels read: an sgl-kernel packed tensor (``convert_weight_packed``, small GEMMs)
or a oneDNN matmul handle (``create_onednn_mm``) holding a reordered copy. The
parameter itself is then emptied (``remove_weight=True``; the LM head keeps its
weight), and the layer's ``cpu_linear`` closure holds the copy. Those copies live
outside the weight arena: a snapshot carries them (a second copy of the model on a CPU
with AMX) unless the unit sets ``COLDSNAP_VLLM_CPU_PACKED=release``, and a sleep frees
them through this module.

The copies are found through ``cpu_linear``'s closure, and emptied *in place*, so
that the objects vLLM (and any TorchInductor graph reading them) holds stay the same:

* a packed tensor: its storage is resized to 0 (freed), and after hydration
  ``set_`` points the same tensor at a fresh pack of the arena's weight;
* a oneDNN handle: the C++ handler is destroyed and its pointer, kept in a one-element
  tensor, set to 0; after hydration a new handler is created from the arena's
  weight (``create_onednn_mm``, vLLM's own helper) and its pointer written into the
  same tensor.

The weight to pack again comes from the arena, where relocation put it and hydration
refills it (``WeightArena.entries``), or from the layer's own parameter where vLLM
kept it. A layer whose copy cannot be rebuilt that way is left alone (its copy stays in
the image), never dropped. Nothing here runs between release and repack: the engine is
paused (no forward pass) from the quiesce to the resume.
"""

from __future__ import annotations

from dataclasses import dataclass

ONEDNN_CACHE = 32  # the primitive cache size vLLM's linear dispatch passes to create_onednn_mm


@dataclass
class PackedCopy:
    """One layer's packed weight: where it is held and how to rebuild it."""

    name: str  # the module's name
    module: object
    kind: str  # "sgl" | "onednn"
    holder: object  # the packed tensor (sgl) or vLLM's CPUDNNLGEMMHandler (onednn)
    source: tuple[int, tuple[int, ...], object] | None  # (arena offset, shape, dtype) of the weight
    bytes: int  # what the copy holds (estimated for a oneDNN handle: the weight's size)
    released: bool = False


def _closure(fn) -> list[object]:
    cells = getattr(fn, "__closure__", None) or ()
    out = []
    for cell in cells:
        try:
            out.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return out


def _is_onednn_handler(obj: object) -> bool:
    return type(obj).__name__ == "CPUDNNLGEMMHandler" and hasattr(obj, "handler_tensor") and hasattr(obj, "dtor")


def find(model, entries: dict[str, tuple[int, tuple[int, ...], object]]) -> list[PackedCopy]:
    """Every linear layer of ``model`` whose ``cpu_linear`` holds a packed copy that can be rebuilt."""
    import torch

    found = []
    for name, module in model.named_modules():
        fn = getattr(module, "cpu_linear", None)
        if fn is None:
            continue
        weight = getattr(module, "weight", None)
        source = entries.get(f"{name}.weight" if name else "weight")
        if source is None and not (isinstance(weight, torch.Tensor) and weight.numel()):
            continue  # nothing to pack from: leave this copy where it is
        cells = _closure(fn)
        handlers = [c for c in cells if _is_onednn_handler(c)]
        tensors = [c for c in cells if isinstance(c, torch.Tensor)]
        if len(handlers) == 1 and not tensors:
            h = handlers[0]
            numel = int(h.n) * int(h.k) if getattr(h, "n", -1) > 0 else 0
            found.append(PackedCopy(name, module, "onednn", h, source, numel * _elt(weight, source)))
        elif len(tensors) == 1 and not handlers:
            t = tensors[0]
            found.append(PackedCopy(name, module, "sgl", t, source, t.untyped_storage().nbytes()))
    return found


def _elt(weight, source) -> int:
    import torch

    dtype = source[2] if source is not None else weight.dtype
    return torch.empty((), dtype=dtype).element_size()


def release(copies: list[PackedCopy]) -> int:
    """Free every copy in place; returns the bytes freed (a oneDNN handle's counted as its weight's)."""
    freed = 0
    for c in copies:
        if c.released:
            continue
        if c.kind == "sgl":
            c.bytes = c.holder.untyped_storage().nbytes()
            c.holder.untyped_storage().resize_(0)
        else:
            ptr = int(c.holder.handler_tensor.item())
            if ptr:
                c.holder.dtor(ptr)
            c.holder.handler_tensor.fill_(0)
        c.released = True
        freed += c.bytes
    return freed


def repack(copies: list[PackedCopy], arena) -> int:
    """Pack every released copy again from its weight (in the hydrated arena); returns how many."""
    import torch
    from vllm import _custom_ops as ops

    done = 0
    for c in copies:
        if not c.released:
            continue
        weight = _weight(c, arena)
        if c.kind == "sgl":
            c.holder.set_(torch.ops._C.convert_weight_packed(weight))
        else:
            fresh = ops.create_onednn_mm(weight.t(), ONEDNN_CACHE)
            ptr = int(fresh.handler_tensor.item())
            fresh.handler_tensor = None  # the pointer now belongs to the layer's handler, not to ``fresh``
            c.holder.handler_tensor.fill_(ptr)
        c.released = False
        done += 1
    return done


def _weight(c: PackedCopy, arena):
    import torch

    current = getattr(c.module, "weight", None)
    if isinstance(current, torch.Tensor) and current.numel():
        return current
    offset, shape, dtype = c.source  # type: ignore[misc]  # find() keeps only copies with a source
    return arena.tensor(offset, shape, dtype)
