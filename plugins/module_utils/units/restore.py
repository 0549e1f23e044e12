"""Per-host restore steps: ``prepare_restore`` decides, without touching the running workload,
whether this host can restore its units; ``evict`` stops the running workload (only after
prepare passed everywhere); ``restore_units`` activates the units from their captured state."""

from __future__ import annotations

from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import units_on_host
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import placement
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.evidence import public, timing_of
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.runtimes import runtime_for
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.specs import (
    accepted_validation,
    build_specs,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.weights import (
    plan_weights,
    read_packs_ahead,
)


def placements_of(request: dict, artifact: dict, host: str) -> dict[str, dict]:
    """How each unit of ``host`` moves its captured listeners (serving port and address are placement)."""
    return {u["id"]: placement.for_unit(artifact["launch"], request["launch"], u["id"]).to_json()
            for u in units_on_host(request, host)}


def prepare_restore(request: dict, artifact: dict, *, host: str, facts: dict, state_root: Path,
                    check_mode: bool, python: str | None = None, staging_failures: dict | None = None,
                    hub_token: str | None = None) -> dict:
    """Everything restore needs on this host, checked without touching the running workload."""
    runtime = runtime_for(request, host=host, state_root=state_root, python=python)
    plans, changed = runtime.prepare(artifact, facts=facts, check_mode=check_mode)
    # Host runtime: the captured state is on disk here (docker: inside the capsule image, checked in hydration).
    worker_dirs = {} if check_mode else {w["worker"]: p["unit_dir"] for p in plans if p.get("unit_dir")
                                         for w in artifact["weights"]["workers"] if w["unit"] == p["unit"]}
    # A Hugging Face recovery source is downloaded now, never after eviction (check mode downloads nothing).
    weights = plan_weights(request, artifact, host=host, state_root=state_root, staging_failures=staging_failures,
                           worker_dirs=worker_dirs, contact_hub=True, hub_token=hub_token, dry_run=check_mode) if plans else {}
    if weights and not check_mode:
        read_packs_ahead(weights)
    return {"changed": changed, "units": plans, "weights": weights}


def evict(request: dict, *, host: str, state_root: Path, check_mode: bool) -> dict:
    """Stop the running engines of this workload on this host (after prepare passed everywhere)."""
    stopped = runtime_for(request, host=host, state_root=state_root).evict(check_mode=check_mode)
    return {"changed": bool(stopped), "stopped": stopped}


def restore_units(request: dict, artifact: dict, *, host: str, state_root: Path, activation_digest: str,
                  coordinator_endpoint: str | None, python: str | None, warm: bool,
                  check_mode: bool, timeouts: dict | None = None, owner: dict | str | None = None,
                  progress_dir: str | None = None) -> dict:
    """Activate this host's units from their captured state (``progress_dir``: their live progress)."""
    units = units_on_host(request, host)
    if not units:
        return {"changed": False, "units": []}
    if check_mode:
        return {"changed": True, "units": [], "msg": f"would restore {len(units)} unit(s) on {host}"}
    runtime = runtime_for(request, host=host, state_root=state_root, activation_digest=activation_digest,
                          python=python, owner=owner)
    unit_dirs = {u["id"]: runtime.unit_dir(artifact, u["id"]) for u in units}
    specs = build_specs(request, host=host, operation="warm" if warm else "restore",
                        capture_id=artifact["capture_id"], state_root=state_root, python=python,
                        coordinator_endpoint=coordinator_endpoint,
                        weights=plan_weights(request, artifact, host=host, state_root=state_root),
                        validation=accepted_validation(request, artifact), unit_dirs=unit_dirs, warm=warm,
                        timeouts=timeouts, placements=placements_of(request, artifact, host),
                        progress_dir=progress_dir)
    evidence = runtime.restore(artifact, specs)
    return {"changed": True, "units": [public(e) for e in evidence], "coldsnap_timing": timing_of(evidence)}
