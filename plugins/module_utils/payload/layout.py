"""The weight-side layout of one worker: allocations, model extents, residual extents, pack order.

A worker's stable weight allocations are split into two disjoint extent maps
that together cover every allocation byte:

* model extents: one observed loader write each (one checkpoint tensor, or a
  slice of one); their bytes go to ``model-weights.pack``;
* residual extents: everything else; those bytes go to ``weights.blob``.

The pack holds every model extent, duplicates included, ordered by
(SHA-256 of the extent, size), each followed by zero padding up to the next
4 KiB boundary. Neither allocation order nor captured addresses influence the
pack bytes, so identical model bytes give one content identity.

Everything here is pure computation over integers; nothing touches a file.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import IntegrityError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import identifiers as ids

# Re-exported: the names of a worker's payload files and the pack path, as the payload code uses them.
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import (  # noqa: F401  # pylint: disable=W0611
    MANIFEST_NAME,
    PACK_DIR,
    REPLAY_PLAN_NAME,
    RESIDUAL_NAME,
    PayloadRef,
    pack_relpath,
)

PACK_ALIGNMENT = 4096
PACK_NAME = "model-weights.pack"
MAX_ADDRESS = 1 << 64

# Byte size of one element for every safetensors dtype (the copy is dtype-agnostic;
# the size only checks that an extent holds exactly the tensor slice it claims).
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}


@dataclass(frozen=True)
class Allocation:
    """One stable weight allocation as captured: id, virtual address, byte size."""

    id: str
    address: int
    size: int

    @property
    def end(self) -> int:
        return self.address + self.size


@dataclass(frozen=True)
class TensorSource:
    """Where a model extent's bytes come from in the pinned checkpoint.

    ``slice`` is ``(dim, start, stop)`` of the checkpoint tensor along ``dim``
    (tensor-parallel shards), or None for the whole tensor. ``dtype`` and
    ``shape`` are the checkpoint tensor's own (unsliced) dtype and shape.
    """

    file: str
    tensor: str
    dtype: str
    shape: tuple[int, ...]
    slice: tuple[int, int, int] | None = None

    def nbytes(self) -> int:
        """Bytes of the (sliced) tensor in row-major order."""
        return slice_geometry(self.dtype, self.shape, self.slice)[3]


@dataclass(frozen=True)
class ModelExtent:
    """One observed loader write: ``size`` bytes at ``offset`` of ``allocation``."""

    allocation: str
    offset: int
    size: int
    source: TensorSource


@dataclass(frozen=True)
class PackedExtent:
    """A model extent's place in the pack (manifest model map entry)."""

    allocation: str
    offset: int
    size: int
    pack_offset: int
    sha256: str  # 'sha256:<hex>' of the extent's bytes


@dataclass(frozen=True)
class ResidualExtent:
    """A residual extent's place in weights.blob (manifest residual map entry)."""

    allocation: str
    offset: int
    size: int
    blob_offset: int


def padded(size: int) -> int:
    """``size`` rounded up to the pack alignment."""
    return (size + PACK_ALIGNMENT - 1) // PACK_ALIGNMENT * PACK_ALIGNMENT


def slice_geometry(dtype: str, shape: Sequence[int], sl: tuple[int, int, int] | None) -> tuple[int, int, int, int]:
    """(outer rows, bytes per row of the full tensor, offset of the slice in a row, slice bytes).

    A slice along ``dim`` is ``outer`` runs of ``run`` bytes, one per index of
    the dimensions before ``dim``; the runs are ``row`` bytes apart. Returns
    ``(outer, row, start_in_row, total)`` where ``run == total // outer`` when
    outer > 0.
    """
    if dtype not in DTYPE_SIZES:
        raise IntegrityError(f"tensor dtype {dtype!r} is not a safetensors dtype",
                             fix=f"use one of {', '.join(sorted(DTYPE_SIZES))}")
    item = DTYPE_SIZES[dtype]
    if any((not isinstance(d, int)) or isinstance(d, bool) or d < 0 for d in shape):
        raise IntegrityError(f"tensor shape {list(shape)} has a negative or non-integer dimension",
                             fix="record the checkpoint tensor's shape as non-negative integers")
    numel = 1
    for d in shape:
        numel *= d
    if sl is None:
        return (1, numel * item, 0, numel * item)
    dim, start, stop = sl
    if not 0 <= dim < len(shape):
        raise IntegrityError(f"slice dimension {dim} is outside a tensor of rank {len(shape)}",
                             fix="slice along one of the tensor's dimensions")
    if not 0 <= start <= stop <= shape[dim]:
        raise IntegrityError(f"slice [{start}:{stop}] is outside dimension {dim} of size {shape[dim]}",
                             fix="record the slice bounds the loader actually used")
    outer = 1
    for d in shape[:dim]:
        outer *= d
    inner = item
    for d in shape[dim + 1:]:
        inner *= d
    row = shape[dim] * inner
    return (outer, row, start * inner, outer * (stop - start) * inner)


