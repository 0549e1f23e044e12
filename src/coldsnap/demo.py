"""The main job, end to end on localhost: make a reference model, capture the running
engine, restore it, validate the reply, and compare restore with the cold start.

``coldsnap demo`` drives the same public path a user drives: strict requests, the
collection's playbooks through ansible-runner, receipts. Nothing is special-cased.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import environment

from coldsnap.commands._io import whole_number
from coldsnap.commands.operations import STATE_ROOT_HELP

DRIVER = "n610"


def reference_request(*, operation: str, op_id: str, model_dir: Path, model: dict, port: int, state_root: Path,
                      env_digest: str, artifact: Path | None = None, artifact_dir: Path | None = None,
                      tp: int = 1, threads: int = 2) -> dict:
    """A request for the reference engine on localhost (TP ``tp``: one unit per rank)."""
    units, workers = [], []
    for rank in range(tp):
        units.append({
            "id": f"unit-{rank}", "index": rank, "host": "localhost", "devices": [],
            "command": ["coldsnap-reference-engine", "--model", str(model_dir), "--port", str(port)],
            "environment": {"OMP_NUM_THREADS": str(threads), **({"GLOO_SOCKET_IFNAME": "lo"} if tp > 1 else {})},
            "mounts": [{"source": str(model_dir), "target": str(model_dir), "read_only": True}],
            "environment_digest": env_digest,
        })
        workers.append({"id": f"worker-{rank}", "unit": f"unit-{rank}", "rank": rank, "device_slot": None})
    req = {
        "format": 4, "kind": "coldsnap-operation-request", "operation": operation, "id": op_id,
        "snapshot_driver": {"id": DRIVER},
        "launch": {
            "engine": "reference", "runtime": "host",
            "model": {"id": model["id"], "revision": model["revision"],
                      "source": {"kind": "local-safetensors", "path": str(model_dir)}},
            "units": units,
            "execution": {
                "workers": workers,
                "groups": [{"kind": "tensor", "workers": [w["id"] for w in workers]}],
                "services": [{"id": "api", "unit": "unit-0", "port": port, "health_path": "/health"}],
                "adapter": {"schema": "reference-v1",
                            "digest": "sha256:" + "0" * 63 + str(tp), "payload": {"tp": tp}},
            },
        },
        "policy": {"process": {"backend": "criu", "kv_discard": True},
                   "weights": {"mode": "auto", "native": {"export": True, "materialize": "off"}}},
        "validation": {"health_path": "/health", "prompt": "ColdSnap says:", "max_tokens": 16, "expected": None},
        "workload": {"recipe": f"demo-{model_dir.name}-tp{tp}", "served_model_name": model_dir.name},
    }
    if artifact_dir is not None:
        req["output"] = {"artifact_dir": str(artifact_dir)}
    if artifact is not None:
        req["artifact"] = {"path": str(artifact)}
    return validate_request(req)


VLLM_SERVED = "llama-tiny"
VLLM_VALIDATION_TOKENS = 12  # the validation reply's length
VLLM_ENGINE_ENV = {"VLLM_PLUGINS": "coldsnap", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                   "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def vllm_serve_command(python: str, model_dir: Path, port: int, *, served: str = VLLM_SERVED,
                       extension: bool = True) -> list[str]:
    """vLLM's own OpenAI server on CPU, small enough for two cores (``extension``: ColdSnap's worker
    extension, which a capture requires; without it, the server as a user starts it)."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.engines import VLLM_WORKER_EXTENSION

    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", served, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "256", "--dtype", "bfloat16", "--max-num-batched-tokens", "256", "--max-num-seqs", "4"]
    if extension:
        cmd += ["--worker-extension-cls", VLLM_WORKER_EXTENSION]
    return cmd


