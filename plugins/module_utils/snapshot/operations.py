"""Per-host steps of each operation, called by the thin modules.

``capture_units`` runs the activation runtime for this host's units;
``prepare_restore`` decides, without touching the workload, whether this host can
restore its units (admission, capsule state, payloads, ports, pids);
``restore_units`` activates them; ``lifecycle_units`` sleeps/wakes/inspects them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import units_on_host
from ansible_collections.coldsnap.fleet.plugins.module_utils.snapshot import activation, docker_runtime, unit
from ansible_collections.coldsnap.fleet.plugins.module_utils.snapshot.admission import GpuMoves, admit_unit

EVIDENCE = "evidence.json"


def _timing(evidence: list[dict]) -> dict:
    spans, marks = [], []
    for ev in evidence:
        t = ev.get("timing") or {}
        spans.extend(t.get("spans", []))
        marks.extend(t.get("marks", []))
    return {"spans": spans, "marks": marks}


def _public(ev: dict) -> dict:
    """Evidence without bulky timing (returned separately as coldsnap_timing)."""
    return {k: v for k, v in ev.items() if k != "timing"}


def capture_units(request: dict, *, host: str, capture_id: str, state_root: Path, activation_digest: str,
                  coordinator_endpoint: str | None, python: str | None, check_mode: bool,
                  timeouts: dict | None = None, owner: dict | str | None = None) -> dict:
    """Capture every unit of ``request`` placed on ``host``; idempotent per capture id."""
    units = units_on_host(request, host)
    if not units:
        return {"changed": False, "units": [], "msg": f"no unit of this request is placed on {host}"}
    existing = []
    for u in units:
        p = unit.unit_dir(state_root, capture_id, u["id"]) / EVIDENCE
        if p.exists():
            existing.append(json.loads(p.read_text()))
    if len(existing) == len(units):
        return {"changed": False, "units": [_public(e) for e in existing], "coldsnap_timing": _timing(existing),
                "msg": f"capture {capture_id} of {len(units)} unit(s) already complete on {host}"}
    if existing:
        raise ColdSnapError(f"capture {capture_id} is partially present on {host} "
                            f"({len(existing)} of {len(units)} units)",
                            fix=f"remove {unit.capture_dir(state_root, capture_id)} or use a new operation id")
    if check_mode:
        return {"changed": True, "units": [], "msg": f"would capture {len(units)} unit(s) on {host}"}
    require_environment(request, units, host=host, python=python)
    adir = activation.require_staged(state_root, activation_digest)
    specs = unit.build_specs(request, host=host, operation="capture", capture_id=capture_id, state_root=state_root,
                             python=python, coordinator_endpoint=coordinator_endpoint, timeouts=timeouts)
    if docker_runtime.is_docker(request):  # the same specs, each run in its unit's rank container
        evidence = docker_runtime.run_capture(request, specs, state_root=Path(state_root),
                                              activation_digest=activation_digest,
                                              owner=docker_runtime.parse_owner(owner))
    else:
        evidence = unit.run_host_units(specs, activation_dir=adir, run_dir=Path(state_root) / "runs" / request["id"])
    return {"changed": True, "units": [_public(e) for e in evidence], "coldsnap_timing": _timing(evidence)}


def require_environment(request: dict, units: list[dict], *, host: str, python: str | None) -> None:
    """Runtime 'host': the unit's Python environment must be the pinned one."""
    import sys

    from ansible_collections.coldsnap.fleet.plugins.module_utils.snapshot import environment

    if request["launch"]["runtime"] != "host":
        return
    for u in units:
        environment.require(u["environment_digest"], python or sys.executable, unit=u["id"], host=host)


def restore_unit_dir(state_root: Path, artifact: dict, unit_id: str) -> Path:
    """Where this unit's captured state is on a restore host.

    The capture host still has its capture directory; elsewhere the capsule is
    extracted into a directory keyed by the capsule's digest.
    """
    cap = next(c for c in artifact["capsule"]["units"] if c["unit"] == unit_id)
    local = unit.unit_dir(state_root, artifact["capture_id"], unit_id)
    if (local / EVIDENCE).exists():
        return local
    return Path(state_root) / "capsules" / "extracted" / cap["image_id"].split(":", 1)[1]


