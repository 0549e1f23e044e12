"""Restore-to-first-token vs cold-start-to-first-token of the reference engine on a GPU.

Standalone (plain ``python3`` with torch + cuda-python, as root, with CRIU available as
``$COLDSNAP_CRIU`` or on PATH): makes the library importable itself, generates a reference
model, then drives the same per-host code the ``unit_capture`` / ``unit_restore`` modules
run (the activation runtime, CRIU, the CUDA driver checkpoint API, payload hydration):

1. capture: cold start (measured from unit start: TTR port-open, TTR HTTP-ready, TTFT),
   exact validation, quiesce, export (pack + residual), release of the VMM weight memory,
   CUDA checkpoint, CRIU dump;
2. restore with the native pack, twice; restore with the recovery (safetensors) provider;
3. baselines in the same run: a second cold start outside any capture (page cache, and with
   ``--compile`` the TorchInductor/Triton caches, warm by then; the capture's own cold start
   starts from empty compile caches, as on a fresh host), a pinned host->device copy of the
   model bytes, and safetensors ``load_file(device="cuda")`` of the checkpoint.

Prints one JSON document (and writes it to --out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def setup_paths() -> Path:
    coll = Path(tempfile.mkdtemp(prefix="coldsnap-coll-"))
    link = coll / "ansible_collections" / "coldsnap"
    link.mkdir(parents=True)
    (link / "fleet").symlink_to(REPO)
    extra = [str(coll), str(REPO / "runtime_image" / "integrations")]
    sys.path[:0] = extra
    os.environ["PYTHONPATH"] = os.pathsep.join(extra + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    return coll


def build_native_fill() -> str:
    """Build native/fill.c if it is not built (what scripts/setup-venv.sh does on a GPU host), so
    restores hydrate through it; returns the library path, or why it is not there."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import native_fill

    try:
        return str(native_fill.ensure_built())
    except Exception as exc:  # no compiler: restores take the Python loop, and the result says so
        return f"not built: {exc}"


def fresh_compile_caches(work: Path) -> dict[str, str]:
    """Empty TorchInductor/Triton cache directories of this run only, as engine environment: the
    capture's cold start then compiles like a fresh host's."""
    caches = work / "compile-cache"
    shutil.rmtree(caches, ignore_errors=True)
    return {"TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"), "TRITON_CACHE_DIR": str(caches / "triton")}


def hydrate_fills(evidence: dict) -> list:
    """Which copy loop each hydration of a unit's evidence ran ("native" or "python")."""
    return [s["attrs"].get("fill") for s in evidence["timing"]["spans"] if s["name"] == "engine.hydrate"]


def timeline(spans: list[dict]) -> list[list]:
    """[name, start, seconds] of each span, the start in seconds from the first span's, in start order:
    where the gaps between the phases are."""
    first = min(s["start_ns"] for s in spans)
    return [[s["name"], round((s["start_ns"] - first) / 1e9, 4), round((s["end_ns"] - s["start_ns"]) / 1e9, 4)]
            for s in sorted(spans, key=lambda s: s["start_ns"])]


def env_arg(ap: argparse.ArgumentParser, values: list[str]) -> dict[str, str]:
    """``--env NAME=VALUE`` values as a dict; anything else is an argparse error that shows the form."""
    bad = [e for e in values if "=" not in e or not e.split("=", 1)[0]]
    if bad:
        ap.error(f"--env {bad[0]!r}: write it as NAME=VALUE, e.g. --env CUDA_MODULE_LOADING=LAZY")
    return dict(e.split("=", 1) for e in values)


