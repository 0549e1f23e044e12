"""Published descriptors: a separate artifact derived from an accepted (or already published) one.

Publication never rewrites the descriptor it starts from. ``coldsnap publish``
writes a new artifact whose ``capsule.units[].repository_digest`` are the
immutable registry digests of the pushed capsules and whose ``state`` is
``published``; ``coldsnap publish-native`` writes one whose
``weights.providers.native`` names the Hub repository and the immutable commit
the payloads were uploaded to (the state is kept: native publication does not
make the capsules portable). Both set ``parent`` to the SHA-256 of the source
descriptor's bytes, so a published descriptor names exactly what it came from.

Replay semantics are content-idempotent: committing the same derived content
into the same directory again changes nothing; different content there is
refused (a published descriptor is never replaced).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.commit import (
    read_committed,
    write_exclusive,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import identifiers as ids
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import (
    load_artifact,
    read_descriptor_file,
    validate_artifact,
)

ARTIFACT_FILE = "artifact.json"
PUBLISHABLE_STATES = ("accepted", "published")


def file_digest(path: Path) -> str:
    """``sha256:<hex>`` of a descriptor file's bytes (what ``artifact.sha256`` and ``parent`` pin)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def load_source(path: Path, *, expected_sha256: str | None = None, request: dict | None = None) -> tuple[dict, str]:
    """Read, check and return (artifact, digest) of the descriptor a publication starts from.

    The descriptor must validate as format 9, be in a publishable state, match
    ``expected_sha256`` when given, and describe ``request``'s workload (same
    identity) when a request is given.
    """
    path = Path(path)
    try:
        data = read_descriptor_file(path, what="descriptor")
    except FileNotFoundError:
        raise ColdSnapError(f"descriptor {path} does not exist", fix="give the artifact.json a capture committed") \
            from None
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    if expected_sha256 is not None and expected_sha256 != digest:
        raise IntegrityError(f"descriptor {path} has digest {digest}, the request pins {expected_sha256}",
                             fix="publish the descriptor you meant, or update artifact.sha256")
    art = load_artifact(data, document=str(path))
    if art["state"] not in PUBLISHABLE_STATES:
        raise ColdSnapError(f"descriptor {path} is in state {art['state']!r}", fix="publish an accepted descriptor")
    if request is not None:
        from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import require_identity

        require_identity(art, request, what=f"the workload captured in {path}")
    return art, digest


def capture_hosts(artifact: dict) -> list[str]:
    """The hosts that hold the capture-local capsules and payloads, in unit order."""
    out: list[str] = []
    for c in artifact["capsule"]["units"]:
        if c["host"] not in out:
            out.append(c["host"])
    return out


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def with_capsules(artifact: dict, pushed: list[dict], *, repository: str, check_mode: bool = False) -> dict:
    """The capsule section with every unit's immutable ``repository@sha256:`` digest in ``repository``.

    In check mode a push only said it would push (no digest yet): such a unit keeps
    ``repository_digest: None``, the digest a real push returns.

    ``pushed`` are capsule entries returned by the push (``unit``, ``image_id``,
    ``repository_digest``); each must be for a recorded unit and its recorded image.
    """
    by_unit: dict[str, dict] = {}
    for entry in pushed:
        if entry.get("unit") in by_unit:
            raise ColdSnapError(f"unit {entry.get('unit')!r} was pushed twice", fix="push each capsule once")
        by_unit[entry.get("unit")] = entry
    units = []
    for cap in artifact["capsule"]["units"]:
        got = by_unit.pop(cap["unit"], None)
        if got is None or not (got.get("repository_digest") or check_mode):
            raise ColdSnapError(f"capsule of unit {cap['unit']!r} (capture host {cap['host']}) was not pushed",
                                fix="every capture host must push its capsules; nothing was committed")
        if got.get("image_id") != cap["image_id"]:
            raise IntegrityError(f"unit {cap['unit']!r}: pushed image {got.get('image_id')}, the descriptor records "
                                 f"{cap['image_id']}", fix="publish the descriptor that names this capsule")
        ref = got.get("repository_digest")
        if not ref:
            units.append({**cap, "repository_digest": None})
            continue
        name, digest = ids.split_image_ref(ref)
        if name != repository or not ids.is_digest(digest):
            raise ColdSnapError(f"unit {cap['unit']!r}: {ref!r} is not an immutable reference in {repository}",
                                fix="push to policy.capsule.repository; the result is repository@sha256:<digest>")
        units.append({**cap, "repository_digest": ref})
    if by_unit:
        raise ColdSnapError(f"pushed capsules of unknown units {sorted(by_unit)}",
                            fix="publish only the descriptor's own capsules")
    return {"units": units}


