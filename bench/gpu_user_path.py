"""The user's path on a GPU host: ``coldsnap capture``, ``restore``, ``sleep``, ``wake``, ``status`` and
``stop`` through the CLI, ansible-runner and the collection's playbooks, with a GPU unit of the
reference engine (runtime ``host``, snapshot driver n610: CUDA checkpoint + CRIU).

Run as root on the GPU host from a checkout, with ansible-core and ansible-runner importable (a
venv with ``--system-site-packages`` over the host's torch and cuda-python, the wheels installed
offline) and CRIU on PATH. Prints one JSON document: per verb the receipt's state and
whole-operation time, and for capture and restore the unit's readiness figures, so the control
plane's share is visible beside restore-to-first-token.

Usage: ``python bench/gpu_user_path.py --preset 1g-bf16 [--work /tmp/coldsnap-gpu-user]``.
``--device cpu`` runs the same verbs with a CPU unit (the README's main job's request, preset
``1g`` by default) on any machine, e.g. ``python bench/gpu_user_path.py --device cpu --preset 1g``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from control_plane import unit_split  # noqa: E402


def collection_on_path() -> None:
    """This checkout as ``ansible_collections.coldsnap.fleet`` for the controller, Ansible and the units."""
    coll = Path(tempfile.mkdtemp(prefix="coldsnap-coll-"))
    (coll / "ansible_collections" / "coldsnap").mkdir(parents=True)
    (coll / "ansible_collections" / "coldsnap" / "fleet").symlink_to(REPO)
    extra = [str(coll), str(REPO / "src"), str(REPO / "runtime_image" / "integrations")]
    sys.path[:0] = extra
    os.environ["PYTHONPATH"] = os.pathsep.join([*extra, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    os.environ["ANSIBLE_COLLECTIONS_PATH"] = str(coll)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default=None, help="model preset (default 1g-bf16 on cuda, 1g on cpu)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--work", default="/tmp/coldsnap-gpu-user")
    ap.add_argument("--port", type=int, default=18260)
    ap.add_argument("--out", default=None)
    ap.add_argument("--moved-port", type=int, default=0,
                    help="finally restore onto this port while a stranger holds the captured one")
    ap.add_argument("--choose-driver", action="store_true",
                    help="leave snapshot_driver out: the controller chooses it from the host's facts")
    ap.add_argument("--driver", choices=("n610", "n580"), default="n610",
                    help="the snapshot driver the GPU requests name (n580: the engine captured as a template)")
    args = ap.parse_args()
    args.preset = args.preset or ("1g-bf16" if args.device == "cuda" else "1g")
    collection_on_path()
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units import environment
    from coldsnap_engines.reference.config import PRESETS
    from coldsnap_engines.reference.weights import make_model

    from coldsnap.cli import main as cli

    work = Path(args.work)
    state = work / "state"
    model_dir = work / f"model-{args.preset}"
    ident = make_model(model_dir, PRESETS[args.preset], model_id=f"coldsnap/reference-{args.preset}")
    engine_python = sys.executable
    env = {"OMP_NUM_THREADS": "8", "PYTHONPATH": os.environ["PYTHONPATH"]}

    def request(op: str, port: int | None = None, **extra) -> Path:
        port = port or args.port
        op_id = f"user-path-{op}-{time.strftime('%H%M%S')}"
        if args.device == "cpu":
            from coldsnap.demo import reference_request

            artifact = Path(extra["artifact"]["path"]) if "artifact" in extra else None
            artifact_dir = Path(extra["output"]["artifact_dir"]) if "output" in extra else None
            req = reference_request(operation=op, op_id=op_id, model_dir=model_dir, model=ident, port=port,
                                    state_root=state, env_digest=environment.compute(),
                                    artifact=artifact, artifact_dir=artifact_dir)
            req["workload"] = {"recipe": "cpu-user"}
            if args.choose_driver:
                req.pop("snapshot_driver", None)
            path = work / f"{op}.json"
            path.write_text(json.dumps(req))
            return path
        req = {
            "format": 4, "kind": "coldsnap-operation-request", "operation": op,
            "id": f"gpu-user-{op}-{time.strftime('%H%M%S')}",
            "launch": {"engine": "reference", "runtime": "host",
                       "model": {"id": ident["id"], "revision": ident["revision"],
                                 "source": {"kind": "local-safetensors", "path": str(model_dir)}},
                       "units": [{"id": "unit-0", "index": 0, "host": "localhost", "devices": [0],
                                  "command": [engine_python, "-m", "coldsnap_engines.reference.server", "--model",
                                              str(model_dir), "--port", str(port), "--device", "cuda"],
                                  "environment": env, "environment_digest": environment.of_python(engine_python),
                                  "mounts": [{"source": str(model_dir), "target": str(model_dir)}]}],
                       "execution": {"workers": [{"id": "worker-0", "unit": "unit-0", "rank": 0, "device_slot": 0}],
                                     "services": [{"id": "api", "unit": "unit-0", "port": port}],
                                     "adapter": {"schema": "reference-v1", "digest": "sha256:" + "1" * 64}}},
            "policy": {"process": {"backend": "cuda-criu" if args.driver == "n610" else "criu"},
                       "weights": {"native": {"materialize": "off"}}},
            "validation": {"prompt": "ColdSnap says:", "max_tokens": 16},
            "workload": {"recipe": f"gpu-user-{args.driver}"},
            **extra,
        }
        if args.choose_driver:
            req["policy"].pop("process")  # the chosen driver's defaults
        else:
            req["snapshot_driver"] = {"id": args.driver}
        path = work / f"{op}.json"
        path.write_text(json.dumps(req))
        return path

    def run(op: str, req: Path) -> dict:
        receipt = work / f"{op}-receipt.json"
        t = time.monotonic()
        rc = cli([op, "--request-json", str(req), "--state-root", str(state), "--receipt-json", str(receipt)])
        wall = time.monotonic() - t
        doc = json.loads(receipt.read_text())
        out = {"rc": rc, "state": doc["state"], **unit_split(doc), "cli_wall_s": round(wall, 2),
               "snapshot_driver": doc.get("snapshot_driver")}
        chosen = (doc.get("result") or {}).get("snapshot_driver_selection")
        if chosen:
            out["snapshot_driver_selection"] = chosen
        if doc.get("error"):
            out["error"] = doc["error"]["message"][-1500:]
        units = ((doc.get("result") or {}).get("operation") or {}).get("units") or []
        out["units"] = [{k: u.get(k) for k in ("unit", "state", "readiness", "reply", "served", "listeners_moved")
                         if k in u} for u in units]
        return out

    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"preset": args.preset, "model_bytes": ident.get("bytes")}
    cap = run("capture", request("capture", output={"artifact_dir": str(work / "artifact")}))
    result["capture"] = cap
    artifact = work / "artifact" / "artifact.json"
    if cap["state"] == "succeeded":
        art = json.loads(artifact.read_text())
        result["cold"] = art["acceptance"]["evidence"]["unit-0"]["readiness"]
        for op in ("restore", "sleep", "wake", "status", "stop", "status"):
            result[op if op not in result else f"{op}-after-stop"] = run(op, request(op, artifact={"path": str(artifact)}))
        restore = result["restore"]
        if restore["state"] == "succeeded":
            r = restore["units"][0]["readiness"]
            result["summary"] = {"restore_ttft_s": r["ttft_s"], "cold_ttft_s": result["cold"]["ttft_s"],
                                 "restore_over_cold_ttft": round(r["ttft_s"] / result["cold"]["ttft_s"], 4),
                                 "restore_operation_s": restore["operation_s"],
                                 "control_plane_s": round(restore["operation_s"] - r["ttft_s"], 2)}
    if args.moved_port and cap["state"] == "succeeded":
        import socket

        squatter = socket.socket()
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", args.port))
        squatter.listen()
        try:
            result["restore-moved"] = run("restore", request("restore", port=args.moved_port,
                                                             artifact={"path": str(artifact)}))
        finally:
            squatter.close()
        run("stop", request("stop", port=args.moved_port, artifact={"path": str(artifact)}))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if cap["state"] == "succeeded" else 1


if __name__ == "__main__":
    sys.exit(main())