def counts_arg(ap: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    """A comma-separated list of positive integers (``--threads 8,12``); anything else is an argparse error."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        ap.error(f"{flag} {text!r}: give positive whole numbers separated by commas, e.g. {flag} 8,12")
    return values


def preset_arg(ap: argparse.ArgumentParser, name: str):
    """The reference model preset called ``name`` (after :func:`setup_paths`); an argparse error naming the choices."""
    from coldsnap_engines.reference.config import PRESETS

    if name not in PRESETS:
        ap.error(f"--preset {name!r} is not a reference model preset; choose from {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def emit(result: dict, out: str | None) -> int:
    """Print the result document (and write it to ``out``); the exit status of a bench."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text)
    return 0


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def pinned_h2d_gbps(nbytes: int, repeat: int = 3) -> float:
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = 1e9
    for _i in range(repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    del host, dev
    torch.cuda.empty_cache()
    return nbytes / best / 1e9


def safetensors_load_s(model_dir: Path) -> float:
    import torch
    from safetensors.torch import load_file

    best = 1e9
    for _i in range(2):
        t = time.perf_counter()
        out = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            out.update(load_file(str(f), device="cuda"))
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
        del out
        torch.cuda.empty_cache()
    return best


def cold_start_again(command: list[str], env: dict, port: int, validation: dict) -> dict:
    """Launch the engine once more outside any capture (page cache and compile cache warm now)
    and time it like a unit start: HTTP-ready and first streamed token from the launch."""
    import subprocess

    sys.path.insert(0, str(REPO / "runtime_image" / "activation"))
    from coldsnap_activation.probes import stream_completion, wait_http_ready

    t0 = time.monotonic_ns()
    proc = subprocess.Popen(command, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ready = wait_http_ready("127.0.0.1", port, "/health", timeout=900, alive=lambda: proc.poll() is None)
        done = stream_completion("127.0.0.1", port, model="", prompt=validation["prompt"],
                                 max_tokens=validation["max_tokens"])
        reply, first = done.text, done.first_ns
    finally:
        proc.kill()
        proc.wait()
    return {"ttr_http_ready_s": round((ready - t0) / 1e9, 4), "ttft_s": round((first - t0) / 1e9, 4), "reply": reply}


def kill_pid(pid: int, timeout: float = 90) -> None:
    """SIGKILL ``pid`` and wait until it is gone (reaped by its keeper), as the evict step does.

    A process that held a CUDA context takes a while to exit: its leader turns zombie
    while other threads are still in the driver's teardown, holding the process's
    sockets; the next restore needs those ports.
    """
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists():
        if time.monotonic() > deadline:
            print(f"warning: pid {pid} not reaped {timeout:.0f}s after SIGKILL", file=sys.stderr)
            return
        time.sleep(0.02)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="2g-bf16")
    ap.add_argument("--work", default="/tmp/coldsnap-gpu")
    ap.add_argument("--port", type=int, default=18200)
    ap.add_argument("--out", default=None)
    ap.add_argument("--restores", type=int, default=2)
    ap.add_argument("--compile", action="store_true",
                    help="start the engine with --compile (TorchInductor graphs built during its start-up)")
    ap.add_argument("--engine-core-process", action="store_true",
                    help="run the engine in vLLM V1's shape: an API server without CUDA, the model and CUDA "
                         "context in its child")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment of the engine unit (repeatable)")
    ap.add_argument("--driver", choices=("n610", "n580"), default="n610",
                    help="snapshot driver: n610 dumps the started engine with its CUDA state, n580 the "
                         "context-free template (CUDA created on restore)")
    args = ap.parse_args()
    extra_env = env_arg(ap, args.env)
    setup_paths()
    config = preset_arg(ap, args.preset)
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units import activation_stage as activation
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units import specs as unit
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units.host_facts import gather
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units.host_units import run_units
    from coldsnap_engines.reference.weights import make_model

    work = Path(args.work)
    state = work / "state"
    model_dir = work / f"model-{args.preset}"
    t = time.time()
    ident = make_model(model_dir, config, model_id=f"coldsnap/reference-{args.preset}")
    result: dict = {"preset": args.preset, "driver": args.driver, "compile": args.compile,
                    "engine_core_process": args.engine_core_process,
                    "env": args.env, "model_generate_s": round(time.time() - t, 2),
                    "model": ident, "native_fill": build_native_fill()}
    facts = gather(check_criu=True)
    result["host"] = {k: facts[k] for k in ("kernel", "nvidia_driver", "gpus", "criu")}
    env = {"OMP_NUM_THREADS": "8", "PYTHONPATH": os.environ["PYTHONPATH"], **extra_env}
    if args.compile:
        env.update(fresh_compile_caches(work))
    req = validate_request({
        "format": 4, "kind": "coldsnap-operation-request", "operation": "capture", "id": "gpu-capture",
        "snapshot_driver": {"id": args.driver}, "output": {"artifact_dir": str(work / "artifact")},
        "launch": {"engine": "reference", "runtime": "host",
                   "model": {"id": ident["id"], "revision": ident["revision"],
                             "source": {"kind": "local-safetensors", "path": str(model_dir)}},
                   "units": [{"id": "unit-0", "index": 0, "host": "localhost", "devices": [0],
                              "command": [sys.executable, "-m", "coldsnap_engines.reference.server", "--model",
                                          str(model_dir), "--port", str(args.port), "--device", "cuda",
                                          *(["--compile"] if args.compile else []),
                                          *(["--engine-core-process"] if args.engine_core_process else [])],
                              "environment": env, "environment_digest": "sha256:" + "0" * 64,
                              "mounts": [{"source": str(model_dir), "target": str(model_dir)}]}],
                   "execution": {"workers": [{"id": "worker-0", "unit": "unit-0", "rank": 0, "device_slot": 0}],
                                 "services": [{"id": "api", "unit": "unit-0", "port": args.port}],
                                 "adapter": {"schema": "reference-v1", "digest": "sha256:" + "1" * 64}}},
        "policy": {"process": {"backend": "cuda-criu" if args.driver == "n610" else "criu"},
                   "weights": {"native": {"materialize": "off"}}},
        "validation": {"prompt": "ColdSnap says:", "max_tokens": 16},
        "workload": {"recipe": "gpu-bench"},
    })
    digest, _adir, _staged = activation.stage(REPO / "runtime_image" / "activation", state)
    specs = unit.build_specs(req, host="localhost", operation="capture", capture_id="gpu-cap", state_root=state)
    t = time.time()
    cap = run_units(specs, state_root=state, activation_digest=digest)[0]
    result["capture_wall_s"] = round(time.time() - t, 2)
    result["cold"] = cap["readiness"]
    result["capture_spans"] = {s["name"]: round((s["end_ns"] - s["start_ns"]) / 1e9, 4) for s in cap["timing"]["spans"]}
    udir = state / "captures" / "gpu-cap" / "units" / "unit-0"
    w = cap["workers"][0]
    result["criu_image_bytes"] = w["criu"]["bytes"]
    result["memory_at_checkpoint"] = w.get("memory_at_checkpoint")
    result["cuda_in"] = ("none (a template)" if not w.get("cuda_pids") else
                         "the unit's process" if w.get("cuda_pids") == [w["pid"]] else f"pids {w.get('cuda_pids')}")
    result["capsule_bytes"] = dir_bytes(udir)
    result["model_bytes"] = w["payload"]["model_bytes"]
    result["residual_bytes"] = w["payload"]["residual_bytes"]
    pack = w["payload"]["pack"]
    expected = cap["acceptance_reply"]
    result["reply"] = expected
    restores = []
    for i, provider in enumerate(["native"] * args.restores + ["recovery"]):
        weights = {"model_dir": str(model_dir), "materialize": "off",
                   "workers": {"worker-0": {"provider": provider, "pack": (
                       {"path": str(state / pack["path"]), "sha256": pack["sha256"], "size": pack["size"]}
                       if provider == "native" else None)}}}
        rreq = dict(req)
        rreq["id"] = f"gpu-restore-{i}"
        specs = unit.build_specs(rreq, host="localhost", operation="restore", capture_id="gpu-cap", state_root=state,
                                 weights=weights, validation={**req["validation"], "expected": expected})
        t = time.time()
        ev = run_units(specs, state_root=state, activation_digest=digest)[0]
        restores.append({"provider": provider, "wall_s": round(time.time() - t, 2), "readiness": ev["readiness"],
                         "reply_ok": ev["reply"] == expected,
                         "fill": hydrate_fills(ev),
                         "hydration": [{k: s["attrs"].get(k) for k in ("seconds", "staging_wait_s", "sink_open_s",
                                                                       "sink_close_s")}
                                       for s in ev["timing"]["spans"] if s["name"] == "engine.hydrate"],
                         "spans": {s["name"]: round((s["end_ns"] - s["start_ns"]) / 1e9, 4)
                                   for s in ev["timing"]["spans"]},
                         "timeline": timeline(ev["timing"]["spans"]),
                         "launch_to_admission_s": round((min(s["start_ns"] for s in ev["timing"]["spans"])
                                                         - ev["timing"]["t0_ns"]) / 1e9, 4)})
        kill_pid(ev["workers"][0]["pid"])
        time.sleep(0.5)
    result["restores"] = restores
    launch = req["launch"]["units"][0]
    result["cold_again"] = cold_start_again(launch["command"], env, args.port, req["validation"])
    result["pinned_h2d_gbps"] = round(pinned_h2d_gbps(result["model_bytes"]), 2)
    result["safetensors_load_cuda_s"] = round(safetensors_load_s(model_dir), 3)
    best = min(restores[: args.restores], key=lambda r: r["readiness"]["ttft_s"])
    hyd = best["spans"].get("engine.hydrate")
    result["summary"] = {
        "cold_ttft_s": result["cold"]["ttft_s"],
        "restore_ttft_s": best["readiness"]["ttft_s"],
        "restore_over_cold_ttft": round(best["readiness"]["ttft_s"] / result["cold"]["ttft_s"], 4),
        "restore_over_cold_http_ready": round(best["readiness"]["ttr_http_ready_s"] / result["cold"]["ttr_http_ready_s"], 4),
        "capsule_over_model_bytes": round(result["capsule_bytes"] / result["model_bytes"], 4),
        "hydration_gbps": round(result["model_bytes"] / hyd / 1e9, 2) if hyd else None,
        "hydration_over_pinned": round(result["model_bytes"] / hyd / 1e9 / result["pinned_h2d_gbps"], 3) if hyd else None,
        "fill_over_pinned": max((round(result["model_bytes"] / h["seconds"] / 1e9 / result["pinned_h2d_gbps"], 3)
                                 for r in restores[: args.restores] for h in r["hydration"] if h.get("seconds")),
                                default=None),
        "recovery_ttft_s": restores[-1]["readiness"]["ttft_s"],
        "cold_again_ttft_s": result["cold_again"]["ttft_s"],
        "restore_over_cold_again_ttft": round(best["readiness"]["ttft_s"] / result["cold_again"]["ttft_s"], 4),
    }
    return emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
