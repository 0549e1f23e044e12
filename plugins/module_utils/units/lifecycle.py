"""Per-host lifecycle steps of running units: status, sleep, wake, finish-warm, stop (convergent)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import UnitError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import engine_control as ec
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import units_on_host
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import activation_stage
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.claim import claimed
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.docker_units import DockerUnits
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.evidence import public, timing_of
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.host_units import HostUnits
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.ownership import parse_owner
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.specs import (
    accepted_validation,
    build_specs,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.weights import (
    plan_weights,
    read_packs_ahead,
)

# The running halves of the runtimes only (see .runtime): this module's closure stays small.
RUNNING_UNITS = {"host": HostUnits, "docker": DockerUnits}


def _would_change(action: str, state: str | None) -> bool:
    return (action == "sleep" and state == "ready") or (action in ("wake", "finish-warm")
                                                        and state in ("sleeping", "warm"))


def lifecycle_units(request: dict, artifact: dict | None, *, host: str, action: str, state_root: Path,
                    activation_digest: str, python: str | None, check_mode: bool,
                    activation_required: bool = True, owner: Any = None, run_id: str | None = None) -> dict:
    """status / sleep / wake / finish-warm / stop of this host's running units (convergent).

    With ``activation_required`` false, a host where the activation runtime ``activation_digest``
    is not staged is left alone and answers ``activation_staged: false`` (the caller stages it and
    asks again): one round trip where it is staged, which is nearly always. Only sleep, wake and
    finish-warm run it: ``status`` (and check mode, which only reads) asks a host unit's workers
    through their control APIs and a docker unit's container through the runtime it was started
    with, and ``stop`` only ends processes.

    ``owner`` (runtime docker): the invoking user, ``{uid, gid}`` or ``'uid:gid'``; what a step wrote
    under ``state_root`` as root (inside the unit container, or as a root module) is given to it
    afterwards, also when the step failed. None leaves the files as written."""
    parse_owner(owner)  # a malformed owner is refused on every runtime, before anything runs
    units = units_on_host(request, host)
    if not units:
        return {"changed": False, "units": []}
    if action == "status":  # only reads: beside anything
        return _lifecycle(request, artifact, units, host=host, action=action, state_root=state_root,
                          activation_digest=activation_digest, python=python, check_mode=check_mode,
                          activation_required=activation_required, owner=owner)
    with claimed(state_root, request, host=host, step=action, check_mode=check_mode, run=run_id):
        return _lifecycle(request, artifact, units, host=host, action=action, state_root=state_root,
                          activation_digest=activation_digest, python=python, check_mode=check_mode,
                          activation_required=activation_required, owner=owner)


def _lifecycle(request: dict, artifact: dict | None, units: list[dict], *, host: str, action: str,
               state_root: Path, activation_digest: str, python: str | None, check_mode: bool,
               activation_required: bool, owner: Any) -> dict:
    runs_activation = action in ("sleep", "wake", "finish-warm") and not check_mode
    if not activation_required and runs_activation and \
            not activation_stage.staged_path(state_root, activation_digest).is_dir():
        return {"changed": False, "units": [], "activation_staged": False}
    runtime = RUNNING_UNITS[request["launch"]["runtime"]](request, host=host, state_root=state_root,
                                                          activation_digest=activation_digest, python=python,
                                                          owner=owner)
    if action == "stop":
        # The engines (whole process trees, or the unit containers) go; captures, artifacts, payloads and
        # the model cache stay, so the workload can be restored again.
        # A crashed unit (its engine gone, its control file left) becomes stopped too: that is a change.
        crashed = {u["id"] for u in units if runtime.presence(u["id"]) == "crashed"}
        stopped = {s["unit"]: s for s in runtime.evict(check_mode=check_mode)}
        return {"changed": bool(stopped) or bool(crashed),
                "units": [{"unit": u["id"], "host": host, "ok": True, "state": "stopped",
                           "stopped": stopped.get(u["id"]), "was_crashed": u["id"] in crashed} for u in units]}
    if action == "status":
        # A unit whose engine does not run is reported (stopped, or crashed when it was never stopped);
        # only the running ones are asked.
        presence = {u["id"]: runtime.presence(u["id"]) for u in units}
        idle = [{"unit": u["id"], "host": host, "ok": True, "state": presence[u["id"]], "workers": []}
                for u in units if presence[u["id"]] != "running"]
        units = [u for u in units if presence[u["id"]] == "running"]
        if not units:
            return {"changed": False, "units": idle}
    else:
        # Sleep, wake and finish-warm act on a running engine: a stopped (or crashed) unit is an error, in
        # check mode too, never a success that changed nothing.
        for u in units:
            presence = runtime.presence(u["id"])
            if presence != "running":
                raise UnitError(f"unit {u['id']} on {host} is {presence}: there is no running engine to {action}",
                                fix="restore the workload first (coldsnap restore), then sleep or wake it")
        idle = []
    capture_id = artifact["capture_id"] if artifact else request["id"]
    unit_dirs = {u["id"]: runtime.unit_dir(artifact, u["id"]) for u in units} if artifact else None
    # Only a wake (or finish-warm) maps weights back: it alone plans them, which verifies the node's packs
    # (a real run writes their validation records and quarantines a corrupt one; check mode only reads).
    # Status and sleep read nothing of the payloads, so a removed or damaged pack never fails them.
    # What the step writes (records, locks, the workload directories) is the invoking user's afterwards,
    # also when the step failed.
    hydrates = bool(artifact) and action in ("wake", "finish-warm")
    # Only a step that planned the weights wrote in the node payload cache: nothing else is given back
    # (a status or a sleep chowns nothing there).
    with runtime.giving_back() if hydrates else contextlib.nullcontext():
        weights = plan_weights(request, artifact, host=host, state_root=state_root,
                               dry_run=check_mode) if hydrates else {}
        if weights and not check_mode:
            read_packs_ahead(weights)
        validation = accepted_validation(request, artifact) if hydrates else request.get("validation")
        op = "status" if check_mode else action
        specs = build_specs(request, host=host, operation=op, capture_id=capture_id, state_root=state_root,
                            python=python, weights=weights, validation=validation, unit_dirs=unit_dirs)
        running = {u["id"] for u in units}
        evidence = runtime.lifecycle([s for s in specs if s.unit["id"] in running])
        if check_mode:
            for e in evidence:  # what the real run refuses (a warm unit's sleep, mixed workers): so does check mode
                ec.require_step_states(e.get("unit"), action, [w.get("state") for w in e.get("workers", [])])
            would = any(_would_change(action, w.get("state")) for e in evidence for w in e.get("workers", []))
            return {"changed": would, "units": [*idle, *(public(e) for e in evidence)]}
        return {"changed": any(e.get("changed") for e in evidence), "units": [*idle, *(public(e) for e in evidence)],
                "coldsnap_timing": timing_of(evidence)}