def ensure_unit_state(state_root: Path, artifact: dict, unit_id: str, *, check_mode: bool) -> tuple[Path, bool]:
    """Make the unit's captured state available (extract its capsule when needed)."""
    path = restore_unit_dir(state_root, artifact, unit_id)
    if (path / EVIDENCE).exists():
        return path, False
    cap = next(c for c in artifact["capsule"]["units"] if c["unit"] == unit_id)
    if check_mode:
        return path, True
    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import build as capsule_build

    ref = capsule_build.CapsuleRef(unit=unit_id, layout=cap["layout"], image_id=cap["image_id"],
                                   location=cap["location"], bytes=cap["bytes"],
                                   repository_digest=cap.get("repository_digest"))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    capsule_build.extract_capsule(ref, tmp, replace=True)
    state = tmp
    if not (state / EVIDENCE).exists():
        raise ColdSnapError(f"capsule {cap['image_id']} of unit {unit_id} holds no captured state",
                            fix="recapture; the capsule is not a ColdSnap unit capsule")
    path.parent.mkdir(parents=True, exist_ok=True)
    os.rename(state, path)
    return path, True


def model_dir(request: dict) -> str | None:
    """Where the recovery provider reads the pinned safetensors on this host."""
    src = request["launch"]["model"]["source"]
    if src["kind"] == "local-safetensors":
        return src["path"]
    return None


def plan_weights(request: dict, artifact: dict, *, host: str, state_root: Path) -> dict:
    """Provider per worker of this host's units, as policy.weights.mode decides it."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import PackRef
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.provider import resolve_provider

    weights = request["policy"]["weights"]
    host_units = {u["id"] for u in units_on_host(request, host)}
    plan: dict = {"workers": {}, "model_dir": model_dir(request), "materialize": weights["native"]["materialize"]}
    providers = set()
    for w in artifact["weights"]["workers"]:
        if w["unit"] not in host_units:
            continue
        pl = w["payload"]
        ref = PackRef(sha256=pl["sha256"], size=pl["size"], path=pl["path"]) if pl else None
        res = resolve_provider(weights["mode"], state_root=state_root, pack=ref,
                               recovery_enabled=weights["recovery"]["enabled"])
        try:
            entry = {"provider": res.provider, "reasons": list(res.reasons), "pack": None}
            if res.provider == "native":
                entry["pack"] = {"path": str(NodeCache(state_root).path_for(pl["sha256"])), "sha256": pl["sha256"],
                                 "size": pl["size"]}
        finally:
            res.close()
        providers.add(res.provider)
        plan["workers"][w["worker"]] = entry
    plan["provider"] = providers.pop() if len(providers) == 1 else "mixed"
    if "recovery" in {e["provider"] for e in plan["workers"].values()} and not plan["model_dir"]:
        raise ColdSnapError("the recovery provider needs the pinned safetensors on the host, but the model source "
                            "is not a local directory", fix="stage the pinned snapshot and use a local-safetensors "
                            "source, or stage the native payload")
    return plan


def prepare_restore(request: dict, artifact: dict, *, host: str, facts: dict, state_root: Path,
                    check_mode: bool, python: str | None = None) -> dict:
    """Everything restore needs on this host, checked without touching the running workload."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.snapshot import ports

    if docker_runtime.is_docker(request):  # capsule images, container pid namespaces: see docker_runtime
        return docker_runtime.prepare(request, artifact, host=host, facts=facts, state_root=Path(state_root),
                                      check_mode=check_mode)
    units = units_on_host(request, host)
    captured_units = {u["id"]: u for u in artifact["launch"]["units"]}
    require_environment(artifact, [captured_units[u["id"]] for u in units], host=host, python=python)
    plans = []
    changed = False
    moves = GpuMoves(artifact, facts)
    for u in units:
        adm = admit_unit(artifact=artifact, unit_id=u["id"], facts=facts, devices=u["devices"], host=host)
        path, extracted = ensure_unit_state(state_root, artifact, u["id"], check_mode=check_mode)
        changed |= extracted
        if not check_mode:
            captured = json.loads((path / EVIDENCE).read_text())
            moves.add(u, captured, captured_units[u["id"]])
            running = _running_pid(state_root, request, u["id"])
            for w in captured["workers"]:
                # The workload being replaced is evicted later; its own ports/pids don't count.
                if running and running == w["pid"]:
                    continue
                ports.require_pids_free([w["pid"], *w["tids"]], unit=u["id"])
                if not running:
                    ports.require_ports_free([tuple(x) for x in w["listeners"]], unit=u["id"])
        plans.append({"unit": u["id"], "admission": adm, "unit_dir": str(path)})
    moves.admit(host)
    weights = plan_weights(request, artifact, host=host, state_root=state_root) if units else {}
    return {"changed": changed, "units": plans, "weights": weights}


