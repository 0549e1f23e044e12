"""Host side of delete and retention: remove what dropped descriptors alone referenced on this host.

For each dropped descriptor (its :func:`.refs.local_refs`) this removes, when present on
this host:

* its capture directory ``<state_root>/captures/<capture id>/``;
* its capsules: OCI layouts under ``<state_root>/capsules/oci/`` (and the
  recorded layout directory when it lies inside the state root), docker images
  by id (every tag of the image), extracted capsule state under
  ``<state_root>/capsules/extracted/``;
* its capture-local model payloads in the node cache, with their validation
  records, taken under the per-digest lock.

A payload is kept when any retained descriptor (``keep_payloads``, computed by
the store on the control node) references it, when a capture directory on this
host that is not being removed references it, or when the dropped descriptor
pins a published native provider: shared published objects are never removed
implicitly, and when a running engine maps it (its CPU weights were hydrated
by mapping the pack: :meth:`NodeCache.pack_in_use`). Nothing remote (registries, the Hub) is ever touched. Removing is
convergent: what is already gone is not an error and reports no change.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import fsync_dir, rmtree_atomically
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import StateLayout
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.capsule_labels import CAPSULE_LAYOUTS
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.identifiers import parse_digest

CAPTURE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")


def _inside(path: Path, root: Path) -> bool:
    try:
        Path(os.path.abspath(path)).relative_to(Path(os.path.abspath(root)))
        return True
    except ValueError:
        return False


def _capture_payloads(capture: Path) -> set[str]:
    """Payload digests a capture directory's unit evidence references."""
    out: set[str] = set()
    for ev in capture.glob("units/*/evidence.json"):
        try:
            doc = json.loads(ev.read_text())
        except (OSError, ValueError):
            continue
        for w in doc.get("workers", []):
            pack = (w.get("payload") or {}).get("pack") or {}
            if pack.get("sha256"):
                out.add(pack["sha256"])
    return out


def locally_referenced_payloads(state_root: Path, *, excluding: set[str]) -> set[str]:
    """Digests referenced by the capture directories on this host, except the ``excluding`` capture ids."""
    root = Path(state_root) / "captures"
    out: set[str] = set()
    if not root.is_dir():
        return out
    for entry in os.scandir(root):
        if entry.is_dir(follow_symlinks=False) and entry.name not in excluding and not entry.name.startswith("."):
            out |= _capture_payloads(Path(entry.path))
    return out


