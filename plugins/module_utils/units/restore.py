"""Per-host restore steps: ``prepare_restore`` decides, without touching the running workload,
whether this host can restore its units; ``evict`` stops the running workload (only after
prepare passed everywhere); ``restore_units`` activates the units from their captured state.

A failure of ``restore_units`` comes after the eviction: its error says what was evicted (the units
and pids ``evict`` reported) and that it is not running, once, with how to serve again."""

from __future__ import annotations

from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import eviction
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.identifiers import parse_digest
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import units_on_host
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import check_timeouts
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import placement
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.claim import claimed, release_handover
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.evidence import public, timing_of
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.runtimes import runtime_for
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.specs import (
    accepted_validation,
    build_specs,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.weights import (
    plan_weights,
    read_packs_ahead,
    require_materialize_space,
)


def placements_of(request: dict, artifact: dict, host: str) -> dict[str, dict]:
    """How each unit of ``host`` moves its captured listeners (serving port and address are placement)."""
    return {u["id"]: placement.for_unit(artifact["launch"], request["launch"], u["id"]).to_json()
            for u in units_on_host(request, host)}


def prepare_restore(request: dict, artifact: dict, *, host: str, facts: dict, state_root: Path,
                    check_mode: bool, python: str | None = None, staging_failures: dict | None = None,
                    hub_token: str | None = None, run_id: str | None = None) -> dict:
    """Everything restore needs on this host, checked without touching the running workload (while this
    host's claim on the workload is held: another operation's step running here is refused, naming it)."""
    with claimed(state_root, request, host=host, step="prepare", check_mode=check_mode, run=run_id):
        return _prepare(request, artifact, host=host, facts=facts, state_root=state_root, check_mode=check_mode,
                        python=python, staging_failures=staging_failures, hub_token=hub_token)


def _prepare(request: dict, artifact: dict, *, host: str, facts: dict, state_root: Path, check_mode: bool,
             python: str | None, staging_failures: dict | None, hub_token: str | None) -> dict:
    runtime = runtime_for(request, host=host, state_root=state_root, python=python)
    plans, changed = runtime.prepare(artifact, facts=facts, check_mode=check_mode)
    # Host runtime: the captured state is on disk here (docker: inside the capsule image, checked in hydration).
    worker_dirs = {} if check_mode else {w["worker"]: p["unit_dir"] for p in plans if p.get("unit_dir")
                                         for w in artifact["weights"]["workers"] if w["unit"] == p["unit"]}
    # A Hugging Face recovery source is downloaded now, never after eviction (check mode downloads nothing).
    weights = plan_weights(request, artifact, host=host, state_root=state_root, staging_failures=staging_failures,
                           worker_dirs=worker_dirs, contact_hub=True, hub_token=hub_token, dry_run=check_mode) if plans else {}
    if weights:
        require_materialize_space(weights, artifact, state_root=state_root)
    if weights and not check_mode:
        read_packs_ahead(weights)
    return {"changed": changed, "units": plans, "weights": weights}


def evict(request: dict, artifact: dict, *, host: str, state_root: Path, check_mode: bool,
          run_id: str | None = None) -> dict:
    """Stop the running engines of this workload on this host (after prepare passed everywhere).

    Prepare found the captured pids and ports free, maybe minutes ago; one a stranger took since would
    fail the restore after the kill, so they are checked again right before it, and a refusal evicts
    nothing. The result names what was stopped under ``coldsnap_evicted`` too (the controller's record
    of the eviction); a failure part way says the step may have stopped some of them. The host's claim on
    the workload is handed over to this restore's activate step (``units/claim.py``)."""
    with claimed(state_root, request, host=host, step="evict", check_mode=check_mode, run=run_id) as claim:
        runtime = runtime_for(request, host=host, state_root=state_root)
        runtime.require_restorable(artifact, check_mode=check_mode)
        try:
            stopped = runtime.evict(check_mode=check_mode)
        except ColdSnapError as exc:
            raise _same_kind(exc)(f"{exc.problem} (the evict step failed part way: the workload that ran before may "
                                  "be stopped in part; `coldsnap status` shows what runs)", fix=exc.fix,
                                  details={**exc.details, eviction.RESULT_EVICTED_KEY: {"host": host, "units": None}}) \
                from exc
        claim.hand_over()
    out = {"changed": bool(stopped), "stopped": stopped}
    if not check_mode:
        out[eviction.RESULT_EVICTED_KEY] = {"host": host, "units": stopped}
    return out


def restore_units(request: dict, artifact: dict, *, host: str, state_root: Path, activation_digest: str,
                  coordinator_endpoint: str | None, python: str | None, warm: bool,
                  check_mode: bool, timeouts: dict | None = None, owner: dict | str | None = None,
                  progress_dir: str | None = None, evicted: list[dict] | None = None,
                  run_id: str | None = None) -> dict:
    """Activate this host's units from their captured state (``progress_dir``: their live progress).

    ``evicted``: what the evict step stopped on this host (its ``stopped``; None when not known). A
    failure then says that this workload is not running any more, naming it, and how to serve again."""
    timeouts = check_timeouts(timeouts)
    parse_digest(activation_digest, what="activation_digest")  # what the real run refuses, check mode too
    units = units_on_host(request, host)
    if not units:
        return {"changed": False, "units": []}
    if check_mode:
        return {"changed": True, "units": [], "msg": f"would restore {len(units)} unit(s) on {host}"}
    try:
        with claimed(state_root, request, host=host, step="activate", run=run_id):
            return _activate(request, artifact, units, host=host, state_root=state_root,
                             activation_digest=activation_digest, coordinator_endpoint=coordinator_endpoint,
                             python=python, warm=warm, timeouts=timeouts, owner=owner, progress_dir=progress_dir)
    except Exception as exc:
        if not evicted:
            raise
        raise failed_after_eviction(exc, evicted, host=host) from exc


def _activate(request: dict, artifact: dict, units: list[dict], *, host: str, state_root: Path,
              activation_digest: str, coordinator_endpoint: str | None, python: str | None, warm: bool,
              timeouts: dict | None, owner: dict | str | None, progress_dir: str | None) -> dict:
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
    return {"changed": True, "units": [public(e) for e in evidence], "coldsnap_timing": timing_of(evidence),
            eviction.RESULT_EVICTED_KEY: {"host": host, "restored": True}}


def release(request: dict, *, host: str, state_root: Path, run_id: str | None = None,
            check_mode: bool = False) -> dict:
    """Hand the workload back on this host when this restore's evict step handed it to an activate step that
    never ran (the restore stopped in between: another host failed); see ``units/claim.py``."""
    released = release_handover(state_root, request, host=host, run=run_id, check_mode=check_mode)
    return {"changed": released, "released": released}


def failed_after_eviction(exc: Exception, evicted: list[dict], *, host: str) -> ColdSnapError:
    """``exc`` (an activation's failure) as the error of a restore that evicted ``evicted`` first: the
    same class, problem and details, saying once that the workload that ran before is not running and
    how to serve again (the problem's own fix kept first)."""
    if isinstance(exc, ColdSnapError):
        problem = exc.problem if not exc.fix else f"{exc.problem}; {exc.fix}"
        cls, details = _same_kind(exc), exc.details
    else:  # unexpected: still said with what was evicted (its traceback is the cause's)
        problem, cls, details = f"unit_restore failed unexpectedly: {type(exc).__name__}: {exc}", ColdSnapError, {}
    if eviction.EVICTED_PHRASE in problem and isinstance(exc, ColdSnapError):
        return exc
    return cls(eviction.after_eviction(problem, evicted, host=host),
               details={**details, "previous_workload": eviction.EVICTED, "evicted": evicted})


def _same_kind(exc: ColdSnapError) -> type[ColdSnapError]:
    """``exc``'s class when it is built like ColdSnapError (message, fix, details), else ColdSnapError."""
    return type(exc) if type(exc).__init__ is ColdSnapError.__init__ else ColdSnapError