def _running_pid(state_root: Path, request: dict, unit_id: str) -> int | None:
    """The pid of this workload's engine currently running on the host, if any.

    A pid alone proves nothing (it may have been reused): the engine must answer
    on its loopback control API with the token from its 0600 control file.
    """
    wdir = unit.workload_dir(state_root, request["workload"]["recipe"], unit_id)
    for f in wdir.glob("control-*.json"):
        try:
            info = json.loads(f.read_text())
            if engine_answers(info):
                return int(info["pid"])
        except (OSError, ValueError, KeyError):
            continue
    return None


def engine_answers(control: dict, timeout: float = 5.0) -> bool:
    """True when the process behind ``control`` (port, token, pid) is our engine and alive."""
    import http.client

    from ansible_collections.coldsnap.fleet.plugins.module_utils.snapshot.ports import engine_request

    try:
        os.kill(int(control["pid"]), 0)
    except (OSError, ValueError, KeyError):
        return False
    try:
        with engine_request("127.0.0.1", int(control["port"]), "GET", "/status", timeout=timeout,
                            headers={"Authorization": f"Bearer {control['token']}"}) as resp:
            body = json.loads(resp.read() or b"{}")
        return resp.status == 200 and int(body.get("pid", -1)) == int(control["pid"])
    except (OSError, ValueError, http.client.HTTPException):
        return False


def evict(request: dict, *, host: str, state_root: Path, check_mode: bool) -> dict:
    """Stop the running engines of this workload on this host (after prepare passed everywhere)."""
    import signal
    import time

    if docker_runtime.is_docker(request):  # never signal a host pid read from a container's control file
        return docker_runtime.evict(request, host=host, check_mode=check_mode)
    stopped = []
    for u in units_on_host(request, host):
        pid = _running_pid(state_root, request, u["id"])
        if pid is None:
            continue
        stopped.append({"unit": u["id"], "pid": pid})
        if check_mode:
            continue
        os.kill(pid, signal.SIGKILL)
        # Wait until the pid is gone, not just dead: the restore needs it free again.
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists():
            if time.monotonic() > deadline:
                raise ColdSnapError(f"unit {u['id']}: engine pid {pid} was killed but not reaped within 30 s",
                                    fix="its parent does not reap children; restart the unit's keeper or host init")
            time.sleep(0.02)
    return {"changed": bool(stopped), "stopped": stopped}


def restore_units(request: dict, artifact: dict, *, host: str, state_root: Path, activation_digest: str,
                  coordinator_endpoint: str | None, python: str | None, warm: bool,
                  check_mode: bool, timeouts: dict | None = None, owner: dict | str | None = None) -> dict:
    """Activate this host's units from their captured state."""
    units = units_on_host(request, host)
    if not units:
        return {"changed": False, "units": []}
    if check_mode:
        return {"changed": True, "units": [], "msg": f"would restore {len(units)} unit(s) on {host}"}
    adir = activation.require_staged(state_root, activation_digest)
    unit_dirs = {u["id"]: restore_unit_dir(state_root, artifact, u["id"]) for u in units}
    weights = plan_weights(request, artifact, host=host, state_root=state_root)
    validation = {**request["validation"], "expected": request["validation"].get("expected")
                  or artifact["acceptance"]["reply"]}
    specs = unit.build_specs(request, host=host, operation="warm" if warm else "restore",
                             capture_id=artifact["capture_id"], state_root=state_root, python=python,
                             coordinator_endpoint=coordinator_endpoint, weights=weights, validation=validation,
                             unit_dirs=unit_dirs, warm=warm, timeouts=timeouts)
    for s in specs:
        s["operation"] = "restore" if not warm else "warm"
    if docker_runtime.is_docker(request):  # a fresh container per unit from its capsule image
        evidence = docker_runtime.run_restore(request, artifact, specs, state_root=Path(state_root),
                                              activation_digest=activation_digest,
                                              owner=docker_runtime.parse_owner(owner))
    else:
        evidence = unit.run_host_units(specs, activation_dir=adir, run_dir=Path(state_root) / "runs" / request["id"])
    return {"changed": True, "units": [_public(e) for e in evidence], "coldsnap_timing": _timing(evidence)}


