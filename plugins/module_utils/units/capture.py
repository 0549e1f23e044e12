"""Per-host capture steps: ``capture_units`` (start, validate and capture this host's units)
and ``capture_running_units`` (capture restored units in place, for a target-local overlay)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import rmtree_atomically
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.seconds import is_seconds
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import StateLayout
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import identifiers as ids
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import units_on_host
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import (
    EVIDENCE_FILE,
    check_timeouts,
    load_evidence,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.status import payload_state
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import ports
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import capture_state, host_facts
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.admission import admit_capture
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.claim import claimed
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.evidence import public, timing_of
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.runtimes import runtime_for
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.specs import (
    accepted_validation,
    build_specs,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.weights import plan_weights


def _existing(layout: StateLayout, capture_id: str, units: list[dict]) -> list[dict]:
    """Evidence of units already captured under ``capture_id`` (with their seal: a second run converges)."""
    out = []
    for u in units:
        udir = layout.capture_unit(capture_id, u["id"])
        if (udir / EVIDENCE_FILE).exists():
            if not (udir / capture_state.DIGESTS_FILE).exists():
                # Stopped between the unit's end and its seal: what is there was never sealed, so it cannot be
                # told from what changed since; it is not a capture to build on.
                raise ColdSnapError(f"capture {capture_id}: unit {u['id']} on this host finished but was never "
                                    f"sealed ({udir} holds no {capture_state.DIGESTS_FILE}; the capture was "
                                    "stopped between the two)",
                                    fix=f"remove {layout.capture(capture_id)} and capture again (or use a new "
                                        "operation id)")
            ev = load_evidence(udir / EVIDENCE_FILE)
            ev["state"] = capture_state.seal_of(udir)
            out.append(ev)
    return out


def _clear_attempts(layout: StateLayout, capture_id: str, units: list[dict]) -> None:
    """Take away what an earlier attempt under ``capture_id`` left in each unit's directory (a dump that failed
    half-way leaves images, logs and control files, and no evidence): the seal covers every file there, so a
    retry must start from an empty directory, or it would seal the failed attempt's files into the capture."""
    for u in units:
        udir = layout.capture_unit(capture_id, u["id"])
        if os.path.lexists(udir):
            rmtree_atomically(udir)


def _sealed(layout: StateLayout, capture_id: str, evidence: list[dict]) -> list[dict]:
    """Seal each unit's captured state (every file's size and digest) for the artifact to record."""
    for ev in evidence:
        ev["state"] = capture_state.seal(layout.capture_unit(capture_id, ev["unit"])).to_json()
    return evidence


def _require_service_ports_free(request: dict, units: list[dict]) -> None:
    """Capture starts each engine on its own serving ports: they must be free, or the engine would
    die on its bind half-way through (a running generation of the workload holds them, say)."""
    ids = {u["id"] for u in units}
    for svc in request["launch"]["execution"]["services"]:
        if svc["unit"] in ids:
            ports.require_ports_free(
                [(svc.get("address") or "0.0.0.0", svc["port"])], unit=svc["unit"], time_wait_grace=5.0,
                what=f"serving port of service {svc['id']!r}",
                fix="capture starts a fresh engine on this port and never stops what runs: stop the running "
                    "workload first (coldsnap.fleet.unit_lifecycle state=stopped), or capture onto a free port")


def capture_units(request: dict, *, host: str, capture_id: str, state_root: Path, activation_digest: str,
                  coordinator_endpoint: str | None, python: str | None, check_mode: bool,
                  timeouts: dict | None = None, owner: dict | str | None = None,
                  progress_dir: str | None = None, run_id: str | None = None) -> dict:
    """Capture every unit of ``request`` placed on ``host``; idempotent per capture id.

    ``progress_dir``: where the units write live progress (phases, export bytes)."""
    timeouts = check_timeouts(timeouts)
    ids.check_id(capture_id, what="capture_id")
    ids.parse_digest(activation_digest, what="activation_digest")
    layout = StateLayout(state_root)
    units = units_on_host(request, host)
    if not units:
        return {"changed": False, "units": [], "msg": f"no unit of this request is placed on {host}"}
    existing = _existing(layout, capture_id, units)
    if len(existing) == len(units):
        return {"changed": False, "units": [public(e) for e in existing], "coldsnap_timing": timing_of(existing),
                "msg": f"capture {capture_id} of {len(units)} unit(s) already complete on {host}"}
    if existing:
        raise ColdSnapError(f"capture {capture_id} is partially present on {host} "
                            f"({len(existing)} of {len(units)} units)",
                            fix=f"remove {layout.capture(capture_id)} or use a new operation id")
    # The snapshot driver's contract before anything starts or is dumped (also in check mode).
    nvidia = host_facts.gpus()[1] if any(u["devices"] for u in units) else None
    admit_capture(request, host=host, units=units, nvidia_driver=nvidia)
    runtime = runtime_for(request, host=host, state_root=state_root, activation_digest=activation_digest,
                          python=python, owner=owner)
    with claimed(state_root, request, host=host, step="capture", check_mode=check_mode, run=run_id):
        # What a real run refuses before anything starts, check mode refuses too (all of it only reads).
        runtime.check_environment(units)
        runtime.check_capture_free(units)
        _require_service_ports_free(request, units)
        if check_mode:
            return {"changed": True, "units": [], "msg": f"would capture {len(units)} unit(s) on {host}"}
        _clear_attempts(layout, capture_id, units)
        specs = build_specs(request, host=host, operation="capture", capture_id=capture_id, state_root=state_root,
                            python=python, coordinator_endpoint=coordinator_endpoint, timeouts=timeouts,
                            progress_dir=progress_dir)
        evidence = _sealed(layout, capture_id, runtime.capture(specs))
    return {"changed": True, "units": [public(e) for e in evidence], "coldsnap_timing": timing_of(evidence)}


