"""Target-local residual overlays: an acceleration cache bound to one exact target.

A portable descriptor restores anywhere its admission allows. Once a restore on
a target has its model payloads in the node cache, the running workload can be
captured once more, in place, on that target: the result keeps the shared
payload objects (same owner, role, size and SHA-256; never copied) and carries
target-local capsules and residual maps. It is stored beside the portable
descriptor as an *overlay*, bound to:

* the portable descriptor's digest,
* the snapshot driver,
* the rank-ordered inventory hostnames of the units,
* the accelerator inventory of each unit (architecture, GPU model, compute
  capability, memory, UUID and ordinal of each assigned device),
* the exact NVIDIA driver version of each unit host.

An ordinary restore of the portable descriptor selects the overlay only when all
of that equals the target's; anything different, or overlay metadata that is
missing, malformed or stale (its descriptor changed or no longer matches the
portable one), falls back to the portable descriptor with the reason reported.
An overlay is not a publication: it is removed with the recipe's local
artifacts and when its portable generation is pruned.

Layout: ``artifacts/<identity hex>/overlays/<portable hex>/<binding hex>/``
holding ``overlay.json`` (the binding, this module's format) and
``artifact.json`` (the overlay's own artifact format 9 descriptor, whose
``parent`` is the portable descriptor's digest).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.refs import local_refs
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import (
    fsync_dir,
    rmtree_atomically,
    temp_path_for,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.canonical import canonical_sha256
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.schema import (
    AnyJSON,
    Arr,
    Const,
    Field,
    Nullable,
    Obj,
    Str,
    validate_document,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.strictjson import strict_loads
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.versions import (
    OVERLAY_FORMAT,
    OVERLAY_KIND,
)

OVERLAY_FILE = "overlay.json"
ARTIFACT_FILE = "artifact.json"
DIGEST_RE = r"sha256:[0-9a-f]{64}"
BINDING_FIELDS = ("portable_sha256", "snapshot_driver", "hosts", "accelerators", "nvidia_drivers")

BINDING = Obj({
    "portable_sha256": Field(Str(pattern=DIGEST_RE)),
    "snapshot_driver": Field(Str(min_len=1)),
    "hosts": Field(Arr(Str(min_len=1), min_items=1, description="unit hosts in unit index (rank) order")),
    "accelerators": Field(Arr(AnyJSON(object_only=True), min_items=1)),
    "nvidia_drivers": Field(Arr(Nullable(Str()), min_items=1, description="per unit host, in the same order")),
})

OVERLAY_SCHEMA = Obj({
    "format": Field(Const(OVERLAY_FORMAT)),
    "kind": Field(Const(OVERLAY_KIND)),
    "identity": Field(Str(pattern=DIGEST_RE)),
    "portable": Field(Obj({"sha256": Field(Str(pattern=DIGEST_RE)), "capture_id": Field(Str(min_len=1))})),
    "binding": Field(BINDING),
    "binding_sha256": Field(Str(pattern=DIGEST_RE)),
    "capture_id": Field(Str(min_len=1)),
    "artifact": Field(Obj({"file": Field(Const(ARTIFACT_FILE)), "sha256": Field(Str(pattern=DIGEST_RE))})),
    "payloads": Field(Arr(Str(pattern=DIGEST_RE))),
    "created_at": Field(Str(min_len=1)),
}, title="ColdSnap target-local overlay (format 1)")


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def target_binding(request: dict, facts_by_host: dict, *, portable_sha256: str) -> dict:
    """The exact target an overlay is bound to, from the request's placement and each unit host's facts.

    Raises ColdSnapError when a unit host's facts are missing (the caller falls back).
    """
    units = sorted(request["launch"]["units"], key=lambda u: u["index"])
    hosts, accelerators, drivers = [], [], []
    for u in units:
        facts = facts_by_host.get(u["host"])
        if not facts:
            raise ColdSnapError(f"no host facts for {u['host']} (unit {u['id']})",
                                fix="gather coldsnap.fleet.host_facts on every unit host first")
        by_index = {g.get("index"): g for g in facts.get("gpus", [])}
        gpus = []
        for ordinal in u["devices"]:
            g = by_index.get(ordinal) or {}
            gpus.append({"ordinal": ordinal, "model": g.get("model"), "compute_capability": g.get("compute_capability"),
                         "memory_mib": g.get("memory_mib"), "uuid": g.get("uuid")})
        hosts.append(u["host"])
        accelerators.append({"unit": u["id"], "arch": facts.get("arch"), "gpus": gpus})
        drivers.append(facts.get("nvidia_driver"))
    return {"portable_sha256": portable_sha256, "snapshot_driver": request["snapshot_driver"]["id"],
            "hosts": hosts, "accelerators": accelerators, "nvidia_drivers": drivers}


def binding_hex(binding: dict) -> str:
    return canonical_sha256(binding).split(":", 1)[1]


def _payload_objects(artifact: dict) -> list[tuple]:
    """The payload objects an overlay must share with its portable descriptor, per worker."""
    out = []
    for w in sorted(artifact["weights"]["workers"], key=lambda x: x["worker"]):
        p = w["payload"]
        out.append((w["worker"], w["role"], None if p is None else (p["owner"], p["size"], p["sha256"])))
    return out


def _replay_objects(artifact: dict) -> list[tuple]:
    return [(w["worker"], w["residual"]["sha256"], w["manifest"]["sha256"], w["replay"]["sha256"])
            for w in sorted(artifact["weights"]["workers"], key=lambda x: x["worker"])]


def _capsule_ids(artifact: dict) -> list[tuple]:
    return sorted((c["unit"], c["image_id"]) for c in artifact["capsule"]["units"])


def read_descriptor(path: Path) -> tuple[dict, str]:
    """(validated descriptor, ``sha256:<hex>`` of its file)."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import (
        load_artifact,
        read_descriptor_file,
    )

    data = read_descriptor_file(path)  # a user's path: never a directory, a FIFO or /dev/zero
    return load_artifact(data, document=str(path)), "sha256:" + hashlib.sha256(data).hexdigest()


