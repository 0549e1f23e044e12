"""The load observer: which bytes of the stable allocations did the loader copy, unchanged,
from which checkpoint tensor (or tensor slice)?

An engine's normal loader keeps its own I/O (safetensors, fastsafetensors,
instanttensor...). The integration only (1) registers every tensor the
checkpoint iterator yields (``register``), and (2) runs the load under
:class:`LoadObserver`, a torch dispatch mode that sees every aten op:

* ``copy_(dst, src)`` whose ``src`` is a registered checkpoint tensor, or a
  view of one that is a whole tensor or a slice along one dimension, and whose
  ``dst`` is contiguous with the same dtype and shape, is recorded as one
  observed write: ``[dst, dst + nbytes)`` holds ``TensorSource(file, tensor,
  dtype, shape, slice)`` byte for byte;
* every other write (an op's mutated arguments, a fresh op output) drops the
  recorded writes and registered sources it overlaps: bytes that a later step
  changed (quantization repacking, a fused transpose, a freed and reused block)
  are residual, not model bytes.

``clone``/``_to_copy`` without a dtype change carry a source forward, so a
``.contiguous()`` or ``.to(device)`` of a checkpoint slice still counts.
Anything the observer cannot express stays residual: classification is
conservative, and capture re-checks each extent against the checkpoint
(``worker.verify_extents``), so a wrong classification cannot reach a payload.
"""

from __future__ import annotations

import bisect
import json
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import ModelExtent, TensorSource

# torch dtype name -> safetensors dtype (the observer only records byte-identical copies).
TORCH_TO_ST = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e8m0fnu": "F8_E8M0",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
}


def st_dtype(dtype) -> str | None:
    """Safetensors dtype string of a torch dtype (None for dtypes a checkpoint cannot hold)."""
    return TORCH_TO_ST.get(str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor of the pinned checkpoint: file relative to the model directory, header dtype and shape."""

    file: str
    name: str
    dtype: str
    shape: tuple[int, ...]


class SourceIndex:
    """Checkpoint tensor name -> :class:`CheckpointTensor`, read from the safetensors headers only."""

    def __init__(self, root: Path | str, files: Iterable[Path | str] | None = None) -> None:
        self.root = Path(root)
        self.tensors: dict[str, CheckpointTensor] = {}
        paths = sorted(Path(f) for f in files) if files is not None else sorted(self.root.glob("*.safetensors"))
        for given in paths:
            path = given if given.is_absolute() else self.root / given
            rel = path.relative_to(self.root).as_posix()
            with open(path, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n))
            for name, meta in header.items():
                if name != "__metadata__" and name not in self.tensors:
                    self.tensors[name] = CheckpointTensor(rel, name, meta["dtype"], tuple(meta["shape"]))

    def lookup(self, name: str) -> CheckpointTensor | None:
        return self.tensors.get(name)


@dataclass(frozen=True)
class ObservedWrite:
    """``size`` bytes at device address ``address`` hold ``source`` exactly."""

    device: str
    address: int
    size: int
    source: TensorSource


@dataclass(frozen=True)
class _Src:
    """A live contiguous tensor whose bytes are ``ckpt[slice]`` in row-major order."""

    ckpt: CheckpointTensor
    slice: tuple[int, int, int] | None
    shape: tuple[int, ...]
    esize: int


class RangeMap:
    """Disjoint half-open byte ranges ``[start, end)`` with values; inserting replaces overlaps."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._items: dict[int, tuple[int, object]] = {}

    def __len__(self) -> int:
        return len(self._starts)

    def overlapping(self, start: int, end: int) -> list[int]:
        """Starts of the ranges that overlap ``[start, end)``."""
        if end <= start:
            return []
        i = max(bisect.bisect_right(self._starts, start) - 1, 0)
        out = []
        while i < len(self._starts) and self._starts[i] < end:
            s = self._starts[i]
            if self._items[s][0] > start:
                out.append(s)
            i += 1
        return out

    def remove_overlapping(self, start: int, end: int) -> int:
        hits = self.overlapping(start, end)
        for s in hits:
            del self._items[s]
            self._starts.pop(bisect.bisect_left(self._starts, s))
        return len(hits)

    def insert(self, start: int, end: int, value: object) -> None:
        self.remove_overlapping(start, end)
        bisect.insort(self._starts, start)
        self._items[start] = (end, value)

    def containing(self, start: int, end: int) -> tuple[int, object] | None:
        """(range start, value) of the range that contains all of ``[start, end)``."""
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0:
            return None
        s = self._starts[i]
        e, value = self._items[s]
        return (s, value) if end <= e else None

    def items(self) -> list[tuple[int, int, object]]:
        return [(s, self._items[s][0], self._items[s][1]) for s in self._starts]


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(shape[i + 1], 1)
    return strides


def _prod(xs: Iterable[int]) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def relative_slice(entry_shape: Sequence[int], offset_elems: int, shape: Sequence[int],
                   stride: Sequence[int], contiguous: bool) -> tuple[bool, tuple[int, int, int] | None]:
    """Is the strided view ``(offset, shape, stride)`` of a contiguous ``entry_shape`` tensor the whole
    tensor or one slice along one dim? Returns (ok, None for whole | (dim, start, stop))."""
    numel = _prod(shape)
    total = _prod(entry_shape)
    if contiguous:
        if numel == total and offset_elems == 0:
            return True, None
        row = _prod(entry_shape[1:]) if len(entry_shape) > 0 else 1
        if len(entry_shape) > 0 and row > 0 and offset_elems % row == 0 and numel % row == 0:
            start = offset_elems // row
            stop = start + numel // row
            if stop <= entry_shape[0]:
                return True, (0, start, stop)
        return False, None
    if len(shape) != len(entry_shape):
        return False, None
    ce = _contiguous_strides(entry_shape)
    diff = [i for i in range(len(shape)) if shape[i] != entry_shape[i]]
    if len(diff) != 1:
        return False, None
    d = diff[0]
    if any(shape[i] > 1 and stride[i] != ce[i] for i in range(len(shape))):
        return False, None
    if ce[d] == 0 or offset_elems % ce[d] != 0:
        return False, None
    start = offset_elems // ce[d]
    if start + shape[d] > entry_shape[d]:
        return False, None
    return True, (d, start, start + shape[d])


def compose(outer: tuple[int, int, int] | None, inner: tuple[int, int, int] | None,
            full_shape: Sequence[int]) -> tuple[bool, tuple[int, int, int] | None]:
    """Slice ``inner`` (relative to ``ckpt[outer]``) as one slice of the checkpoint tensor."""
    if inner is None:
        out = outer
    elif outer is None:
        out = inner
    elif outer[0] == inner[0]:
        out = (outer[0], outer[1] + inner[1], outer[1] + inner[2])
    else:
        return False, None
    if out is not None and out[1] == 0 and out[2] == full_shape[out[0]]:
        out = None  # a slice over the full dimension is the whole tensor
    return True, out


def _device_key(t) -> str:
    dev = t.device
    return f"{dev.type}:{dev.index if dev.index is not None else 0}" if dev.type != "cpu" else "cpu"


def _tensors(x) -> list:
    import torch

    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for t in x if isinstance(t, torch.Tensor)]
    return []


