"""Host side of a unit operation: turn the request into unit specs for the units on
this host, run the activation runtime for each (concurrently), collect evidence.

Runtime ``host``: the runtime runs as a process with the host's Python.
Runtime ``docker``: it runs inside the unit's rank container (see capsule.docker_unit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import UnitError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import atomic_write_json
from ansible_collections.coldsnap.fleet.plugins.module_utils.engines import normalize_restore_command
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.drivers import SNAPSHOT_DRIVERS
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import (
    units_on_host,
    workers_of_unit,
)

SPEC_KIND = "coldsnap-unit-spec"
TRANSPORT_PREFIXES = ("NCCL_", "GLOO_", "MASTER_", "UCX_", "TP_SOCKET_IFNAME")


def capture_dir(state_root: Path, capture_id: str) -> Path:
    return Path(state_root) / "captures" / capture_id


def unit_dir(state_root: Path, capture_id: str, unit_id: str) -> Path:
    return capture_dir(state_root, capture_id) / "units" / unit_id


def workload_dir(state_root: Path, recipe: str, unit_id: str) -> Path:
    """Canonical per-workload directory: target.log and the engine control files."""
    return Path(state_root) / "workloads" / recipe / unit_id


def split_environment(env: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(identity env, transport env): transport variables are placement and may change."""
    ident = {k: v for k, v in env.items() if not k.startswith(TRANSPORT_PREFIXES)}
    transport = {k: v for k, v in env.items() if k.startswith(TRANSPORT_PREFIXES)}
    return ident, transport


def build_specs(request: dict, *, host: str, operation: str, capture_id: str, state_root: Path,
                python: str | None = None, coordinator_endpoint: str | None = None,
                weights: dict | None = None, validation: dict | None = None, unit_dirs: dict | None = None,
                warm: bool = False, supervise: bool = False, timeouts: dict | None = None) -> list[dict]:
    """One unit spec per unit of ``request`` placed on ``host``."""
    launch = request["launch"]
    workers_all = launch["execution"]["workers"]
    services = {s["unit"]: s for s in launch["execution"]["services"]}
    specs = []
    for unit in units_on_host(request, host):
        ident_env, transport_env = split_environment(unit.get("environment", {}))
        svc = services.get(unit["id"])
        val = validation if validation is not None else request.get("validation")
        if val is not None:
            val = {**val, "model": request["workload"].get("served_model_name", "")}
        specs.append({
            "format": 1, "kind": SPEC_KIND, "operation": operation, "operation_id": request["id"],
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
            "unit_dir": str((unit_dirs or {}).get(unit["id"]) or unit_dir(state_root, capture_id, unit["id"])),
            "workload_dir": str(workload_dir(state_root, request["workload"]["recipe"], unit["id"])),
            "python": python or sys.executable,
            "model": {"id": launch["model"]["id"], "revision": launch["model"]["revision"]},
            "driver": {"id": request["snapshot_driver"]["id"],
                       "captures_cuda_state": SNAPSHOT_DRIVERS[request["snapshot_driver"]["id"]].captures_cuda_state},
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
        })
    return specs


def run_concurrently(target, arg_tuples: list[tuple]) -> None:
    """Call ``target(*args)`` for every tuple at once (one thread each) and wait for all of them.

    The units of one activation meet at coordinator phases, so they must run side by side;
    ``target`` records its own result or failure.
    """
    threads = [threading.Thread(target=target, args=args) for args in arg_tuples]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_host_units(specs: list[dict], *, activation_dir: Path, run_dir: Path, timeout: float = 3600) -> list[dict]:
    """Run the activation runtime for every spec at once; return their evidence in order.

    All units are started before any is awaited (units of one activation meet at
    coordinator phases). The first failure's message is raised with every unit's.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    procs = []
    for base_spec in specs:
        uid = base_spec["unit"]["id"]
        spec = {**base_spec, "t0_ns": time.monotonic_ns()}
        spec_path = run_dir / f"spec-{spec['operation']}-{uid}.json"
        ev_path = run_dir / f"evidence-{spec['operation']}-{uid}.json"
        ev_path.unlink(missing_ok=True)
        atomic_write_json(spec_path, spec, mode=0o600)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(activation_dir)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
        log = open(run_dir / f"activation-{spec['operation']}-{uid}.log", "ab")
        p = subprocess.Popen([spec["python"], "-m", "coldsnap_activation", spec["operation"], "--spec", str(spec_path),
                              "--evidence", str(ev_path)], stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                             cwd="/")
        procs.append((uid, p, ev_path, log))
    results: list[dict] = [{} for _proc in procs]

    def wait(i: int, uid: str, p: subprocess.Popen, ev_path: Path, log) -> None:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()
        try:
            results[i] = json.loads(ev_path.read_text())
        except (OSError, ValueError):
            tail = (run_dir / f"activation-{specs[i]['operation']}-{uid}.log").read_text(errors="replace")[-2000:]
            results[i] = {"ok": False, "unit": uid, "error": f"activation runtime exited {p.returncode} without "
                          f"evidence; its output:\n{tail}"}

    run_concurrently(wait, [(i, *x) for i, x in enumerate(procs)])
    failed = [r for r in results if not r.get("ok")]
    if failed:
        # Prefer the root cause over "stopped because another unit failed".
        failed.sort(key=lambda r: "another unit failed" in r.get("error", ""))
        msg = "; ".join(f"unit {r.get('unit')}: {r.get('error')}" for r in failed)
        raise UnitError(msg, details={"evidence": results})
    return results