def _differences(recorded: dict, wanted: dict) -> list[str]:
    out = []
    for key in BINDING_FIELDS:
        if recorded.get(key) != wanted.get(key):
            out.append(f"{key}: overlay has {json.dumps(recorded.get(key), sort_keys=True)}, this target has "
                       f"{json.dumps(wanted.get(key), sort_keys=True)}")
    return out


def _load_overlay_dir(odir: Path) -> tuple[dict | None, str | None]:
    """(overlay metadata, problem): the metadata only when it is well-formed."""
    try:
        doc = validate_document(OVERLAY_SCHEMA, strict_loads((odir / OVERLAY_FILE).read_bytes(),
                                                             document=str(odir / OVERLAY_FILE)),
                                document=str(odir / OVERLAY_FILE))
    except FileNotFoundError:
        return None, f"overlay metadata {odir / OVERLAY_FILE} is missing"
    except ColdSnapError as exc:
        return None, f"overlay metadata {odir / OVERLAY_FILE} is invalid: {str(exc).splitlines()[0]}"
    except OSError as exc:
        return None, f"overlay metadata {odir / OVERLAY_FILE} cannot be read: {exc.strerror}"
    if doc["binding_sha256"] != canonical_sha256(doc["binding"]) or odir.name != binding_hex(doc["binding"]):
        return None, f"overlay metadata {odir / OVERLAY_FILE} does not match its own binding digest"
    return doc, None


