"""``native-status``: which native model payloads each host holds for an artifact, per worker.

States (one per worker, on the host that owns the worker):

* ``verified``: the pack is in the node cache with a validation record that
  still matches the file (the next restore skips the hash and takes native);
* ``present``: the pack is there but has no validation record yet (the next
  restore hashes it once);
* ``stale``: the pack is there but its record no longer proves it (the file
  changed since: size, inode, mtime or ctime differ; or the record is racy,
  malformed or not private): the next restore re-hashes it fully;
* ``missing``: no pack in the node cache (the next restore stages it or falls
  back to recovery, as the weights mode allows);
* ``none``: the capture has no native payload for this worker (export was off).

By default nothing is hashed (records are read, never written: convergent and
cheap). ``verify=True`` runs the full verifier on present/stale packs, which
writes a fresh record (a change) or quarantines a corrupt pack (``corrupt``).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import units_on_host

STATES = ("verified", "present", "stale", "missing", "none", "corrupt")
_RECORD_STATE = {"valid": "verified", "absent": "present"}


def payload_state(state_root: Path | str, sha256: str, size: int) -> tuple[str, str]:
    """(state, reason) of one pack in this host's node cache, without hashing it."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import PayloadVerifier

    cache = NodeCache(state_root)
    path = cache.path_for(sha256)
    if not path.is_file():
        return "missing", cache.absence_reason(sha256)
    try:
        check = PayloadVerifier().inspect(path, sha256, size)
    except ColdSnapError as exc:
        return "missing", exc.problem
    return _RECORD_STATE.get(check.status, "stale"), check.reason or check.status


def native_status(request: dict, artifact: dict, *, host: str, state_root: Path | str, verify: bool = False,
                  check_mode: bool = False) -> dict:
    """The native payload state of every worker whose unit ``request`` places on ``host``."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import PayloadVerifier

    host_units = {u["id"] for u in units_on_host(request, host)}
    workers = []
    changed = False
    for w in sorted(artifact["weights"]["workers"], key=lambda x: x["rank"]):
        if w["unit"] not in host_units:
            continue
        p = w["payload"]
        entry = {"worker": w["worker"], "unit": w["unit"], "rank": w["rank"], "host": host,
                 "sha256": p["sha256"] if p else None, "size": p["size"] if p else None,
                 "path": str(NodeCache(state_root).path_for(p["sha256"])) if p else None}
        if p is None:
            entry.update(state="none", reason="the capture exported no native payload for this worker")
            workers.append(entry)
            continue
        state, reason = payload_state(state_root, p["sha256"], p["size"])
        if verify and state in ("present", "stale"):
            try:
                with PayloadVerifier().verify(NodeCache(state_root), p["sha256"], p["size"],
                                              write_record=not check_mode) as verified:
                    # check mode: the record a real run would write (none when a valid one was reused)
                    changed |= bool(verified.record_written) or (check_mode and not verified.reused_record)
                state, reason = "verified", "full SHA-256 verification passed"
            except IntegrityError as exc:
                state, reason = "corrupt", exc.problem
                # A change only where a pack was (or, in check mode, would be) quarantined: an intact pack
                # that the artifact gives another size stays in the cache, untouched.
                changed |= bool(exc.details.get("quarantined")) or (check_mode
                                                                    and bool(exc.details.get("wrong_object")))
        entry.update(state=state, reason=reason)
        workers.append(entry)
    summary = Counter(w["state"] for w in workers)
    return {"changed": changed, "host": host, "workers": workers,
            "summary": {s: summary.get(s, 0) for s in STATES if summary.get(s)}}