def vllm_request(*, operation: str, op_id: str, recipe: str, python: str, model_dir: Path, model: dict, port: int,
                 env_digest: str, cache_root: Path, prompt: str, artifact: Path | None = None,
                 artifact_dir: Path | None = None, served: str = VLLM_SERVED) -> dict:
    """A request for vLLM's OpenAI server on CPU on localhost (one unit, one worker), with vLLM's compiled
    kernels (``cache_root``/torch_compile_cache) declared so the capsule carries them."""
    req = {
        "format": 4, "kind": "coldsnap-operation-request", "operation": operation, "id": op_id,
        "snapshot_driver": {"id": DRIVER},
        "launch": {
            "engine": "vllm", "runtime": "host",
            "model": {"id": model["id"], "revision": model["revision"],
                      "source": {"kind": "local-safetensors", "path": str(model_dir)}},
            "units": [{"id": "unit-0", "index": 0, "host": "localhost", "devices": [],
                       "command": vllm_serve_command(python, model_dir, port, served=served),
                       "environment": {**VLLM_ENGINE_ENV, "VLLM_CACHE_ROOT": str(cache_root)},
                       "mounts": [{"source": str(model_dir), "target": str(model_dir), "read_only": True}],
                       "environment_digest": env_digest}],
            "execution": {"workers": [{"id": "worker-0", "unit": "unit-0", "rank": 0, "device_slot": None}],
                          "groups": [{"kind": "tensor", "workers": ["worker-0"]}],
                          "services": [{"id": "api", "unit": "unit-0", "port": port, "health_path": "/health"}],
                          "adapter": {"schema": "vllm-v1", "digest": "sha256:" + "7" * 64}},
        },
        "policy": {"process": {"backend": "criu"},
                   "cache": {"paths": [str(cache_root / "torch_compile_cache")]},
                   "weights": {"mode": "auto", "native": {"export": True, "materialize": "off"}}},
        "validation": {"health_path": "/health", "prompt": prompt, "max_tokens": VLLM_VALIDATION_TOKENS,
                       "expected": None},
        "workload": {"recipe": recipe, "served_model_name": served},
    }
    if artifact_dir is not None:
        req["output"] = {"artifact_dir": str(artifact_dir)}
    if artifact is not None:
        req["artifact"] = {"path": str(artifact)}
    return req


def _kill_workload(state_root: Path, recipe: str) -> None:
    for f in (state_root / "workloads" / recipe).glob("*/control-*.json"):
        try:
            os.kill(json.loads(f.read_text())["pid"], signal.SIGKILL)
        except (OSError, ValueError, KeyError):
            pass


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def run_demo(*, preset: str, state_root: Path, port: int, tp: int, keep_running: bool, out=sys.stdout) -> int:
    from coldsnap_engines.reference.config import PRESETS
    from coldsnap_engines.reference.weights import make_model

    from coldsnap import api

    def say(msg: str) -> None:
        print(f"==> {msg}", file=sys.stderr, flush=True)

    model_dir = state_root / "models" / f"reference-{preset}"
    say(f"reference model '{preset}' in {model_dir}")
    ident = make_model(model_dir, PRESETS[preset], model_id=f"coldsnap/reference-{preset}")
    env_digest = environment.compute()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    cap_id, res_id = f"demo-capture-{stamp}", f"demo-restore-{stamp}"
    art_dir = state_root / "artifacts" / "demo" / cap_id
    cap = reference_request(operation="capture", op_id=cap_id, model_dir=model_dir, model=ident, port=port,
                            state_root=state_root, env_digest=env_digest, artifact_dir=art_dir, tp=tp)
    _kill_workload(state_root, cap["workload"]["recipe"])
    say("capture: cold start, validation, quiesce, payload export, CRIU dump (coldsnap.fleet.capture)")
    capture = api.capture(cap, state_root=state_root, progress=None)
    if not capture.succeeded:
        print(json.dumps(capture.raw, indent=2), file=out)
        say(f"capture failed: {capture.error.message}")
        return 1
    artifact = Path(capture.result["operation"]["artifact"])
    res = reference_request(operation="restore", op_id=res_id, model_dir=model_dir, model=ident, port=port,
                            state_root=state_root, env_digest=env_digest, artifact=artifact, tp=tp)
    say("restore: prepare on every host, CRIU restore, hydration, validation (coldsnap.fleet.restore)")
    restore = api.restore(res, state_root=state_root, progress=None)
    print(json.dumps(restore.raw, indent=2), file=out)
    if not restore.succeeded:
        say(f"restore failed: {restore.error.message}")
        return 1
    art = json.loads(artifact.read_text())
    print(comparison_table(art, restore.raw, capture_receipt=capture.raw), file=out)
    print(f"\ncapture receipt: {capture.path}\nrestore receipt: {restore.path}\n"
          f"timeline:        coldsnap timeline {restore.path} -o restore-timeline.png", file=out)
    if not keep_running:
        # Stopped the way a user stops it (coldsnap stop): `coldsnap status` then says "stopped", not "crashed".
        stop = api.stop({**res, "operation": "stop", "id": f"demo-stop-{stamp}"}, state_root=state_root,
                        progress=None)
        if not stop.succeeded:
            _kill_workload(state_root, res["workload"]["recipe"])
    else:
        say(f"the restored engine keeps serving on http://127.0.0.1:{port}/v1/completions")
    return 0


