"""Runtime ``docker`` and publication, measured against runtime ``host`` in the same run.

The reference engine (tiny preset) is captured and restored through the real controller twice -
with runtime ``host`` (the baseline) and with runtime ``docker`` (rank containers) - then the
docker capture is published to a loopback docker-registry, restored again after its local
capsule image was removed (so the capsule is pulled by digest), and published natively to the
local Hub stand-in. Every docker figure is also given as a ratio to the host-runtime figure of
the same step. Plays include Ansible's own overhead; the ``activate`` task and the unit's CRIU
restore span isolate the unit.

Run (root, dockerd, CRIU, docker-registry): ``.venv/bin/python bench/bench_docker_units.py [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for sub in ("tests/integration/docker_units", "tests/integration/publish", "tests/integration/payload",
            "tests/integration/capsule"):
    sys.path.insert(0, str(REPO / sub))

import docker_workload as dw  # noqa: E402
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import environment  # noqa: E402
from hub_standin import WritableHubStandin  # noqa: E402

from coldsnap.demo import reference_request  # noqa: E402
from coldsnap.runner import operation_extravars, run_playbook  # noqa: E402

TOKEN = "hf_bench_" + "5" * 24


def task_seconds(receipt: dict, name: str) -> float | None:
    spans = [s for s in receipt["timing"]["spans"] if s["name"] == name and s.get("end_ns")]
    return round(sum(s["end_ns"] - s["start_ns"] for s in spans) / 1e9, 3) if spans else None


def unit_span(receipt: dict, name: str) -> float | None:
    spans = [s for s in receipt["timing"]["spans"] if s["name"] == name and s.get("clock", "").startswith("unit:")]
    return round((spans[0]["end_ns"] - spans[0]["start_ns"]) / 1e9, 3) if spans else None


def figures(receipt: dict) -> dict:
    op = receipt["result"]["operation"] or {}
    unit = (op.get("units") or [{}])[0]
    return {"play_s": round(receipt["duration_seconds"], 3),
            "activate_task_s": task_seconds(receipt, "Restore the units on this host")
            or task_seconds(receipt, "Capture the units on this host"),
            "criu_s": unit_span(receipt, "unit.criu.restore") or unit_span(receipt, "unit.criu.dump"),
            "ttr_http_ready_s": (unit.get("readiness") or {}).get("ttr_http_ready_s")}


def ok(res) -> dict:
    if not res.succeeded:
        raise SystemExit(f"{res.operation} failed: {res.receipt['error']}")
    return res.receipt


def host_run(root: Path, model: tuple[Path, dict], name: str) -> dict:
    port = dw.free_port()
    env_digest = environment.compute()

    def req(operation: str, artifact: Path | None = None) -> dict:
        r = reference_request(operation=operation, op_id=f"{name}-{operation}-{time.time_ns()}", model_dir=model[0],
                              model=model[1], port=port, state_root=root, env_digest=env_digest, artifact=artifact,
                              threads=1, artifact_dir=root / "artifacts" / name if operation == "capture" else None)
        r["workload"]["recipe"] = name
        return r

    def run(r: dict):
        return run_playbook(operation=r["operation"], request=r, playbook=f"coldsnap.fleet.{r['operation']}",
                            extravars=operation_extravars(r, state_root=root), inventory=None, state_root=root)

    cap = ok(run(req("capture")))
    art = Path(cap["result"]["operation"]["artifact"])
    res = ok(run(req("restore", art)))
    for f in (root / "workloads" / name).glob("*/control-*.json"):  # stop the restored host engine
        try:
            os.kill(json.loads(f.read_text())["pid"], 9)
        except (OSError, ValueError, KeyError):
            pass
    return {"capture": figures(cap), "restore": figures(res)}


def docker_run(root: Path, model: tuple[Path, dict], image: str, name: str, registry: str) -> dict:
    import docker

    wl = dw.DockerWorkload(root, model, image, name)
    cap = ok(wl.run(wl.request("capture")))
    art = Path(cap["result"]["operation"]["artifact"])
    res = ok(wl.run(wl.request("restore", artifact=art)))
    out: dict = {"capture": figures(cap), "restore": figures(res)}
    repository = f"{registry}/coldsnap/capsules"

    def to(r: dict) -> None:
        r["policy"]["capsule"]["repository"] = repository

    pub = ok(wl.run(wl.request("publish", artifact=art, output=root / "published", mutate=to)))
    out["publish"] = {"play_s": round(pub["duration_seconds"], 3),
                      "push_task_s": task_seconds(pub, "Verify the local capsules and push them (content-idempotent)")}
    # A second capture of the same workload: the registry already holds the runtime image's layers.
    wl.stop()
    art2 = Path(ok(wl.run(wl.request("capture")))["result"]["operation"]["artifact"])
    pub2 = ok(wl.run(wl.request("publish", artifact=art2, output=root / "published-2", mutate=to)))
    out["publish_again"] = {"play_s": round(pub2["duration_seconds"], 3), "push_task_s": task_seconds(
        pub2, "Verify the local capsules and push them (content-idempotent)"),
        "capsule_bytes": json.loads(art2.read_text())["capsule"]["units"][0]["bytes"]}
    wl.stop()
    client = docker.from_env()
    image_id = json.loads(art.read_text())["capsule"]["units"][0]["image_id"]
    client.images.remove(image_id, force=True)
    pulled = ok(wl.run(wl.request("restore", artifact=root / "published" / "artifact.json")))
    out["restore_published"] = {**figures(pulled), "pull_task_s": task_seconds(
        pulled, "Pull this host's capsules of a published descriptor (by digest, verified)")}
    with WritableHubStandin("bench/payloads", token=TOKEN) as hub:
        def native(r: dict) -> None:
            r["policy"]["weights"]["native"]["repository"] = "bench/payloads"

        nat = ok(wl.run(wl.request("publish-native", artifact=art, output=root / "native", mutate=native),
                        secrets={"coldsnap_hf_token": TOKEN},
                        envvars={"HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_XET": "1"}))
        out["publish_native"] = {"play_s": round(nat["duration_seconds"], 3),
                                 "upload_task_s": task_seconds(
                                     nat, "Re-hash this host's payloads and upload the distinct objects it owns"),
                                 "bytes": json.loads(art.read_text())["weights"]["workers"][0]["payload"]["size"]}
    dw.remove_workload_objects(name)
    return out


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    image = dw.build_runtime_image()
    with tempfile.TemporaryDirectory(prefix="coldsnap-bench-") as where:
        tmp = Path(where)
        model = dw.make_tiny_model(tmp / "models")
        host = host_run(tmp / "host", model, "bench-host")
        with dw.docker_registry(tmp / "registry") as registry:
            dock = docker_run(tmp / "docker", model, image["runtime_image"], "bench-docker", registry)
    result = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()},
              "host": host, "docker": dock}
    rows = [("capture play", host["capture"]["play_s"], dock["capture"]["play_s"]),
            ("capture unit task", host["capture"]["activate_task_s"], dock["capture"]["activate_task_s"]),
            ("CRIU dump", host["capture"]["criu_s"], dock["capture"]["criu_s"]),
            ("restore play", host["restore"]["play_s"], dock["restore"]["play_s"]),
            ("restore activate task", host["restore"]["activate_task_s"], dock["restore"]["activate_task_s"]),
            ("CRIU restore", host["restore"]["criu_s"], dock["restore"]["criu_s"]),
            ("restored TTR http-ready", host["restore"]["ttr_http_ready_s"], dock["restore"]["ttr_http_ready_s"])]
    print("| step | host runtime s | docker s | docker / host |")
    print("| --- | ---: | ---: | ---: |")
    for name, h, d in rows:
        print(f"| {name} | {h} | {d} | {ratio(d, h)} |")
    base = host["restore"]["play_s"]
    for name, val in (("publish play (push)", dock["publish"]["play_s"]),
                      ("  push task", dock["publish"]["push_task_s"]),
                      ("publish of a 2nd capture (runtime layers in the registry)", dock["publish_again"]["play_s"]),
                      ("  push task", dock["publish_again"]["push_task_s"]),
                      ("restore of published play (pull)", dock["restore_published"]["play_s"]),
                      ("  pull task", dock["restore_published"]["pull_task_s"]),
                      ("publish-native play", dock["publish_native"]["play_s"]),
                      ("  rehash + upload task", dock["publish_native"]["upload_task_s"])):
        print(f"| {name} | | {val} | {ratio(val, base)} of host restore play |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