class LoadObserver:
    """Record checkpoint-to-destination writes while a loader runs (``with observer: load()``)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._sources: dict[str, RangeMap] = {}
        self._writes: dict[str, RangeMap] = {}
        self._mode = None
        self.stats = {"registered": 0, "recorded": 0, "invalidated": 0, "unmatched_copies": 0, "errors": 0}

    # --------------------------------------------------------------- sources
    def register(self, tensor, ckpt: CheckpointTensor | None) -> bool:
        """A tensor the checkpoint iterator yielded holds ``ckpt``'s bytes (True if usable)."""
        if ckpt is None:
            return False
        try:
            if tensor.device.type == "meta" or not tensor.is_contiguous():
                return False
            if st_dtype(tensor.dtype) != ckpt.dtype or tuple(tensor.shape) != tuple(ckpt.shape):
                return False  # converted by the iterator: these bytes are not the file's
            if tensor.numel() == 0:
                return False
            start = tensor.data_ptr()
            with self._lock:
                self._sources.setdefault(_device_key(tensor), RangeMap()).insert(
                    start, start + tensor.numel() * tensor.element_size(),
                    _Src(ckpt, None, tuple(tensor.shape), tensor.element_size()))
                self.stats["registered"] += 1
            return True
        except (RuntimeError, AttributeError):
            return False

    def _source_of(self, t) -> tuple[CheckpointTensor, tuple[int, int, int] | None] | None:
        if t.device.type == "meta" or t.numel() == 0:
            return None
        sources = self._sources.get(_device_key(t))
        if not sources:
            return None
        esize = t.element_size()
        span = (sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True) if s > 0) + 1) * esize
        hit = sources.containing(t.data_ptr(), t.data_ptr() + span)
        if hit is None:
            return None
        base, src = hit
        assert isinstance(src, _Src)
        if st_dtype(t.dtype) != src.ckpt.dtype or esize != src.esize:
            return None
        delta = t.data_ptr() - base
        if delta % esize:
            return None
        ok, rel = relative_slice(src.shape, delta // esize, tuple(t.shape), tuple(t.stride()), t.is_contiguous())
        if not ok:
            return None
        ok, sl = compose(src.slice, rel, src.ckpt.shape)
        return (src.ckpt, sl) if ok else None

    # ---------------------------------------------------------------- writes
    def _invalidate(self, t) -> None:
        try:
            if t.device.type == "meta" or t.numel() == 0:
                return
            esize = t.element_size()
            span = (sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True) if s > 0) + 1) * esize
            start = t.data_ptr()
        except (RuntimeError, AttributeError):
            return
        key = _device_key(t)
        n = 0
        if key in self._writes:
            n += self._writes[key].remove_overlapping(start, start + span)
        if key in self._sources:
            self._sources[key].remove_overlapping(start, start + span)
        self.stats["invalidated"] += n

    def _record_copy(self, dst, src) -> bool:
        found = self._source_of(src)
        if found is None:
            return False
        ckpt, sl = found  # not None: returned above; pylint: disable=unpacking-non-sequence
        if (not dst.is_contiguous() or dst.dtype != src.dtype or dst.numel() != src.numel()
                or [d for d in dst.shape if d != 1] != [d for d in src.shape if d != 1]):
            return False
        source = TensorSource(file=ckpt.file, tensor=ckpt.name, dtype=ckpt.dtype, shape=tuple(ckpt.shape), slice=sl)
        size = dst.numel() * dst.element_size()
        if source.nbytes() != size:
            return False
        key = _device_key(dst)
        start = dst.data_ptr()
        if key in self._sources:
            self._sources[key].remove_overlapping(start, start + size)
        self._writes.setdefault(key, RangeMap()).insert(start, start + size, ObservedWrite(key, start, size, source))
        self.stats["recorded"] += 1
        return True

    def _after(self, func, args, kwargs, out) -> None:
        import torch

        schema = getattr(func, "_schema", None)
        name = getattr(getattr(func, "overloadpacket", None), "__name__", "")
        with self._lock:
            if name == "copy_" and len(args) >= 2 and isinstance(args[1], torch.Tensor):
                dst = args[0]
                self._invalidate(dst)
                if not self._record_copy(dst, args[1]):
                    self.stats["unmatched_copies"] += 1
                return
            if schema is not None:
                for i, a in enumerate(schema.arguments):
                    if a.alias_info is not None and a.alias_info.is_write:
                        val = args[i] if i < len(args) else kwargs.get(a.name)
                        for t in _tensors(val):
                            self._invalidate(t)
                outs = out if isinstance(out, (list, tuple)) else (out,)
                for r, ret in zip(outs, schema.returns, strict=False):
                    if ret.alias_info is None:
                        for t in _tensors(r):
                            self._invalidate(t)  # fresh memory: whatever was recorded there is gone
            if name in ("clone", "_to_copy") and args and isinstance(args[0], torch.Tensor) \
                    and isinstance(out, torch.Tensor) and out.dtype == args[0].dtype and out.is_contiguous():
                found = self._source_of(args[0])
                if found is not None and out.numel() > 0:
                    ckpt, sl = found  # not None: checked above; pylint: disable=unpacking-non-sequence
                    start = out.data_ptr()
                    self._sources.setdefault(_device_key(out), RangeMap()).insert(
                        start, start + out.numel() * out.element_size(),
                        _Src(ckpt, sl, tuple(out.shape), out.element_size()))

    # ------------------------------------------------------------ the mode
    def __enter__(self) -> LoadObserver:
        from torch.utils._python_dispatch import TorchDispatchMode

        observer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                try:
                    observer._after(func, args, kwargs, out)
                except Exception:
                    # Observation must never break the engine's own load; an op we could not
                    # interpret leaves its bytes unclassified, which only makes them residual.
                    observer.stats["errors"] += 1
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(*exc)
        return False

    # ------------------------------------------------------------- results
    def writes(self) -> list[ObservedWrite]:
        with self._lock:
            return [w for m in self._writes.values() for _s, _e, w in m.items()]  # type: ignore[misc]

    def resolve(self, table) -> list[ModelExtent]:
        """Observed writes that lie inside one stable allocation of ``table``, as model extents."""
        out = []
        for w in self.writes():
            hit = table.locate(w.device, w.address, w.size)
            if hit is None:
                continue
            alloc, offset = hit
            out.append(ModelExtent(allocation=alloc.id, offset=offset, size=w.size, source=w.source))
        return sorted(out, key=lambda e: (e.allocation, e.offset))