def comparison_table(artifact: dict, restore_receipt: dict, *, capture_receipt: dict | None = None) -> str:
    """Cold start (the capture's launch) vs restore, and capsule vs model bytes."""
    cold = artifact["acceptance"]["evidence"]["unit-0"]["readiness"]
    restored = next(u for u in restore_receipt["result"]["operation"]["units"] if u["unit"] == "unit-0")["readiness"]
    model_bytes = sum(w["model_bytes"] for w in artifact["weights"]["workers"])
    capsule_bytes = sum(c["bytes"] for c in artifact["capsule"]["units"])
    rows = [("TTR port-open", cold["ttr_port_open_s"], restored["ttr_port_open_s"]),
            ("TTR HTTP-ready", cold["ttr_http_ready_s"], restored["ttr_http_ready_s"]),
            ("startup TTFT", cold["ttft_s"], restored["ttft_s"])]
    lines = ["", "                     cold start     restore    restore/cold",
             "  ----------------  ------------  ----------  ------------"]
    for name, c, r in rows:
        lines.append(f"  {name:16s}  {c:10.3f} s  {r:8.3f} s  {r / c:12.3f}")
    lines.append("")
    lines.append(f"  model bytes    {_bytes(model_bytes):>12s}   (native payload, outside the capsule)")
    lines.append(f"  capsule bytes  {_bytes(capsule_bytes):>12s}   capsule/model = {capsule_bytes / max(model_bytes, 1):.3f}")
    lines.append(f"  reply          {artifact['acceptance']['reply']!r} (identical before and after)")
    return "\n".join(lines)


def register_cli(sub) -> None:
    p = sub.add_parser("demo", help="the main job: capture and restore the reference engine on localhost")
    p.add_argument("--preset", default=os.environ.get("COLDSNAP_DEMO_PRESET", "1g"),
                   help="reference model size: tiny (3 MB), small, 1g (default, about 1 GB of float32 "
                        "weights), 1g-bf16 ... 8g-bf16")
    # a string: Path("") would be "." (resolve_state_root refuses it)
    p.add_argument("--state-root", default=None, metavar="PATH", help=STATE_ROOT_HELP)
    p.add_argument("--port", type=whole_number(1, 65535, what="a port number"), default=8000,
                   help="port the engine serves on (1-65535)")
    p.add_argument("--tp", type=whole_number(1), default=1, help="tensor-parallel ranks (one unit each; 1 or more)")
    p.add_argument("--keep-running", action="store_true", help="leave the restored engine serving")

    def start(a) -> int:
        from coldsnap_engines.reference.config import PRESETS

        from coldsnap.api import resolve_state_root

        if a.preset not in PRESETS:  # checked here, not by argparse: the default may come from the environment
            p.error(f"argument --preset (or COLDSNAP_DEMO_PRESET): invalid choice: {a.preset!r} "
                    f"(choose from {', '.join(sorted(PRESETS))})")
        return run_demo(preset=a.preset, state_root=resolve_state_root(a.state_root).absolute(), port=a.port,
                        tp=a.tp, keep_running=a.keep_running)

    p.set_defaults(func=start)