def check_allocations(allocations: Sequence[Allocation]) -> dict[str, Allocation]:
    """Unique well-formed ids, positive sizes, non-overlapping address ranges; returns id -> allocation."""
    by_id: dict[str, Allocation] = {}
    for a in allocations:
        if not isinstance(a.id, str) or not re.fullmatch(ids.ID, a.id):
            raise IntegrityError(f"allocation id {a.id!r} is not a valid identifier",
                                 fix="use letters, digits, '.', '_' or '-' (at most 128 characters)")
        if a.id in by_id:
            raise IntegrityError(f"allocation {a.id!r} is listed twice", fix="give every allocation one entry")
        if a.size <= 0:
            raise IntegrityError(f"allocation {a.id!r} has size {a.size}", fix="allocations must hold at least one byte")
        if a.address < 0 or a.end > MAX_ADDRESS:
            raise IntegrityError(f"allocation {a.id!r} address range [{a.address:#x}, {a.end:#x}) is not a 64-bit range",
                                 fix="record the captured virtual address")
        by_id[a.id] = a
    ordered = sorted(allocations, key=lambda a: a.address)
    for prev, cur in itertools.pairwise(ordered):
        if cur.address < prev.end:
            raise IntegrityError(
                f"allocations {prev.id!r} [{prev.address:#x}, {prev.end:#x}) and {cur.id!r} "
                f"[{cur.address:#x}, {cur.end:#x}) overlap",
                fix="record each stable allocation once with its own address range")
    return by_id


def _extent_name(allocation: str, offset: int, size: int) -> str:
    return f"{allocation}[{offset}:{offset + size}]"


def check_coverage(allocations: Sequence[Allocation],
                   maps: Iterable[tuple[str, Iterable[tuple[str, int, int]]]]) -> None:
    """Refuse unless the extents of all maps are disjoint and cover every byte of every allocation.

    ``maps`` is ``[(map name, [(allocation, offset, size), ...]), ...]``.
    Errors name the allocation, the byte range and the problem (gap, overlap,
    extent past the allocation end, unknown allocation).
    """
    by_id = check_allocations(allocations)
    per_alloc: dict[str, list[tuple[int, int, str]]] = {a.id: [] for a in allocations}
    for map_name, extents in maps:
        for alloc, offset, size in extents:
            if alloc not in by_id:
                raise IntegrityError(f"{map_name} extent {_extent_name(alloc, offset, size)} names an unknown allocation",
                                     fix="every extent must belong to an allocation of the allocation map")
            if size <= 0 or offset < 0:
                raise IntegrityError(f"{map_name} extent {_extent_name(alloc, offset, size)} is empty or negative",
                                     fix="extents hold at least one byte at a non-negative offset")
            if offset + size > by_id[alloc].size:
                raise IntegrityError(
                    f"{map_name} extent {_extent_name(alloc, offset, size)} runs past the end of allocation "
                    f"{alloc!r} ({by_id[alloc].size} bytes)",
                    fix="the manifest does not match the allocation layout; recapture")
            per_alloc[alloc].append((offset, size, map_name))
    for a in allocations:
        pos = 0
        for offset, size, map_name in sorted(per_alloc[a.id]):
            if offset > pos:
                raise IntegrityError(f"allocation {a.id!r} has a gap: bytes [{pos}:{offset}] are in no extent map",
                                     fix="the model and residual maps must cover every allocation byte; recapture")
            if offset < pos:
                raise IntegrityError(
                    f"allocation {a.id!r} has overlapping extents at bytes [{offset}:{min(pos, offset + size)}] "
                    f"({map_name} extent {_extent_name(a.id, offset, size)})",
                    fix="the model and residual maps must be disjoint; recapture")
            pos = offset + size
        if pos != a.size:
            raise IntegrityError(f"allocation {a.id!r} has a gap: bytes [{pos}:{a.size}] are in no extent map",
                                 fix="the model and residual maps must cover every allocation byte; recapture")