def _docker_remove(image_id: str, *, check_mode: bool, client=None) -> str:
    """'removed', 'absent', 'would-remove' or 'in-use: <why>' for a local docker capsule image."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.dockerapi import (
        docker_client,
        is_not_found,
    )

    client = docker_client(client)
    try:
        image = client.images.get(image_id)
    except Exception as exc:
        if is_not_found(exc):
            return "absent"
        raise ColdSnapError(f"docker capsule {image_id}: cannot inspect it: {exc}",
                            fix="check that dockerd runs on this host") from None
    if check_mode:
        return "would-remove"
    try:
        for tag in list(image.tags) or [image_id]:
            client.images.remove(tag, force=False, noprune=False)
    except Exception as exc:
        if is_not_found(exc):
            return "removed"
        # A container (e.g. the restored workload) still uses it: keep it and say why.
        return f"in-use: {str(exc).splitlines()[0][:300]}"
    return "removed"


# What the artifact store's cleanup entries hold (refs.local_refs, store._keeping_captures).
REF_FIELDS = frozenset({"kind", "capture_id", "identity", "artifact_sha256", "capsules", "payloads", "hosts",
                        "capture_kept"})
_REFS_FIX = "pass the cleanup entries the artifact store returned (artifact_store's cleanup), unchanged"


def check_refs(refs: object) -> None:
    """Refuse malformed references before anything is removed, naming the entry and the field."""
    def need(cond: bool, where: str, what: str) -> None:
        if not cond:
            raise ColdSnapError(f"refs{where}: {what}", fix=_REFS_FIX)

    need(isinstance(refs, list), "", "must be a list of objects")
    for i, r in enumerate(refs):  # type: ignore[arg-type]
        need(isinstance(r, dict), f"[{i}]", "must be an object")
        unknown = sorted(str(k) for k in r if k not in REF_FIELDS)
        need(not unknown, f"[{i}]", f"unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(REF_FIELDS))})")
        cid = r.get("capture_id")
        need(cid is None or isinstance(cid, str), f"[{i}].capture_id", f"{cid!r} is not a string or null")
        for key, fields in (("capsules", (("image_id", str), ("layout", str))), ("payloads", (("sha256", str),))):
            items = r.get(key, [])
            need(isinstance(items, list), f"[{i}].{key}", "must be a list of objects")
            for j, item in enumerate(items):
                need(isinstance(item, dict), f"[{i}].{key}[{j}]", "must be an object")
                for name, kind in fields:
                    need(name in item, f"[{i}].{key}[{j}]", f"'{name}' is missing")
                    need(isinstance(item[name], kind), f"[{i}].{key}[{j}].{name}", f"{item[name]!r} is not a string")
                if key == "capsules":
                    need(item["layout"] in CAPSULE_LAYOUTS, f"[{i}].{key}[{j}].layout",
                         f"{item['layout']!r} is not one of {', '.join(CAPSULE_LAYOUTS)}")


def remove_local(state_root: Path | str, refs: list[dict], *, keep_payloads: list[str] | set[str], host: str,
                 check_mode: bool = False, docker_client=None,
                 keep_capsules: list[str] | set[str] = ()) -> dict:
    """Remove this host's copies of what ``refs`` reference; see the module docstring for what is kept."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.records import record_path_for

    state_root = StateLayout(state_root).root  # an empty or relative one is refused before anything is removed
    check_refs(refs)
    removed: dict[str, list] = {"captures": [], "capsules": [], "extracted": [], "payloads": []}
    kept: dict[str, list] = {"payloads": [], "capsules": []}
    capture_ids = set()
    for r in refs:
        cid = r.get("capture_id")
        if cid is None:
            continue
        if not CAPTURE_ID_RE.match(cid):
            raise ColdSnapError(f"capture id {cid!r} cannot name a capture directory",
                                fix="pass the refs the artifact store returned")
        capture_ids.add(cid)

    # Captures: <state_root>/captures/<capture id>/
    for cid in sorted(capture_ids):
        path = state_root / "captures" / cid
        if os.path.lexists(path):
            removed["captures"].append(str(path))
            if not check_mode:
                rmtree_atomically(path)

    # Capsules: OCI layouts, extracted state, docker images.
    oci_root = state_root / "capsules" / "oci"
    for r in refs:
        for cap in r.get("capsules", []):
            hexd = parse_digest(cap["image_id"], what=f"capsule image id of unit {cap.get('unit')!r}")
            if cap["image_id"] in set(keep_capsules):
                kept["capsules"].append({"image_id": cap["image_id"], "location": cap.get("location"),
                                         "reason": "still referenced by a retained descriptor"})
                continue
            extracted = state_root / "capsules" / "extracted" / hexd
            if os.path.lexists(extracted):
                removed["extracted"].append(str(extracted))
                if not check_mode:
                    rmtree_atomically(extracted)
            if cap["layout"] == "oci-layout":
                # Only the place derived from the digest: a descriptor's ``location`` is never trusted
                # to name what to delete.
                places = {oci_root / "sha256" / hexd}
                loc = Path(cap["location"]) if cap.get("location") else None
                if loc is not None and loc not in places and loc.exists():
                    kept["capsules"].append({"image_id": cap["image_id"], "location": str(loc),
                                             "reason": "not the digest-derived capsule path; remove it yourself"})
                for place in sorted(places):
                    if os.path.lexists(place):
                        removed["capsules"].append({"unit": cap.get("unit"), "image_id": cap["image_id"],
                                                    "location": str(place)})
                        if not check_mode:
                            rmtree_atomically(place)
            elif cap["layout"] == "docker":
                outcome = _docker_remove(cap["image_id"], check_mode=check_mode, client=docker_client)
                if outcome in ("removed", "would-remove"):
                    removed["capsules"].append({"unit": cap.get("unit"), "image_id": cap["image_id"],
                                                "location": cap.get("location")})
                elif outcome != "absent":
                    kept["capsules"].append({"image_id": cap["image_id"], "location": cap.get("location"),
                                             "reason": outcome})

    # Payloads: capture-local, unreferenced, unpublished.
    keep = set(keep_payloads) | locally_referenced_payloads(state_root, excluding=capture_ids)
    cache = NodeCache(state_root)
    seen: set[str] = set()
    for r in refs:
        for p in r.get("payloads", []):
            digest = p["sha256"]
            if digest in seen:
                continue
            seen.add(digest)
            path = cache.path_for(digest)
            if not os.path.lexists(path):
                continue
            if p.get("published"):
                kept["payloads"].append({"sha256": digest, "reason": "published: shared published objects are never "
                                                                     "deleted implicitly"})
                continue
            if digest in keep:
                kept["payloads"].append({"sha256": digest, "reason": "still referenced by a retained descriptor or "
                                                                     "capture"})
                continue
            if cache.pack_in_use(path):
                kept["payloads"].append({"sha256": digest, "reason": "mapped by a running engine (its CPU weights); "
                                                                     "delete again once it sleeps, is captured or stops"})
                continue
            removed["payloads"].append({"sha256": digest, "path": str(path)})
            if check_mode:
                continue
            with cache.lock(digest):
                for f in (record_path_for(path), path):
                    with contextlib.suppress(FileNotFoundError):
                        f.unlink()
                fsync_dir(path.parent)
    changed = any(removed[k] for k in removed)
    return {"changed": changed, "removed": removed, "kept": kept}
