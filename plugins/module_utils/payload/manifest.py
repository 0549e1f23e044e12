"""``native-manifest.json`` and ``replay-plan.json``: strict schemas, loading, and the map checks.

Both are decoded strictly (duplicate keys, unknown fields, wrong types are
errors) and then checked semantically: the model and residual maps must be
disjoint, cover every byte of every allocation, stay inside their
allocations, and use the canonical pack / contiguous blob layout. Anything
wrong is refused here, before a byte of process memory is touched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common import fsutil
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import identifiers as ids
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.schema import (
    Arr,
    Const,
    Field,
    Int,
    Map,
    Nullable,
    Obj,
    Str,
    validate_document,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.strictjson import strict_loads
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.versions import (
    NATIVE_MANIFEST_FORMAT,
    NATIVE_MANIFEST_KIND,
    REPLAY_PLAN_FORMAT,
    REPLAY_PLAN_KIND,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import (
    DTYPE_SIZES,
    PACK_ALIGNMENT,
    Allocation,
    FileRef,
    PackedExtent,
    PackRef,
    ResidualExtent,
    TensorSource,
    check_blob_layout,
    check_coverage,
    check_pack_layout,
    pack_relpath,
)

MAX_MANIFEST_BYTES = 256 << 20
REL_FILE = r"[A-Za-z0-9_][A-Za-z0-9._-]*(?:/[A-Za-z0-9_][A-Za-z0-9._-]*)*"
REL_FILE_FIX = "give a relative path inside the directory (no '..', no leading '/' or '.')"
DIGEST = Str(pattern=ids.DIGEST, pattern_fix="write it as 'sha256:<64 lower-case hex>'")

MODEL = Obj({
    "id": Field(Str(pattern=ids.MODEL_ID, pattern_fix="give the Hugging Face model id 'org/name'")),
    "revision": Field(Str(pattern=ids.COMMIT, pattern_fix=ids.COMMIT_FIX)),
})
ALLOCATION = Obj({
    "id": Field(Str(pattern=ids.ID, pattern_fix="letters, digits, '.', '_' or '-'")),
    "address": Field(Int(minimum=0, maximum=(1 << 64) - 1, description="captured virtual address")),
    "size": Field(Int(minimum=1)),
})
FILE_REF = Obj({
    "path": Field(Str(pattern=REL_FILE, pattern_fix=REL_FILE_FIX)),
    "size": Field(Int(minimum=0)),
    "sha256": Field(DIGEST),
})

MANIFEST_SCHEMA = Obj({
    "format": Field(Const(NATIVE_MANIFEST_FORMAT)),
    "kind": Field(Const(NATIVE_MANIFEST_KIND)),
    "model": Field(MODEL),
    "allocations": Field(Arr(ALLOCATION)),
    "pack": Field(Obj({
        "sha256": Field(Nullable(DIGEST), description="null when the pack was not exported at capture"),
        "size": Field(Int(minimum=0)),
        "alignment": Field(Const(PACK_ALIGNMENT)),
    })),
    "residual": Field(FILE_REF),
    "model_extents": Field(Arr(Obj({
        "allocation": Field(Str(min_len=1)),
        "offset": Field(Int(minimum=0)),
        "size": Field(Int(minimum=1)),
        "pack_offset": Field(Int(minimum=0)),
        "sha256": Field(DIGEST),
    }))),
    "residual_extents": Field(Arr(Obj({
        "allocation": Field(Str(min_len=1)),
        "offset": Field(Int(minimum=0)),
        "size": Field(Int(minimum=1)),
        "blob_offset": Field(Int(minimum=0)),
    }))),
})

SOURCE = Obj({
    "file": Field(Str(pattern=REL_FILE, pattern_fix=REL_FILE_FIX)),
    "tensor": Field(Str(min_len=1)),
    "dtype": Field(Str(enum=tuple(sorted(DTYPE_SIZES)))),
    "shape": Field(Arr(Int(minimum=0))),
    "slice": Field(Nullable(Arr(Int(minimum=0), min_items=3, max_items=3)),
                   description="[dim, start, stop] of the checkpoint tensor, null for the whole tensor"),
})

REPLAY_SCHEMA = Obj({
    "format": Field(Const(REPLAY_PLAN_FORMAT)),
    "kind": Field(Const(REPLAY_PLAN_KIND)),
    "model": Field(MODEL),
    "allocations": Field(Arr(ALLOCATION)),
    "files": Field(Map(Obj({
        "size": Field(Nullable(Int(minimum=0))),
        "header_sha256": Field(Nullable(DIGEST)),
    }), key_pattern=REL_FILE, key_fix=REL_FILE_FIX)),
    "extents": Field(Arr(Obj({
        "allocation": Field(Str(min_len=1)),
        "offset": Field(Int(minimum=0)),
        "size": Field(Int(minimum=1)),
        "sha256": Field(DIGEST),
        "source": Field(SOURCE),
    }))),
    "residual": Field(FILE_REF),
})


@dataclass(frozen=True)
class NativeManifest:
    """A validated native manifest."""

    model: dict
    allocations: tuple[Allocation, ...]
    pack_sha256: str | None
    pack_size: int
    residual: FileRef
    model_extents: tuple[PackedExtent, ...]
    residual_extents: tuple[ResidualExtent, ...]

    @property
    def model_bytes(self) -> int:
        return sum(e.size for e in self.model_extents)

    @property
    def residual_bytes(self) -> int:
        return sum(e.size for e in self.residual_extents)

    @property
    def pack(self) -> PackRef | None:
        """The pack this manifest binds (None when it was not exported at capture)."""
        return PackRef.for_digest(self.pack_sha256, self.pack_size) if self.pack_sha256 else None

    def as_dict(self) -> dict:
        return {
            "format": NATIVE_MANIFEST_FORMAT,
            "kind": NATIVE_MANIFEST_KIND,
            "model": dict(self.model),
            "allocations": [{"id": a.id, "address": a.address, "size": a.size} for a in self.allocations],
            "pack": {"sha256": self.pack_sha256, "size": self.pack_size, "alignment": PACK_ALIGNMENT},
            "residual": self.residual.as_dict(),
            "model_extents": [{"allocation": e.allocation, "offset": e.offset, "size": e.size,
                               "pack_offset": e.pack_offset, "sha256": e.sha256} for e in self.model_extents],
            "residual_extents": [{"allocation": e.allocation, "offset": e.offset, "size": e.size,
                                  "blob_offset": e.blob_offset} for e in self.residual_extents],
        }

    def summary(self) -> dict:
        """Counts and sizes for ``coldsnap payload inspect``."""
        return {
            "kind": NATIVE_MANIFEST_KIND,
            "model": dict(self.model),
            "allocations": len(self.allocations),
            "allocation_bytes": sum(a.size for a in self.allocations),
            "model_extents": len(self.model_extents),
            "model_bytes": self.model_bytes,
            "distinct_model_extents": len({(e.sha256, e.size) for e in self.model_extents}),
            "residual_extents": len(self.residual_extents),
            "residual_bytes": self.residual_bytes,
            "pack": ({"sha256": self.pack_sha256, "size": self.pack_size, "path": pack_relpath(
                ids.parse_digest(self.pack_sha256))} if self.pack_sha256 else {"sha256": None, "size": self.pack_size}),
            "residual": self.residual.as_dict(),
        }


@dataclass(frozen=True)
class ReplayEntry:
    """One model extent and the checkpoint slice that rebuilds it."""

    allocation: str
    offset: int
    size: int
    sha256: str
    source: TensorSource


@dataclass(frozen=True)
class ReplayPlan:
    """A validated replay plan (the recovery provider's recipe)."""

    model: dict
    allocations: tuple[Allocation, ...]
    files: dict[str, dict]
    extents: tuple[ReplayEntry, ...]
    residual: FileRef

    def as_dict(self) -> dict:
        return {
            "format": REPLAY_PLAN_FORMAT,
            "kind": REPLAY_PLAN_KIND,
            "model": dict(self.model),
            "allocations": [{"id": a.id, "address": a.address, "size": a.size} for a in self.allocations],
            "files": {k: dict(v) for k, v in sorted(self.files.items())},
            "extents": [{"allocation": e.allocation, "offset": e.offset, "size": e.size, "sha256": e.sha256,
                         "source": source_dict(e.source)} for e in self.extents],
            "residual": self.residual.as_dict(),
        }

    def summary(self) -> dict:
        return {"kind": REPLAY_PLAN_KIND, "model": dict(self.model), "allocations": len(self.allocations),
                "files": sorted(self.files), "extents": len(self.extents),
                "model_bytes": sum(e.size for e in self.extents), "residual": self.residual.as_dict()}


def source_dict(src: TensorSource) -> dict:
    return {"file": src.file, "tensor": src.tensor, "dtype": src.dtype, "shape": list(src.shape),
            "slice": list(src.slice) if src.slice is not None else None}


def check_rel_file(name: str, *, what: str) -> None:
    """A checkpoint file name must stay inside the checkpoint directory."""
    if not isinstance(name, str) or not re.fullmatch(REL_FILE, name) or any(
            part in (".", "..") for part in name.split("/")):
        raise IntegrityError(f"{what} {name!r} is not a relative path inside the checkpoint directory",
                             fix=REL_FILE_FIX)


def _read_doc(source: Path | str | bytes, what: str) -> tuple[Any, str]:
    if isinstance(source, bytes | bytearray):
        return strict_loads(bytes(source), document=what), what
    path = Path(source)
    try:
        data = fsutil.read_regular_file(path, MAX_MANIFEST_BYTES)  # a FIFO never blocks, a device is bounded
    except FileNotFoundError:
        raise ColdSnapError(f"{what} {path} does not exist", fix="check the unit's capsule state directory") from None
    except fsutil.NotRegularFile:
        raise IntegrityError(f"{what} {path} is not a regular file",
                             fix="the capsule state is damaged; pull the capsule again or recapture") from None
    if data is None:
        raise ColdSnapError(f"{what} {path} is larger than {MAX_MANIFEST_BYTES} bytes", fix="recapture")
    name = f"{what} {path}"
    return strict_loads(data, document=name), name


def load_manifest(source: Path | str | bytes) -> NativeManifest:
    """Decode and validate ``native-manifest.json`` (maps disjoint, covering, in bounds, canonical layout)."""
    raw, name = _read_doc(source, "native manifest")
    doc = validate_document(MANIFEST_SCHEMA, raw, document=name)
    allocs = tuple(Allocation(a["id"], a["address"], a["size"]) for a in doc["allocations"])
    model = tuple(PackedExtent(e["allocation"], e["offset"], e["size"], e["pack_offset"], e["sha256"])
                  for e in doc["model_extents"])
    resid = tuple(ResidualExtent(e["allocation"], e["offset"], e["size"], e["blob_offset"])
                  for e in doc["residual_extents"])
    check_coverage(allocs, [("model", [(e.allocation, e.offset, e.size) for e in model]),
                            ("residual", [(e.allocation, e.offset, e.size) for e in resid])])
    check_pack_layout(model, doc["pack"]["size"])
    check_blob_layout(resid, doc["residual"]["size"])
    r = doc["residual"]
    return NativeManifest(doc["model"], allocs, doc["pack"]["sha256"], doc["pack"]["size"],
                          FileRef(r["path"], r["size"], r["sha256"]), model, resid)


def load_replay_plan(source: Path | str | bytes) -> ReplayPlan:
    """Decode and validate ``replay-plan.json`` (extents inside allocations, disjoint, sizes match slices)."""
    raw, name = _read_doc(source, "replay plan")
    doc = validate_document(REPLAY_SCHEMA, raw, document=name)
    allocs = tuple(Allocation(a["id"], a["address"], a["size"]) for a in doc["allocations"])
    entries = []
    for e in doc["extents"]:
        s = e["source"]
        src = TensorSource(s["file"], s["tensor"], s["dtype"], tuple(s["shape"]),
                           tuple(s["slice"]) if s["slice"] is not None else None)
        check_rel_file(src.file, what="checkpoint file")
        if src.file not in doc["files"]:
            raise IntegrityError(f"replay extent {e['allocation']}[{e['offset']}] reads file {src.file!r} that the "
                                 f"plan's file table does not list", fix="the replay plan is inconsistent; recapture")
        if src.nbytes() != e["size"]:
            raise IntegrityError(f"replay extent {e['allocation']}[{e['offset']}] holds {e['size']} bytes but tensor "
                                 f"{src.tensor!r} {'slice ' if src.slice else ''}has {src.nbytes()}",
                                 fix="the replay plan is inconsistent; recapture")
        entries.append(ReplayEntry(e["allocation"], e["offset"], e["size"], e["sha256"], src))
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import residual_complement

    residual_complement(allocs, [(e.allocation, e.offset, e.size) for e in entries])  # in bounds and disjoint
    r = doc["residual"]
    return ReplayPlan(doc["model"], allocs, doc["files"], tuple(entries), FileRef(r["path"], r["size"], r["sha256"]))


def check_plan_matches(manifest: NativeManifest, plan: ReplayPlan) -> None:
    """The replay plan must rebuild exactly the manifest's model map, for the same allocations and residual."""
    if tuple(manifest.allocations) != tuple(plan.allocations):
        raise IntegrityError("the replay plan and the native manifest describe different allocation maps",
                             fix="use the replay plan captured with this manifest")
    if manifest.model != plan.model:
        raise IntegrityError(f"the replay plan is for model {plan.model}, the manifest for {manifest.model}",
                             fix="use the replay plan captured with this manifest")
    if manifest.residual != plan.residual:
        raise IntegrityError("the replay plan and the native manifest name different residual blobs",
                             fix="use the replay plan captured with this manifest")
    want = sorted((e.allocation, e.offset, e.size, e.sha256) for e in manifest.model_extents)
    have = sorted((e.allocation, e.offset, e.size, e.sha256) for e in plan.extents)
    if want != have:
        raise IntegrityError("the replay plan does not rebuild the manifest's model extents",
                             fix="use the replay plan captured with this manifest")