def check_overlay(odir: Path, *, portable: dict, portable_sha256: str) -> tuple[dict | None, str | None]:
    """(overlay artifact, problem): the overlay's descriptor only when its metadata is valid and current."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import load_artifact

    doc, problem = _load_overlay_dir(odir)
    if doc is None:
        return None, problem
    if doc["portable"]["sha256"] != portable_sha256 or doc["binding"]["portable_sha256"] != portable_sha256:
        return None, "stale overlay: it was captured from another portable descriptor"
    path = odir / ARTIFACT_FILE
    try:
        data = path.read_bytes()
    except OSError:
        return None, f"stale overlay: its descriptor {path} is missing"
    if "sha256:" + hashlib.sha256(data).hexdigest() != doc["artifact"]["sha256"]:
        return None, f"stale overlay: its descriptor {path} changed after it was recorded"
    try:
        art = load_artifact(data, document=str(path))
    except ColdSnapError as exc:
        return None, f"invalid overlay descriptor {path}: {str(exc).splitlines()[0]}"
    if art["identity"] != portable["identity"] or art.get("parent") != portable_sha256:
        return None, "stale overlay: its descriptor belongs to another identity or portable descriptor"
    if _payload_objects(art) != _payload_objects(portable):
        return None, "stale overlay: its model payload objects differ from the portable descriptor's"
    if art["snapshot_driver"]["id"] != portable["snapshot_driver"]["id"]:
        return None, "stale overlay: recorded with another snapshot driver"
    return art, None


def select_overlay(store, *, portable_path: Path | str, request: dict, facts_by_host: dict | None) -> dict:
    """Prefer a target-local overlay of the portable descriptor on exactly its target; else fall back.

    Returns ``{"selected", "artifact" (the descriptor to restore), "artifact_sha256", "overlay" (path or None),
    "portable_sha256", "binding_sha256", "reasons"}``; never raises for overlay problems.
    """
    portable, portable_sha = read_descriptor(Path(portable_path))
    result = {"selected": False, "artifact": portable, "artifact_sha256": portable_sha, "overlay": None,
              "portable_sha256": portable_sha, "binding_sha256": None, "reasons": []}
    root = store.overlay_root(portable["identity"], portable_sha)
    candidates = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) \
        if root.is_dir() else []
    if not candidates:
        result["reasons"].append("no target-local overlay is recorded for this descriptor")
        return result
    try:
        binding = target_binding(request, facts_by_host or {}, portable_sha256=portable_sha)
    except ColdSnapError as exc:
        result["reasons"].append(f"the target cannot be identified: {exc.problem}")
        return result
    key = binding_hex(binding)
    result["binding_sha256"] = f"sha256:{key}"
    odir = root / key
    if not odir.is_dir():
        for cand in candidates:
            doc, problem = _load_overlay_dir(cand)
            if doc is None:
                result["reasons"].append(problem)
            else:
                diffs = "; ".join(_differences(doc["binding"], binding))
                result["reasons"].append(f"overlay {cand.name[:12]} is for another target ({diffs})")
        return result
    art, problem = check_overlay(odir, portable=portable, portable_sha256=portable_sha)
    if art is None:
        result["reasons"].append(problem)
        return result
    data = (odir / ARTIFACT_FILE).read_bytes()
    result.update(selected=True, artifact=art, artifact_sha256="sha256:" + hashlib.sha256(data).hexdigest(),
                  overlay=str(odir), reasons=["the target matches the overlay's binding exactly"])
    return result


def build_overlay_artifact(request: dict, *, portable: dict, portable_sha256: str, capture_id: str,
                           evidence: list[dict], facts_by_host: dict, capsules: list[dict],
                           activation_digest: str) -> dict:
    """Artifact format 9 of an in-place capture on the target, whose parent is the portable descriptor."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.commit import (
        build_artifact,
        by_unit,
    )
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import validate_artifact

    ev, facts, caps = by_unit(request, evidence, facts_by_host, capsules)
    art = build_artifact(request, capture_id=capture_id, evidence=ev, facts=facts, capsules=caps,
                         activation_digest=activation_digest)
    # Providers come from the portable lineage (the restore request may not name them).
    art["weights"]["providers"] = portable["weights"]["providers"]
    art["parent"] = portable_sha256
    return validate_artifact(art, document="overlay artifact")


