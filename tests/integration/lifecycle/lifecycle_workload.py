"""Shared helpers of the lifecycle integration tests: the snapshot tests' Workload, plus playbook runs with
an explicit inventory, extra vars and reads of the workload log and store."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.status import payload_state

import coldsnap  # noqa: F401  # pylint: disable=unused-import
from coldsnap.runner import operation_extravars, playbook_for, run_playbook
from coldsnap.runner.inventory import local_host_vars

_SNAPSHOT_HARNESS = Path(__file__).resolve().parents[1] / "snapshot" / "snapshot_workload.py"
_spec = importlib.util.spec_from_file_location("coldsnap_snapshot_workload", _SNAPSHOT_HARNESS)
snapshot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(snapshot)
Workload = snapshot.Workload
units_of = snapshot.units_of


def run(wl: Workload, req: dict, *, extravars: dict | None = None, hosts: tuple[str, ...] | None = None,
        envvars: dict | None = None):
    """Run ``req``'s playbook; ``hosts`` are inventory names that all reach this machine locally."""
    inventory = None
    if hosts:
        inventory = {"all": {"children": {"coldsnap_units": {"hosts": {h: local_host_vars() for h in hosts}}}}}
    return run_playbook(operation=req["operation"], request=req, playbook=playbook_for(req["operation"]),
                        extravars={**(extravars or {}), **operation_extravars(req, state_root=wl.state_root)},
                        inventory=inventory, state_root=wl.state_root, envvars=envvars)


def ok(result) -> dict:
    assert result.succeeded, result.receipt["error"]
    return result.receipt


def result_of(receipt: dict) -> dict:
    return receipt["result"]["operation"]


def log_lines(wl: Workload, unit: str = "unit-0") -> list[str]:
    return (wl.state_root / "workloads" / wl.name / unit / "target.log").read_text().splitlines()


def boundary(wl: Workload, unit: str = "unit-0") -> dict:
    """The restore-boundary marker: the workload log's first line."""
    marker = json.loads(log_lines(wl, unit)[0])
    assert marker["coldsnap"] == "restore-boundary"
    return marker


def pack_of(art: dict, worker: str = "worker-0") -> dict:
    return next(w["payload"] for w in art["weights"]["workers"] if w["worker"] == worker)


def wait_payload(state_root: Path, pack: dict, want: str = "verified", timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while True:
        state, _unused = payload_state(state_root, pack["sha256"], pack["size"])
        if state == want or time.monotonic() > deadline:
            return state
        time.sleep(0.2)
