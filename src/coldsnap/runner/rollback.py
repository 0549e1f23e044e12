"""A restore that fails after it evicted the running workload brings that workload back.

Every engine of a workload that runs under ColdSnap was restored (a capture leaves its workload
stopped), so what a restore evicts is the workload of an earlier restore or warm restore. The controller
remembers, per workload, the last one of those it ran that succeeded: ``<state_root>/serving/<recipe>.json``
(0600; the normalized request, and the hosts, units and engine pids it restored). A ``stop`` of the
workload forgets it.

When a restore or warm restore fails after its evict step stopped something (``result.eviction`` says
``evicted``), the controller — still holding the workload's lock — checks that what was evicted is what
that record restored (the same hosts and units, and for runtime ``host`` the same engine pids; a
workload another controller restored since is not taken for it) and runs a full restore of the recorded
request again, under the operation id ``<id>-rollback``, with the same inventory, variables and
environment. The failed run's receipt then records ``result.rollback`` (whether it was tried, why not,
the rollback's id, state and receipt) and its error message says whether the workload that ran before
serves again (``result.eviction.previous_workload``: ``rolled-back``); the failed run still fails.

``--no-rollback`` (``rollback=False``) leaves the workload evicted, as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import atomic_write_bytes
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import StateLayout
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import eviction

from coldsnap.receipts import write_receipt
from coldsnap.runner.contract import EXTRAVAR_KEEP_HANDOVER, RESERVED_EXTRAVARS

RECORD_KIND = "coldsnap-serving"
_MAX_CAUSE = 2000  # characters of the rollback's own error quoted in the failed run's message


def serving_path(state_root: Path, recipe: str) -> Path:
    return StateLayout(state_root).serving(recipe)


def _recipe(request: Mapping[str, Any] | None) -> str | None:
    return ((request or {}).get("workload") or {}).get("recipe")


def remember(state_root: Path, request: Mapping[str, Any], receipt: Mapping[str, Any]) -> str | None:
    """Record the workload a successful restore (or warm restore) left running, its descriptor pinned: the
    artifact path resolved (a ``current`` link moves with the next capture) and its digest. Returns why
    nothing could be recorded (a warning; the record is then removed: no rollback to a guess), else None."""
    recipe = str(_recipe(request))
    try:
        path = Path(os.path.realpath(request["artifact"]["path"]))
        data = path.read_bytes()
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if request["artifact"].get("sha256") not in (None, digest):
            raise ValueError(f"{path} is no longer the descriptor the restore checked ({digest})")
        artifact = json.loads(data)
        units = []
        images = {c.get("unit"): c.get("image_id") for c in (artifact.get("capsule") or {}).get("units") or []
                  if isinstance(c, Mapping)}
        for u in ((receipt.get("result") or {}).get("operation") or {}).get("units") or []:
            if isinstance(u, Mapping):
                units.append({"host": u.get("host"), "unit": u.get("unit"), "image": images.get(u.get("unit")),
                              "pids": sorted(int(w["pid"]) for w in u.get("workers") or []
                                             if isinstance(w, Mapping) and isinstance(w.get("pid"), int))})
        pinned = {**request, "artifact": {**request["artifact"], "path": str(path), "sha256": digest}}
        record = {"format": 1, "kind": RECORD_KIND, "operation_id": str(request["id"]),
                  "operation": receipt.get("operation"), "capture_id": artifact.get("capture_id"),
                  "request": pinned, "units": units}
        target = serving_path(state_root, recipe)
        target.parent.mkdir(mode=0o700, exist_ok=True)
        atomic_write_bytes(target, json.dumps(record, indent=1, sort_keys=True).encode(), mode=0o600)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        with contextlib.suppress(OSError):
            forget(state_root, recipe)
        return (f"the controller could not record what workload {recipe!r} runs from "
                f"({type(exc).__name__}: {exc}): a restore that fails after eviction will not roll back to it")
    return None


def forget(state_root: Path, recipe: str | None) -> None:
    """The workload was stopped: nothing of it serves, there is nothing to roll back to."""
    if recipe:
        serving_path(state_root, recipe).unlink(missing_ok=True)


def recorded(state_root: Path, recipe: str) -> dict | None:
    try:
        doc = json.loads(serving_path(state_root, recipe).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(doc, dict) and doc.get("kind") == RECORD_KIND and isinstance(doc.get("request"), dict)
    return doc if ok else None


def keeps_handover(state_root: Path, request: Mapping[str, Any] | None, *, enabled: bool) -> bool:
    """Whether a restore of ``request`` keeps an evict step's unused hand-over for its rollback (instead of
    its playbook giving it back): only when a rollback could follow, ``enabled`` and a record of what runs.
    Without one, a kept hand-over only held the evicted workload away from the next run for two minutes."""
    recipe = _recipe(request)
    return bool(enabled and recipe and recorded(state_root, str(recipe)) is not None)


def same_workload(record: Mapping[str, Any], evicted: list[Mapping[str, Any]]) -> str | None:
    """None when ``evicted`` (the failed restore's ``result.eviction.units``) is what ``record`` restored:
    the same hosts and units, each running the recorded capture — for runtime ``host`` its engine pids
    (CRIU restores a capture's engines at the pids it captured), for ``docker`` its container's image (the
    capture's capsule). Else why not."""
    mine = {(u.get("host"), u.get("unit")): u for u in record.get("units") or []}
    for e in evicted:
        key = (e.get("host"), e.get("unit"))
        where = f"unit {e.get('unit')} on {e.get('host')}"
        if key not in mine:
            return f"{where} was not part of the workload operation {record.get('operation_id')} restored"
        pids = sorted(int(p) for p in e.get("pids") or [])
        if pids:
            if not set(pids) & set(mine[key].get("pids") or []):
                return (f"{where} ran engine pids {pids}, not those of the capture operation "
                        f"{record.get('operation_id')} restored ({mine[key].get('pids')}): another capture was "
                        "restored since (by another controller or AWX job)")
        elif not e.get("image") or e.get("image") != mine[key].get("image"):
            return (f"{where} ran container image {e.get('image') or '(not known)'}, not the capsule operation "
                    f"{record.get('operation_id')} restored ({mine[key].get('image')})")
    return None


def rollback_request(record: Mapping[str, Any], failed_id: str) -> dict:
    """The recorded request again, as a full restore under the failed run's id + ``-rollback``."""
    return {**record["request"], "id": eviction.rollback_id(failed_id), "operation": "restore"}


# Variables of the failed run the rollback does not repeat: the contract's (set anew from its request) and
# the overlay capture a restore may add (a rollback only brings back what ran), and the hand-over kept for it.
_NOT_REPEATED = (*RESERVED_EXTRAVARS, "coldsnap_capture_overlay", EXTRAVAR_KEEP_HANDOVER)


def _without_contract(variables: Mapping[str, Any]) -> dict:
    return {k: v for k, v in variables.items() if k not in _NOT_REPEATED}


def after_restore(config: Any, result: Any, *, enabled: bool, build: Callable[..., Any],
                  run: Callable[[Any], Any], say: Callable[[str], None],
                  cancelled: Callable[[], bool] = lambda: False,
                  release: Callable[[Any], Any] | None = None) -> Any:
    """What follows a restore or warm restore's run (``config``/``result``: its RunConfig and
    OperationResult): remember a success; roll back a failure after eviction (module doc). ``build``
    makes the rollback's RunConfig (``RunConfig.build``), ``run`` runs it under its own run lock, ``say``
    writes one progress line, ``cancelled`` says whether the user asked to stop, ``release`` runs (even
    after a cancel) the playbook that gives back an unused hand-over when no rollback follows
    (:func:`give_back`). Returns the result, its receipt updated when a rollback was considered (or a
    success could not be recorded)."""
    request = config.request or {}
    if result.succeeded:
        if not config.prepare_only and _recipe(request):
            problem = remember(config.state_root, request, result.receipt)
            if problem:
                return _warned(result, problem)
        return result
    outcome = result.receipt.get("result") or {}
    record = outcome.get("eviction") or {}
    if config.prepare_only or record.get("previous_workload") != eviction.EVICTED:
        return result
    evicted = [u for u in record.get("units") or [] if isinstance(u, Mapping)]
    previous = recorded(config.state_root, str(_recipe(request)))
    why = None
    if result.cancelled or cancelled():
        why = "the restore was cancelled"
    elif not enabled:
        why = "not asked for (--no-rollback)"
    elif previous is None:
        why = ("this controller has no record of the workload that ran (restored by another controller, or "
               "stopped and restored elsewhere)")
    else:
        why = same_workload(previous, evicted)
    if why is not None:
        info: dict[str, Any] = {"attempted": False, "why": why}
        if release is not None and (result.cancelled or cancelled() or config.public_vars.get(EXTRAVAR_KEEP_HANDOVER)):
            info["handover"] = give_back(config, build=build, release=release, say=say)
        return _annotated(result, info, rolled_back=False, previous=previous)
    rb_request = rollback_request(previous, config.operation_id)
    say(f"restore {config.operation_id} failed after evicting the workload: rolling back to what ran before "
        f"(operation {previous['operation_id']}) as {rb_request['id']}")
    try:
        rb_config = build(operation="restore", request=rb_request, playbook=None,
                          extravars=_without_contract(config.public_vars), inventory=config.inventory,
                          state_root=config.state_root, envvars=config.caller_env,
                          secret_extravars=_without_contract(config.secret_vars), verbosity=config.verbosity,
                          keep_artifacts=config.keep_artifacts)
        rb = run(rb_config)
    except ColdSnapError as exc:
        return _annotated(result, {"attempted": True, "operation_id": rb_request["id"], "state": "failed",
                                   "from_operation": previous["operation_id"], "why": str(exc)},
                          rolled_back=False, previous=previous)
    if rb.succeeded:
        remember(config.state_root, rb_request, rb.receipt)
    rb_error = (rb.receipt.get("error") or {}).get("message") or ""
    info = {"attempted": True, "operation_id": rb_request["id"],
            "state": "cancelled" if rb.cancelled else rb.receipt["state"],
            "from_operation": previous["operation_id"], "receipt": str(rb.receipt_path),
            "duration_seconds": rb.receipt.get("duration_seconds")}
    if not rb.succeeded:
        info["why"] = "it was cancelled" if rb.cancelled else rb_error[:_MAX_CAUSE]
    out = _annotated(result, info, rolled_back=rb.succeeded, previous=previous)
    return dataclasses.replace(out, cancelled=True) if rb.cancelled else out


def give_back(config: Any, *, build: Callable[..., Any], release: Callable[[Any], Any],
              say: Callable[[str], None]) -> str:
    """Give back the hand-over the failed restore's evict step left for its activation (units/claim.py)
    when no rollback takes it: its playbook kept it for one, or was cancelled before its ``always`` ran.
    Left there, it refused the next restore of the workload for two minutes. Runs ``playbooks/release.yml``
    as ``<id>-release`` with the restore's run id. Returns what became of it, for ``result.rollback``."""
    request = config.request or {}
    say(f"giving back the workload restore {config.operation_id} evicted (no rollback follows)")
    try:
        cfg = build(operation=config.operation, request={**request, "id": eviction.release_id(config.operation_id)},
                    playbook="coldsnap.fleet.release",
                    extravars={**_without_contract(config.public_vars), "coldsnap_handover_of": config.operation_id},
                    inventory=config.inventory, state_root=config.state_root, envvars=config.caller_env,
                    secret_extravars=_without_contract(config.secret_vars), verbosity=config.verbosity,
                    keep_artifacts=config.keep_artifacts)
        out = release(cfg)
    except ColdSnapError as exc:
        return f"not given back ({exc}): the next restore waits for it up to two minutes"
    if out.succeeded:
        return "given back"
    cause = ((out.receipt.get("error") or {}).get("message") or out.receipt.get("state") or "")[:_MAX_CAUSE]
    return f"not given back ({cause}): the next restore waits for it up to two minutes"


def _annotated(result: Any, info: dict, *, rolled_back: bool, previous: Mapping[str, Any] | None) -> Any:
    """The failed run's receipt with ``result.rollback`` and its message saying what became of the workload."""
    receipt = json.loads(json.dumps(result.receipt))
    receipt["result"]["rollback"] = info
    error = receipt.get("error") or {}
    if rolled_back:
        receipt["result"]["eviction"]["previous_workload"] = eviction.ROLLED_BACK
        captures = [str(previous["capture_id"])] if (previous or {}).get("capture_id") else []
        error["message"] = eviction.rolled_back(error.get("message") or "", rollback_id=info["operation_id"],
                                                captures=captures)
    elif info.get("attempted"):
        error["message"] = (f"{error.get('message') or ''} The rollback (restore {info['operation_id']}, to what "
                            f"operation {info.get('from_operation')} restored) failed too: {info.get('why')}")
    else:
        error["message"] = f"{error.get('message') or ''} No rollback: {info['why']}."
    receipt["error"] = error
    return _rewritten(result, receipt)


def _warned(result: Any, problem: str) -> Any:
    receipt = json.loads(json.dumps(result.receipt))
    receipt["result"].setdefault("controller_warnings", []).append(problem)
    return _rewritten(result, receipt)


def _rewritten(result: Any, receipt: dict) -> Any:
    for path in dict.fromkeys((Path(result.receipt_path), Path(result.artifact_dir) / "receipt.json")):
        write_receipt(path, receipt, mode=0o600)
    return dataclasses.replace(result, receipt=receipt)