def record_overlay(store, *, portable_path: Path | str, overlay_artifact: dict, binding: dict,
                   check_mode: bool = False) -> dict:
    """Store ``overlay_artifact`` for ``binding``, or discard it when it is the portable capture again.

    Returns ``{"changed", "stored", "discarded", "reason", "path", "refs"}``; ``refs`` (the overlay
    capture's host-local artifacts) are for the caller to remove when it was discarded.
    """
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import validate_artifact

    portable, portable_sha = read_descriptor(Path(portable_path))
    art = validate_artifact(overlay_artifact, document="overlay artifact")
    if binding["portable_sha256"] != portable_sha:
        raise ColdSnapError("the overlay binding names another portable descriptor",
                            fix="bind the overlay to the descriptor the workload was restored from")
    if art["identity"] != portable["identity"]:
        raise IntegrityError("the overlay capture belongs to another identity than its portable descriptor",
                             fix="capture the overlay with the request that restored the portable descriptor")
    if _payload_objects(art) != _payload_objects(portable):
        raise IntegrityError("the overlay capture's model payload objects differ from the portable descriptor's "
                             "(owner, role, size or SHA-256)",
                             fix="the resident model bytes are not the captured ones; restore the portable "
                                 "descriptor again before capturing an overlay")
    refs = local_refs(art, kind="overlay")
    if _capsule_ids(art) == _capsule_ids(portable) and _replay_objects(art) == _replay_objects(portable):
        return {"changed": False, "stored": False, "discarded": True, "path": None, "refs": refs,
                "reason": "the target-local capture is identical to the portable one; nothing to keep"}
    key = binding_hex(binding)
    odir = store.overlay_root(art["identity"], portable_sha) / key
    data = (json.dumps(art, indent=2, sort_keys=True) + "\n").encode()
    doc = {"format": OVERLAY_FORMAT, "kind": OVERLAY_KIND, "identity": art["identity"],
           "portable": {"sha256": portable_sha, "capture_id": portable["capture_id"]},
           "binding": binding, "binding_sha256": f"sha256:{key}", "capture_id": art["capture_id"],
           "artifact": {"file": ARTIFACT_FILE, "sha256": "sha256:" + hashlib.sha256(data).hexdigest()},
           "payloads": sorted({w["payload"]["sha256"] for w in art["weights"]["workers"] if w["payload"]}),
           "created_at": _now()}
    validate_document(OVERLAY_SCHEMA, doc, document="overlay metadata")
    kept = {"changed": False, "stored": True, "discarded": False, "path": str(odir), "refs": refs,
            "reason": "this overlay is already stored for this target"}
    if check_mode:
        return kept if _stored_already(odir, data, doc) else {
            "changed": True, "stored": False, "discarded": False, "path": str(odir), "refs": refs,
            "reason": "would store the overlay"}
    with store.locked(art["identity"]):
        if _stored_already(odir, data, doc):
            return kept
        for d in (odir.parent.parent, odir.parent):  # overlays/<portable hex>/, below the 0700 identity directory
            d.mkdir(exist_ok=True, mode=0o700)
        tmp = temp_path_for(odir)
        os.mkdir(tmp, 0o700)
        try:
            for name, payload in ((ARTIFACT_FILE, data),
                                  (OVERLAY_FILE, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())):
                # 0600 like every descriptor: the artifact names the launch, its placement and its captures.
                fd = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                with os.fdopen(fd, "wb") as fh:
                    fh.write(payload)
                    fh.flush()
                    os.fsync(fh.fileno())
            fsync_dir(tmp)
            if odir.exists():
                # A new overlay for the same target replaces the old one; missing in between means fall back.
                old = temp_path_for(odir)
                os.rename(odir, old)
                shutil.rmtree(old, ignore_errors=True)
            os.rename(tmp, odir)
            fsync_dir(odir.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return {"changed": True, "stored": True, "discarded": False, "path": str(odir), "refs": refs,
            "reason": "stored as the target-local overlay of the portable descriptor"}


def _stored_already(odir: Path, data: bytes, doc: dict) -> bool:
    """``odir`` holds exactly this overlay (its creation time aside): storing it again changes nothing."""
    try:
        same_artifact = (odir / ARTIFACT_FILE).read_bytes() == data
        stored = json.loads((odir / OVERLAY_FILE).read_text())
    except (OSError, ValueError):
        return False
    return same_artifact and isinstance(stored, dict) and \
        {k: v for k, v in stored.items() if k != "created_at"} == {k: v for k, v in doc.items() if k != "created_at"}


def list_overlays(store, identity: str) -> list[dict]:
    """Every overlay of an identity (well-formed or not) with its host-local references."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import load_artifact

    base = store.identity_dir(identity) / "overlays"
    out: list[dict] = []
    if not base.is_dir():
        return out
    for pdir in sorted(base.iterdir()):
        if not pdir.is_dir() or pdir.name.startswith("."):
            continue
        for odir in sorted(pdir.iterdir()):
            if not odir.is_dir() or odir.name.startswith("."):
                continue
            entry = {"path": str(odir), "portable_sha256": f"sha256:{pdir.name}", "payloads": [],
                     "refs": {"kind": "overlay", "capture_id": None, "capsules": [], "payloads": [], "hosts": []}}
            try:
                data = (odir / ARTIFACT_FILE).read_bytes()
                entry["sha256"] = "sha256:" + hashlib.sha256(data).hexdigest()
                art = load_artifact(data, document=str(odir / ARTIFACT_FILE))
                entry["refs"] = local_refs(art, kind="overlay")
                entry["payloads"] = [p["sha256"] for p in entry["refs"]["payloads"]]
            except (OSError, ColdSnapError):
                pass
            out.append(entry)
    return out


def remove_overlays_of(store, identity: str, portable_sha256: str) -> list[dict]:
    """Remove the overlays of one portable descriptor (its generation was pruned); return their refs."""

    hexd = portable_sha256.split(":", 1)[1]
    gone = [o for o in list_overlays(store, identity) if o["portable_sha256"] == f"sha256:{hexd}"]
    root = store.identity_dir(identity) / "overlays" / hexd
    if root.exists():
        rmtree_atomically(root)
    return gone