def derive(source: dict, source_digest: str, *, capsules: dict | None = None,
           native: dict | None = None, pending: bool = False) -> dict:
    """The published descriptor: ``source`` with the new capsule or native-provider section, validated.

    ``pending`` (check mode before the push or upload): capsule digests and the native revision may still
    be null, and the would-be descriptor is not validated."""
    if capsules is None and native is None:
        raise ColdSnapError("nothing to publish", fix="give pushed capsules or a native provider revision")
    ids.parse_digest(source_digest, what="source descriptor digest")
    out = json.loads(json.dumps(source))
    out["parent"] = source_digest
    out["created_at"] = _now()
    if capsules is not None:
        out["capsule"] = capsules
        out["state"] = "published"
    if native is not None:
        repo, rev = native.get("repository"), native.get("revision")
        if not (pending and rev is None) and (not (repo and isinstance(rev, str)) or not re.fullmatch(ids.COMMIT, rev)):
            raise ColdSnapError(f"native provider {native!r} is not a repository at an immutable commit",
                                fix="record the commit id the upload branch resolved to, never the branch")
        out["weights"]["providers"]["native"] = {"repository": repo, "revision": rev}
    return out if pending else validate_artifact(out, document="published descriptor")


def _refuse_the_source(final: Path, source: Path) -> None:
    if os.path.abspath(final) == os.path.abspath(source):
        raise ColdSnapError(f"{final} is the descriptor being published; publication writes a separate one",
                            fix="set output.artifact_dir to a new directory")


def _same_content(a: dict, b: dict) -> bool:
    return {**a, "created_at": ""} == {**b, "created_at": ""}


def commit_published(artifact_dir: Path, artifact: dict, *, source_path: Path,
                     check_mode: bool = False) -> tuple[Path, bool]:
    """Commit a derived descriptor as ``<artifact_dir>/artifact.json``; (path, changed).

    Content-idempotent: the same content already there is no change. The source
    descriptor itself, or a different descriptor at that path, is never replaced.
    """
    artifact_dir = Path(artifact_dir)
    final = artifact_dir / ARTIFACT_FILE
    _refuse_the_source(final, source_path)
    if os.path.lexists(final):
        existing = read_committed(final)  # never through a link, never waiting on a FIFO
        if existing is not None and _same_content(existing, artifact):
            return final, False
        raise ColdSnapError(f"{final} already holds another descriptor; a published descriptor is never replaced",
                            fix="choose a new output.artifact_dir")
    if check_mode:
        return final, True
    write_exclusive(final, artifact)
    return final, True


def _pending(capsules: dict | None, native: dict | None) -> bool:
    """Check mode: a push or upload still to be made (its digest or commit not known yet)."""
    return (capsules is not None and any(u["repository_digest"] is None for u in capsules["units"])) or \
        (native is not None and native.get("revision") is None)


def _would_publish(art: dict, digest: str, artifact_dir: Path, *, source: Path, capsules: dict | None,
                   native: dict | None) -> dict[str, Any]:
    """What check mode reports when the descriptor depends on pushes still to be made: a new descriptor at
    ``artifact_dir`` (refused as a real run would be when that path is the source or holds one already)."""
    final = Path(artifact_dir) / ARTIFACT_FILE
    _refuse_the_source(final, source)
    if os.path.lexists(final):
        raise ColdSnapError(f"{final} already holds a descriptor, and this publication still has to push: a "
                            "published descriptor is never replaced", fix="choose a new output.artifact_dir")
    would = derive(art, digest, capsules=capsules, native=native, pending=True)
    return {"changed": True, "path": str(final), "artifact": would, "parent": digest, "pending": True}


def publish_descriptor(*, source: Path, source_sha256: str, artifact_dir: Path, capsules: list[dict] | None = None,
                       repository: str | None = None, native: dict | None = None,
                       check_mode: bool = False) -> dict[str, Any]:
    """Derive and commit the published descriptor of ``source`` (which must still have ``source_sha256``)."""
    art, digest = load_source(source, expected_sha256=source_sha256)
    cap_section = None
    if capsules is not None:
        if not repository:
            raise ColdSnapError("publishing capsules needs the repository they were pushed to",
                                fix="pass policy.capsule.repository")
        cap_section = with_capsules(art, capsules, repository=repository, check_mode=check_mode)
    if check_mode and _pending(cap_section, native):
        return _would_publish(art, digest, artifact_dir, source=source, capsules=cap_section, native=native)
    derived = derive(art, digest, capsules=cap_section, native=native)
    path, changed = commit_published(artifact_dir, derived, source_path=source, check_mode=check_mode)
    if not changed and path.exists():
        derived = read_committed(path) or derived
    out: dict[str, Any] = {"changed": changed, "path": str(path), "artifact": derived, "parent": digest}
    if path.exists():
        out["sha256"] = file_digest(path)
    return out