def residual_complement(allocations: Sequence[Allocation],
                        model: Iterable[tuple[str, int, int]]) -> list[ResidualExtent]:
    """Every byte not covered by a model extent, as residual extents in blob order.

    Blob order is allocation-map order, then offset; blob offsets are contiguous.
    Overlapping model extents are refused (they would make the maps ambiguous).
    """
    by_id = check_allocations(allocations)
    per_alloc: dict[str, list[tuple[int, int]]] = {a.id: [] for a in allocations}
    for alloc, offset, size in model:
        if alloc not in by_id:
            raise IntegrityError(f"model extent {_extent_name(alloc, offset, size)} names an unknown allocation",
                                 fix="observe loader writes only into the listed stable allocations")
        if size <= 0 or offset < 0 or offset + size > by_id[alloc].size:
            raise IntegrityError(
                f"model extent {_extent_name(alloc, offset, size)} is empty or runs past the end of "
                f"allocation {alloc!r} ({by_id[alloc].size} bytes)",
                fix="record the loader write's real offset and size inside its allocation")
        per_alloc[alloc].append((offset, size))
    out: list[ResidualExtent] = []
    blob = 0
    for a in allocations:
        pos = 0
        for offset, size in sorted(per_alloc[a.id]):
            if offset < pos:
                raise IntegrityError(
                    f"model extents overlap in allocation {a.id!r} at bytes [{offset}:{min(pos, offset + size)}]",
                    fix="each allocation byte may come from one loader write only; check the loader observer")
            if offset > pos:
                out.append(ResidualExtent(a.id, pos, offset - pos, blob))
                blob += offset - pos
            pos = offset + size
        if pos < a.size:
            out.append(ResidualExtent(a.id, pos, a.size - pos, blob))
            blob += a.size - pos
    return out


def pack_order(extents: Iterable[tuple[str, int, int, str]]) -> list[PackedExtent]:
    """Canonical pack layout for ``(allocation, offset, size, sha256)`` extents.

    Sorted by (sha256, size); equal keys mean equal bytes, so the tie-break
    (allocation, offset) changes only the manifest, never the pack bytes.
    """
    ordered = sorted(extents, key=lambda e: (e[3], e[2], e[0], e[1]))
    out: list[PackedExtent] = []
    pos = 0
    for alloc, offset, size, sha in ordered:
        out.append(PackedExtent(alloc, offset, size, pos, sha))
        pos += padded(size)
    return out


def pack_size(extents: Iterable[PackedExtent]) -> int:
    """Size of the pack holding ``extents`` (a multiple of 4096)."""
    return sum(padded(e.size) for e in extents)


def check_pack_layout(extents: Sequence[PackedExtent], size: int) -> None:
    """Refuse a model map whose pack offsets are not the canonical layout of ``size`` bytes."""
    pos = 0
    prev: tuple[str, int] | None = None
    for e in extents:
        if e.pack_offset != pos:
            raise IntegrityError(
                f"model extent {_extent_name(e.allocation, e.offset, e.size)} is at pack offset {e.pack_offset}, "
                f"the canonical layout puts it at {pos}",
                fix="the manifest was not written by ColdSnap's canonical pack writer; recapture")
        key = (e.sha256, e.size)
        if prev is not None and key < prev:
            raise IntegrityError(
                f"model extent {_extent_name(e.allocation, e.offset, e.size)} is out of (sha256, size) order",
                fix="the manifest was not written by ColdSnap's canonical pack writer; recapture")
        prev = key
        pos += padded(e.size)
    if pos != size:
        raise IntegrityError(f"the model map lays out {pos} pack bytes but the manifest says the pack has {size}",
                             fix="the manifest is inconsistent; recapture")


def check_blob_layout(extents: Sequence[ResidualExtent], size: int) -> None:
    """Refuse a residual map whose blob offsets are not contiguous from 0 to ``size``."""
    pos = 0
    for e in extents:
        if e.blob_offset != pos:
            raise IntegrityError(
                f"residual extent {_extent_name(e.allocation, e.offset, e.size)} is at blob offset {e.blob_offset}, "
                f"expected {pos}", fix="the manifest is inconsistent; recapture")
        pos += e.size
    if pos != size:
        raise IntegrityError(f"the residual map lays out {pos} blob bytes but the manifest says weights.blob has {size}",
                             fix="the manifest is inconsistent; recapture")


# Every payload file is referenced by one type: path, size, digest (formats.unit.PayloadRef).
FileRef = PayloadRef
PackRef = PayloadRef
