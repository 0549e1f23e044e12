"""The unit specs of an operation: what the activation runtime is told about each of this
host's launch units (:class:`~..formats.unit.UnitSpec`, the typed host -> unit contract).

The runtime that runs them (a host process or a rank container) is chosen in
:mod:`.runtime`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import FormatError, FormatIssue
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import StateLayout
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.drivers import SNAPSHOT_DRIVERS
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.engines import (
    engine_spec,
    normalize_restore_command,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import (
    split_environment,
    units_on_host,
    workers_of_unit,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import UnitSpec


def accepted_validation(request: dict, artifact: dict | None) -> dict | None:
    """The request's validation, checked against what the artifact accepted: its reply is the
    expected one unless the request names another, and its log-probabilities are compared where the
    reply is the accepted one."""
    val = request.get("validation")
    if val is None or artifact is None:
        return val
    acceptance = artifact["acceptance"]
    if not val.get("expected"):
        # The accepted reply answers the accepted prompt only: another prompt (or length) judged against it
        # would fail every restore after the eviction.
        changed = [f for f in ("prompt", "max_tokens") if val.get(f) != acceptance[f]]
        if changed:
            raise FormatError([FormatIssue(
                f"$.validation.{f}", f"{val.get(f)!r} is not the {f} the capture accepted ({acceptance[f]!r}), and "
                "no expected reply is given", f"restore with the captured {f}, or give validation.expected (the "
                f"reply this {f} must give)") for f in changed], document="request")
    expected = val.get("expected") or acceptance["reply"]
    out = {**val, "expected": expected}
    if expected == acceptance["reply"] and acceptance.get("logprobs"):
        out["expected_logprobs"] = acceptance["logprobs"]
    return out


def validation_for_unit(request: dict, validation: dict | None) -> dict | None:
    """What the unit's activation validates with: the served model's name, and the number of top
    log-probabilities resolved (the request's, else the engine's default)."""
    if validation is None:
        return None
    logprobs = validation.get("logprobs")
    if logprobs is None:
        logprobs = engine_spec(request["launch"]["engine"]).validation_logprobs
    return {**validation, "model": request["workload"].get("served_model_name", ""), "logprobs": logprobs}


def build_specs(request: dict, *, host: str, operation: str, capture_id: str, state_root: Path,
                python: str | None = None, coordinator_endpoint: str | None = None,
                weights: dict | None = None, validation: dict | None = None, unit_dirs: dict | None = None,
                warm: bool = False, supervise: bool = False, timeouts: dict | None = None,
                placements: dict | None = None, progress_dir: str | None = None) -> list[UnitSpec]:
    """One unit spec per unit of ``request`` placed on ``host``."""
    layout = StateLayout(state_root)
    launch = request["launch"]
    workers_all = launch["execution"]["workers"]
    services = {s["unit"]: s for s in launch["execution"]["services"]}
    specs = []
    for unit in units_on_host(request, host):
        ident_env, transport_env = split_environment(unit.get("environment", {}))
        svc = services.get(unit["id"])
        val = validation_for_unit(request, validation if validation is not None else request.get("validation"))
        specs.append(UnitSpec(**{
            "operation": operation, "operation_id": request["id"],
            "capture_id": capture_id, "host": host,
            # A restore never runs the captured command again (CRIU brings the process back), but a
            # re-exec (template restore) must use the engine's restore form, e.g. vLLM's coldsnap loader.
            "unit": {**unit, "environment": ident_env,
                     "command": (unit["command"] if operation == "capture"
                                 else normalize_restore_command(launch["engine"], unit["command"]))},
            "workers": [{"id": w["id"], "rank": w["rank"], "device_slot": w["device_slot"]}
                        for w in workers_of_unit(request, unit["id"])],
            "world_size": len(workers_all), "unit_count": len(launch["units"]),
            "state_root": str(state_root),
            "unit_dir": str((unit_dirs or {}).get(unit["id"]) or layout.capture_unit(capture_id, unit["id"])),
            "workload_dir": str(layout.workload(request["workload"]["recipe"], unit["id"])),
            "python": python or sys.executable,
            "model": {"id": launch["model"]["id"], "revision": launch["model"]["revision"]},
            "driver": {"id": request["snapshot_driver"]["id"],
                       "captures_cuda_state": SNAPSHOT_DRIVERS[request["snapshot_driver"]["id"]].captures_cuda_state,
                       "backend": request.get("policy", {}).get("process", {}).get("backend"),
                       "graph_policy": request.get("policy", {}).get("process", {}).get("graph_policy")},
            "service": ({"id": svc["id"], "port": svc["port"], "address": svc["address"],
                         "health_path": svc["health_path"]} if svc else None),
            "coordinator": {"endpoint_file": coordinator_endpoint} if coordinator_endpoint else None,
            "validation": val,
            "weights": weights or {"export_pack": request["policy"]["weights"]["native"]["export"]},
            "timeouts": timeouts or {},
            "transport_env": transport_env,
            "criu_binary": os.environ.get("COLDSNAP_CRIU"),
            "warm": warm,
            "t0_ns": None,
            "supervise": supervise,
            "launcher": engine_spec(launch["engine"]).launcher(),
            "placement": (placements or {}).get(unit["id"], {}),
            "progress_dir": str(progress_dir) if progress_dir else None,
        }))
    return specs
