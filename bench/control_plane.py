"""The control plane's share of every verb: whole-operation time against the unit's own work.

Runs ``capture``, ``restore`` (twice: the first moves what the target lacks, the second finds
it there), ``sleep``, ``wake``, ``status`` and ``stop`` through ansible-runner and the collection's
playbooks with one CPU unit of the reference engine (runtime ``host``), and splits each receipt:

* whole operation: the receipt's ``duration_seconds`` (ansible-runner start to end);
* unit modules: the tasks that do the unit's own work (``unit_capture``, ``unit_restore``'s
  prepare, evict and activate, ``unit_lifecycle``, and the waits on their jobs);
* the rest: everything else (Ansible's start, facts, staging, commit, reports);
* module tasks: how many collection modules ran (each costs a Python start on the host).

``--hosts local`` runs on localhost (connection local). ``--hosts two`` captures on host A and
restores and drives the lifecycle on host B, two hosts on this machine reached over ssh (network
namespaces on a bridge, each with its own sshd and private state root:
tests/integration/multihost/netns_hosts.py); the first restore pulls the payload and the
capsule from host A, host to host.

Run as root after ``scripts/bootstrap.sh``:
``python bench/control_plane.py --hosts local --preset 1g`` and ``... --hosts two``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
UNIT_ACTIONS = {"coldsnap.fleet.unit_capture", "coldsnap.fleet.unit_restore", "coldsnap.fleet.unit_lifecycle"}
UNIT_JOB_WAITS = ("Capture the units on this host", "Restore the units on this host")
STATE_ROOT = Path("/var/lib/coldsnap-bench-control")
PORT = 18470


def unit_split(receipt: dict) -> dict:
    """Whole operation, the unit modules' share and the rest, from a receipt's task spans."""
    spans = [s for s in receipt["timing"]["spans"] if s.get("clock") == "controller" and s.get("parent_id")]
    unit = 0.0
    modules = 0
    for s in spans:
        action = (s.get("attrs") or {}).get("action") or ""
        if s.get("status") == "skipped" or not action:
            continue
        seconds = (s["end_ns"] - s["start_ns"]) / 1e9
        if action in UNIT_ACTIONS or (action == "coldsnap.fleet.job_wait" and s["name"].startswith(UNIT_JOB_WAITS)):
            unit += seconds
        if action.startswith("coldsnap.fleet."):
            modules += 1
    total = receipt["duration_seconds"]
    return {"operation_s": round(total, 2), "unit_modules_s": round(unit, 2), "rest_s": round(total - unit, 2),
            "module_tasks": modules}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", choices=["local", "two"], default="local")
    ap.add_argument("--preset", default="1g")
    ap.add_argument("--work", default="/tmp/coldsnap-bench-control")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    extra = [str(REPO / "src"), str(REPO / "runtime_image" / "integrations"),
             str(REPO / "tests" / "integration" / "multihost")]
    sys.path[:0] = extra  # this process only: the units run the venv's own packages, as on any host
    importlib.import_module("coldsnap")  # puts this checkout on the path as ansible_collections.coldsnap.fleet
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units import environment
    from coldsnap_engines.reference.config import PRESETS
    from coldsnap_engines.reference.weights import make_model

    from coldsnap.demo import reference_request
    from coldsnap.runner import operation_extravars, run_playbook

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(STATE_ROOT, ignore_errors=True)
    model_dir = work / f"model-{args.preset}"
    ident = make_model(model_dir, PRESETS[args.preset], model_id=f"coldsnap/reference-{args.preset}")
    env_digest = environment.of_python(sys.executable)  # as a host computes it (not this process's path)
    hosts = inventory = None
    capture_host = target = "localhost"
    if args.hosts == "two":
        from netns_hosts import NetnsHosts

        hosts = NetnsHosts(work / "netns", STATE_ROOT).up()
        inventory = hosts.inventory(sys.executable)
        capture_host, target = "hosta", "hostb"

    def request(op: str, host: str, **kw) -> dict:
        req = reference_request(operation=op, op_id=f"bench-cp-{op}-{time.strftime('%H%M%S')}", model_dir=model_dir,
                                model=ident, port=PORT, state_root=STATE_ROOT, env_digest=env_digest, **kw)
        req["launch"]["units"][0]["host"] = host
        req["workload"]["recipe"] = "bench-control-plane"
        return req

    def run(req: dict) -> dict:
        res = run_playbook(operation=req["operation"], request=req, playbook=None,
                           extravars=operation_extravars(req, state_root=STATE_ROOT),
                           inventory=json.loads(json.dumps(inventory)) if inventory else None,
                           state_root=STATE_ROOT)
        out = {"succeeded": res.succeeded, **unit_split(res.receipt)}
        if not res.succeeded:
            out["error"] = (res.receipt.get("error") or {}).get("message", "")[-1500:]
        return out

    result: dict = {"hosts": args.hosts, "preset": args.preset, "model_bytes": ident.get("bytes"), "verbs": {}}
    try:
        cap = run(request("capture", capture_host, artifact_dir=STATE_ROOT / "artifacts" / "bench-cp"))
        result["verbs"]["capture"] = cap
        artifact = STATE_ROOT / "artifacts" / "bench-cp" / "artifact.json"
        if cap["succeeded"]:
            for name, op in (("restore (first)", "restore"), ("restore", "restore"), ("sleep", "sleep"),
                             ("wake", "wake"), ("status", "status"), ("stop", "stop"),
                             ("status (stopped)", "status")):
                result["verbs"][name] = run(request(op, target, artifact=artifact))
    finally:
        if hosts is not None:
            hosts.down()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if all(v["succeeded"] for v in result["verbs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