def lifecycle_units(request: dict, artifact: dict | None, *, host: str, action: str, state_root: Path,
                    activation_digest: str, python: str | None, check_mode: bool) -> dict:
    """status / sleep / wake / finish-warm of this host's running units (convergent)."""
    units = units_on_host(request, host)
    if not units:
        return {"changed": False, "units": []}
    adir = activation.require_staged(state_root, activation_digest)
    capture_id = artifact["capture_id"] if artifact else request["id"]
    unit_dirs = ({u["id"]: restore_unit_dir(state_root, artifact, u["id"]) for u in units} if artifact else None)
    weights = plan_weights(request, artifact, host=host, state_root=state_root) if artifact else {}
    validation = request.get("validation")
    if validation and artifact:
        validation = {**validation, "expected": validation.get("expected") or artifact["acceptance"]["reply"]}
    op = "status" if check_mode else action
    specs = unit.build_specs(request, host=host, operation=op, capture_id=capture_id, state_root=state_root,
                             python=python, weights=weights, validation=validation, unit_dirs=unit_dirs)
    if docker_runtime.is_docker(request):  # inside each unit's running container
        evidence = docker_runtime.exec_units(request, specs, owner=None)
    else:
        evidence = unit.run_host_units(specs, activation_dir=adir, run_dir=Path(state_root) / "runs" / request["id"])
    if check_mode:
        would = any(_would_change(action, w.get("state")) for e in evidence for w in e.get("workers", []))
        return {"changed": would, "units": [_public(e) for e in evidence]}
    return {"changed": any(e.get("changed") for e in evidence), "units": [_public(e) for e in evidence],
            "coldsnap_timing": _timing(evidence)}


def _would_change(action: str, state: str | None) -> bool:
    return (action == "sleep" and state == "ready") or (action in ("wake", "finish-warm")
                                                        and state in ("sleeping", "warm"))


# ---------------------------------------------------------------- target-local overlay (lifecycle)

def capture_running_units(request: dict, artifact: dict, *, host: str, capture_id: str, state_root: Path,
                          activation_digest: str, coordinator_endpoint: str | None, python: str | None,
                          check_mode: bool, payload_wait: float = 600.0, timeouts: dict | None = None) -> dict:
    """Capture this host's running (restored) units in place, for a target-local overlay.

    Every worker's model payload must be in this host's node cache with a
    valid record first (an async materialization is waited for up to
    ``payload_wait`` seconds): the overlay shares the payload and the engine is
    resumed from it. Idempotent per capture id.
    """
    import time

    from ansible_collections.coldsnap.fleet.plugins.module_utils.snapshot.native import payload_state

    units = units_on_host(request, host)
    if not units:
        return {"changed": False, "units": [], "capture_id": capture_id,
                "msg": f"no unit of this request is placed on {host}"}
    if docker_runtime.is_docker(request):
        raise ColdSnapError("target-local overlays are captured from runtime 'host' units only: a docker unit's "
                            "running rank container has no writable capture directory for an in-place dump",
                            fix="restore without -e coldsnap_capture_overlay (the portable artifact is used)")
    existing = [json.loads(p.read_text()) for u in units
                if (p := unit.unit_dir(state_root, capture_id, u["id"]) / EVIDENCE).exists()]
    if len(existing) == len(units):
        return {"changed": False, "units": [_public(e) for e in existing], "coldsnap_timing": _timing(existing),
                "capture_id": capture_id, "msg": f"overlay capture {capture_id} already complete on {host}"}
    if existing:
        raise ColdSnapError(f"overlay capture {capture_id} is partially present on {host}",
                            fix=f"remove {unit.capture_dir(state_root, capture_id)} and capture the overlay again")
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
    adir = activation.require_staged(state_root, activation_digest)
    validation = {**request["validation"], "expected": request["validation"].get("expected")
                  or artifact["acceptance"]["reply"]}
    specs = unit.build_specs(request, host=host, operation="capture-running", capture_id=capture_id,
                             state_root=state_root, python=python, coordinator_endpoint=coordinator_endpoint,
                             weights=plan, validation=validation, timeouts=timeouts)
    evidence = unit.run_host_units(specs, activation_dir=adir, run_dir=Path(state_root) / "runs" / request["id"])
    return {"changed": True, "units": [_public(e) for e in evidence], "coldsnap_timing": _timing(evidence),
            "capture_id": capture_id}
