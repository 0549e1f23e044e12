"""What a restore did to the workload that ran before it: the words a failure uses, and the receipt's record.

A restore evicts the running workload only after prepare passed on every host. A failure before that
leaves it as it was; a failure after it (CRIU restore, the restored engine dying, hydration, validation)
leaves the host without it. The failure then says so once, naming what was evicted and how to serve
again (:func:`after_eviction`), and the receipt records it under ``result.eviction``
(:func:`receipt_record`).

The evict step returns what it stopped under :data:`RESULT_EVICTED_KEY` (``{"host", "units"}``;
``units`` is null when the step failed part way: what was stopped is not known); the controller
collects it from every host.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# The operations that evict the running workload (after prepare passed on every host).
RESTORE_OPERATIONS = ("restore", "warm")

# The module result key of the evict step (the controller reads it from every host's result).
RESULT_EVICTED_KEY = "coldsnap_evicted"

# result.eviction.previous_workload: what became of the workload that ran before the restore.
UNTOUCHED = "untouched"  # the restore failed before the evict step: whatever ran before still runs
NONE_RUNNING = "none-running"  # the evict step ran and found nothing of the workload running
REPLACED = "replaced"  # it was evicted and the restore succeeded: the restored workload runs in its place
EVICTED = "evicted"  # it was evicted and the restore failed after that: it is not running
UNKNOWN = "unknown"  # the evict step failed or was cut off part way: see `coldsnap status`
ROLLED_BACK = "rolled-back"  # evicted, the restore failed, and the controller's rollback restored it again
PREVIOUS_WORKLOAD_STATES = (UNTOUCHED, NONE_RUNNING, REPLACED, EVICTED, UNKNOWN, ROLLED_BACK)

# The operation id of the rollback of a restore that failed after eviction (the controller's; the host's
# claim on the workload, handed to the failed restore's activation, passes on to it).
ROLLBACK_SUFFIX = "-rollback"
# ... and of the controller's run that gives that hand-over back when no rollback follows (a cancelled restore)
RELEASE_SUFFIX = "-release"

# Said once in a failure after eviction; a message that holds it is not told again.
EVICTED_PHRASE = "was evicted and is not running"
UNTOUCHED_PHRASE = "nothing was evicted"
SERVE_AGAIN = ("to serve again, fix the cause (below) and restore again (the same request), restore another "
               "generation (an earlier artifact of the workload), or restore in recovery mode "
               "(policy.weights.mode: recovery, from the pinned safetensors); `coldsnap status` shows what runs, "
               "and the evicted engine's log is kept as target.log.previous in the unit's workload directory")


def describe(stopped: Sequence[Mapping[str, Any]]) -> str:
    """``unit unit-0 (engine pids 4242, 4243)``, ``unit unit-0 (container cs-...)``: what the evict step
    stopped, one entry per unit (``host``, when an entry names it, is said too)."""
    parts = []
    for s in stopped:
        pids = s.get("pids") or ([s["pid"]] if s.get("pid") is not None else [])
        if pids:
            what = f"engine pid{'s' if len(pids) > 1 else ''} {', '.join(map(str, pids))}"
        elif s.get("container"):
            what = f"container {s['container']}"
        else:
            what = "its engines"
        where = f" on {s['host']}" if s.get("host") else ""
        parts.append(f"unit {s.get('unit')}{where} ({what})")
    return "; ".join(parts)


def evicted_note(stopped: Sequence[Mapping[str, Any]], *, host: str | None = None) -> str:
    """The sentence a failure after eviction leads with: what ran before, that it is gone, how to serve again."""
    where = f" on {host}" if host else ""
    return (f"restore failed after eviction: the workload that ran before{where} {EVICTED_PHRASE}: "
            f"{describe(stopped)}; {SERVE_AGAIN}")


def after_eviction(problem: str, stopped: Sequence[Mapping[str, Any]] | None, *, host: str | None = None) -> str:
    """``problem`` (a failure of the restore) led by the eviction, said once (first, so that a message cut
    short still says it): unchanged when nothing was evicted (``stopped`` empty or unknown) or when it says
    so already."""
    if not stopped or EVICTED_PHRASE in problem:
        return problem
    return f"{evicted_note(stopped, host=host)}. The cause: {problem}"


def rollback_id(operation_id: str) -> str:
    """The operation id of ``operation_id``'s rollback."""
    return f"{operation_id}{ROLLBACK_SUFFIX}"


def release_id(operation_id: str) -> str:
    """The operation id of the controller's run that gives back ``operation_id``'s unused hand-over."""
    return f"{operation_id}{RELEASE_SUFFIX}"


def succeeds(holder_id: str, operation_id: str) -> bool:
    """True when ``operation_id`` is ``holder_id`` itself or its rollback."""
    return operation_id in (holder_id, rollback_id(holder_id))


ROLLED_BACK_PHRASE = "the workload that ran before was restored again"


def rolled_back(message: str, *, rollback_id: str, captures: Sequence[str]) -> str:
    """A failure after eviction whose rollback succeeded: said first that the workload serves as before,
    then the cause (the eviction's sentence, which says it is not running, is dropped)."""
    cause = message.split(". The cause: ", 1)[1] if ". The cause: " in message else message
    of = f" (capture {', '.join(captures)})" if captures else ""
    return (f"restore failed after eviction and was rolled back: {ROLLED_BACK_PHRASE}{of} by restore {rollback_id} "
            f"and serves. The cause: {cause}")


def before_eviction(problem: str) -> str:
    """``problem`` (a restore that failed before its evict step) saying that nothing was evicted, once."""
    if UNTOUCHED_PHRASE in problem.lower():
        return problem
    return (f"{problem.rstrip().rstrip('.;')} (the restore stopped before its evict step: {UNTOUCHED_PHRASE}, "
            "the workload that ran before, if any, runs as it did)")


def receipt_record(reports: Mapping[str, Any], *, succeeded: bool, interrupted: bool) -> dict:
    """``result.eviction`` of a restore's receipt from what the hosts reported under
    :data:`RESULT_EVICTED_KEY` (``{host: {"units": [...] or None, "restored": bool}}``: the evict step gives
    ``units``, a successful activation ``restored``); ``interrupted``: the run was cut off while its evict
    step may have been running.

    ``{"previous_workload": one of PREVIOUS_WORKLOAD_STATES, "evicted": true, false or null (not known),
    "hosts": the hosts whose evict step ran, "units": [{"host", "unit", "pids" | "container", ...,
    "restored"}]}``: ``restored`` says whether the restore brought that host's units back."""
    units: list[dict] = []
    unknown = False
    for host in sorted(reports):
        report = reports[host] if isinstance(reports[host], Mapping) else {}
        stopped = report.get("units")
        if stopped is None:
            unknown = unknown or not report.get("restored")
            continue
        restored = bool(report.get("restored")) or succeeded
        units.extend({"host": host, **dict(s), "restored": restored} for s in stopped if isinstance(s, Mapping))
    if any(not u["restored"] for u in units):
        state = EVICTED
    elif units:
        state = REPLACED
    elif unknown or (interrupted and not reports):
        state = UNKNOWN
    else:
        state = NONE_RUNNING if reports else UNTOUCHED
    evicted = {UNTOUCHED: False, NONE_RUNNING: False, REPLACED: True, EVICTED: True, UNKNOWN: None}[state]
    return {"previous_workload": state, "evicted": evicted, "hosts": sorted(reports), "units": units}