def capture_running_units(request: dict, artifact: dict, *, host: str, capture_id: str, state_root: Path,
                          activation_digest: str, coordinator_endpoint: str | None, python: str | None,
                          check_mode: bool, payload_wait: float = 600.0, timeouts: dict | None = None,
                          run_id: str | None = None) -> dict:
    """Capture this host's running (restored) units in place, for a target-local overlay.

    Every worker's model payload must be in this host's node cache with a
    valid record first (an async materialization is waited for up to
    ``payload_wait`` seconds): the overlay shares the payload and the engine is
    resumed from it. Idempotent per capture id.
    """
    timeouts = check_timeouts(timeouts)
    ids.check_id(capture_id, what="capture_id")
    if not is_seconds(payload_wait, zero=True):
        raise ColdSnapError(f"payload_wait is {payload_wait!r}", fix="give a finite number of seconds >= 0")
    ids.parse_digest(activation_digest, what="activation_digest")
    layout = StateLayout(state_root)
    units = units_on_host(request, host)
    if not units:
        return {"changed": False, "units": [], "capture_id": capture_id,
                "msg": f"no unit of this request is placed on {host}"}
    runtime = runtime_for(request, host=host, state_root=state_root, activation_digest=activation_digest,
                          python=python)
    if not runtime.captures_in_place:
        runtime.capture_running([])  # raises: says why and what to do
    existing = _existing(layout, capture_id, units)
    if len(existing) == len(units):
        return {"changed": False, "units": [public(e) for e in existing], "coldsnap_timing": timing_of(existing),
                "capture_id": capture_id, "msg": f"overlay capture {capture_id} already complete on {host}"}
    if existing:
        raise ColdSnapError(f"overlay capture {capture_id} is partially present on {host}",
                            fix=f"remove {layout.capture(capture_id)} and capture the overlay again")
    host_units = {u["id"] for u in units}
    wanted = [w for w in artifact["weights"]["workers"] if w["unit"] in host_units]
    if any(w["payload"] is None for w in wanted):
        raise ColdSnapError("a target-local overlay shares the native model payload, but this capture has none",
                            fix="capture the portable artifact with policy.weights.native.export enabled")
    deadline = time.monotonic() + payload_wait
    while True:
        states = {w["worker"]: payload_state(state_root, w["payload"]["sha256"], w["payload"]["size"])
                  for w in wanted}
        if all(s == "verified" for s, _why in states.values()) or check_mode or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    if check_mode:
        return {"changed": True, "units": [], "capture_id": capture_id,
                "msg": f"would capture {len(units)} running unit(s) on {host}"}
    bad = {wid: f"{s} ({why})" for wid, (s, why) in states.items() if s != "verified"}
    if bad:
        raise ColdSnapError(f"the model payload is not materialized and verified on {host}: {bad}",
                            fix="restore with policy.weights.native.materialize 'required' (or 'async' and wait), "
                                "or stage the payload, before capturing an overlay")
    native_policy = {**request["policy"], "weights": {**request["policy"]["weights"], "mode": "native"}}
    plan = plan_weights({**request, "policy": native_policy}, artifact, host=host, state_root=state_root)
    validation = accepted_validation(request, artifact)
    specs = build_specs(request, host=host, operation="capture-running", capture_id=capture_id,
                        state_root=state_root, python=python, coordinator_endpoint=coordinator_endpoint,
                        weights=plan, validation=validation, timeouts=timeouts)
    with claimed(state_root, request, host=host, step="overlay-capture", run=run_id):
        _clear_attempts(layout, capture_id, units)
        evidence = _sealed(layout, capture_id, runtime.capture_running(specs))
    return {"changed": True, "units": [public(e) for e in evidence], "coldsnap_timing": timing_of(evidence),
            "capture_id": capture_id}
