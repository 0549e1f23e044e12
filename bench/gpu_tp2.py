"""Tensor parallelism over NCCL on two GPUs: capture, restore, and restore with the ranks swapped.

Standalone on a host with two NVIDIA GPUs (plain ``python3`` with torch + cuda-python, as root,
CRIU as ``$COLDSNAP_CRIU`` or on PATH). Drives the per-host code the unit modules run, with
the activation's CSKV coordinator: two units (rank 0 on GPU 0, rank 1 on GPU 1), NCCL torn
down through the coordinator before the CUDA checkpoint of both ranks and the CRIU dump;
restore (same GPUs) rebuilds NCCL with fresh endpoints from a new coordinator and hydrates
both ranks. Swapping the ranks between the GPUs is refused by restore admission while NCCL
uses its intra-node transports (the script records admission's answer); a second capture
with NCCL on sockets (NCCL_P2P_DISABLE=1, NCCL_SHM_DISABLE=1) is then restored with the
ranks swapped (CUDA restore remaps every GPU UUID). NVLink multicast stays off
(NCCL_NVLS_ENABLE=0 and friends). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_snapshot import (
    REPO,
    build_native_fill,
    emit,
    fresh_compile_caches,
    hydrate_fills,
    kill_pid,
    pinned_h2d_gbps,
    preset_arg,
    setup_paths,
)

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _wait_ports_free(listeners: list[tuple[str, int]]) -> float:
    """Seconds restore admission's port check takes (it waits out TIME_WAIT-only ports)."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.process import ports

    t0 = time.monotonic()
    ports.require_ports_free(listeners, unit="bench")
    return round(time.monotonic() - t0, 2)


def _swap_admission(caps: list[dict], env: dict) -> str:
    """Restore admission's answer for these captured ranks with GPU 0 and GPU 1 swapped."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import AdmissionError
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units.admission import GpuMoves
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units.host_facts import gather

    art = {"launch": {"execution": {
        "workers": [{"id": f"worker-{r}", "unit": f"unit-{r}", "rank": r, "device_slot": 0} for r in (0, 1)],
        "groups": [{"kind": "tensor", "workers": ["worker-0", "worker-1"]}]}}}
    moves = GpuMoves(art, gather(check_criu=False))
    for c, dev in zip(caps, (1, 0), strict=True):
        moves.add({"id": c["unit"], "devices": [dev]}, c, {"environment": env})
    try:
        moves.admit("localhost")
    except AdmissionError as exc:
        return f"refused: {exc}"
    return "admitted"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="4g-bf16")
    ap.add_argument("--work", default="/tmp/coldsnap-tp2")
    ap.add_argument("--port", type=int, default=18600)
    ap.add_argument("--out", default=None)
    ap.add_argument("--compile", action="store_true",
                    help="start both ranks with --compile (TorchInductor graphs built during start-up)")
    ap.add_argument("--no-swap-on-sockets", dest="swap_on_sockets", action="store_false",
                    help="skip the second capture (NCCL on sockets) and its restore with the ranks swapped")
    args = ap.parse_args()
    os.environ.update(NO_MULTICAST)
    setup_paths()
    config = preset_arg(ap, args.preset)
    from ansible_collections.coldsnap.fleet.plugins.module_utils.coord import daemon
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units import activation_stage as activation
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units import specs as unit
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units.admission import NCCL_SOCKETS_ONLY
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units.host_units import run_units
    from coldsnap_engines.reference.weights import make_model

    work = Path(args.work)
    state = work / "state"
    model_dir = work / f"model-{args.preset}"
    ident = make_model(model_dir, config, model_id=f"coldsnap/reference-{args.preset}")
    env = {"OMP_NUM_THREADS": "4", "PYTHONPATH": os.environ["PYTHONPATH"], "NCCL_SOCKET_IFNAME": "lo",
           "NCCL_DEBUG": "WARN", "PYTHONFAULTHANDLER": "1",
           **NO_MULTICAST}
    if args.compile:
        env.update(fresh_compile_caches(work), TORCH_LOGS="recompiles")

    def request(op_id: str, devices: tuple[int, int]) -> dict:
        units, workers = [], []
        for rank, dev in enumerate(devices):
            units.append({"id": f"unit-{rank}", "index": rank, "host": "localhost", "devices": [dev],
                          "command": [sys.executable, "-m", "coldsnap_engines.reference.server", "--model",
                                      str(model_dir), "--port", str(args.port), "--device", "cuda",
                                      *(["--compile"] if args.compile else [])],
                          "environment": env, "environment_digest": "sha256:" + "0" * 64,
                          "mounts": [{"source": str(model_dir), "target": str(model_dir)}]})
            workers.append({"id": f"worker-{rank}", "unit": f"unit-{rank}", "rank": rank, "device_slot": 0})
        return validate_request({
            "format": 4, "kind": "coldsnap-operation-request", "operation": "capture", "id": op_id,
            "snapshot_driver": {"id": "n610"}, "output": {"artifact_dir": str(work / "artifact")},
            "launch": {"engine": "reference", "runtime": "host",
                       "model": {"id": ident["id"], "revision": ident["revision"],
                                 "source": {"kind": "local-safetensors", "path": str(model_dir)}},
                       "units": units,
                       "execution": {"workers": workers, "groups": [{"kind": "tensor",
                                                                     "workers": ["worker-0", "worker-1"]}],
                                     "services": [{"id": "api", "unit": "unit-0", "port": args.port}],
                                     "adapter": {"schema": "reference-v1", "digest": "sha256:" + "2" * 64}}},
            "policy": {"process": {"backend": "cuda-criu"}, "weights": {"native": {"materialize": "off"}}},
            "validation": {"prompt": "ColdSnap says:", "max_tokens": 16},
            "workload": {"recipe": "gpu-tp2"},
        })

    def coordinator(scope: str) -> str:
        ep = state / "runs" / scope / "coordinator.json"
        daemon.start_coordinator(ep, scope=scope)
        return str(ep)

    def phases(ev: dict) -> dict:
        return {s["name"]: round((s["end_ns"] - s["start_ns"]) / 1e9, 4) for s in ev["timing"]["spans"]
                if s.get("end_ns")}

    digest, _adir, _staged = activation.stage(REPO / "runtime_image" / "activation", state)
    result: dict = {"preset": args.preset, "compile": args.compile, "model_bytes_total": ident["bytes"],
                    "native_fill": build_native_fill()}

    def save() -> None:
        # After every stage, so a run cut short still reports what it measured.
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))

    def capture(tag: str) -> list[dict]:
        ep = coordinator(f"tp2-capture{tag}")
        t = time.time()
        caps = run_units(unit.build_specs(request(f"tp2-capture{tag}", (0, 1)), host="localhost",
                                          operation="capture", capture_id=f"tp2{tag}", state_root=state,
                                          coordinator_endpoint=ep),
                         state_root=state, activation_digest=digest)
        daemon.stop_coordinator(ep)
        result[f"capture{tag}_wall_s"] = round(time.time() - t, 2)
        return caps

    def restore(name: str, devices: tuple[int, int], caps: list[dict], tag: str = "") -> dict:
        req = {**request(f"tp2-{name}", devices), "id": f"tp2-{name}"}
        weights = {"model_dir": str(model_dir), "materialize": "off", "workers": {}}
        for c in caps:
            pk = c["workers"][0]["payload"]["pack"]
            weights["workers"][c["workers"][0]["worker"]] = {
                "provider": "native",
                "pack": {"path": str(state / pk["path"]), "sha256": pk["sha256"], "size": pk["size"]}}
        port_wait = _wait_ports_free([tuple(x) for c in caps for w in c["workers"] for x in w["listeners"]])
        ep = coordinator(req["id"])
        t = time.time()
        expected = caps[0]["acceptance_reply"]
        try:
            evs = run_units(unit.build_specs(req, host="localhost", operation="restore",
                                             capture_id=f"tp2{tag}", state_root=state, weights=weights,
                                             coordinator_endpoint=ep,
                                             validation={**req["validation"], "expected": expected}),
                            state_root=state, activation_digest=digest)
        except Exception as exc:
            restores.append({"name": name, "devices": list(devices), "error": str(exc)})
            save()
            raise
        daemon.stop_coordinator(ep)
        ev0 = next(e for e in evs if e["unit"] == "unit-0")
        rec = {"name": name, "devices": list(devices), "wall_s": round(time.time() - t, 2),
               "waited_for_ports_s": port_wait, "readiness": ev0["readiness"], "reply_ok": ev0["reply"] == expected,
               "phases": {e["unit"]: phases(e) for e in evs},
               "fill": {e["unit"]: hydrate_fills(e) for e in evs}}
        if args.compile:  # the logs were reset before the dump: these are the restored ranks' lines
            rec["recompile_log_lines"] = {
                u: sum("ecompil" in line for line in (state / "workloads" / "gpu-tp2" / u / "target.log")
                       .read_text(errors="replace").splitlines()) for u in ("unit-0", "unit-1")}
        restores.append(rec)
        t = time.time()
        for e in evs:
            kill_pid(e["workers"][0]["pid"])
        rec["exit_after_kill_s"] = round(time.time() - t, 2)
        save()
        return rec

    caps = capture("")
    caps.sort(key=lambda c: c["unit"])
    cap0 = caps[0]
    result["cold"] = cap0["readiness"]
    result["capture_phases"] = {c["unit"]: phases(c) for c in caps}
    result["per_rank"] = {c["unit"]: {"model_bytes": c["workers"][0]["payload"]["model_bytes"],
                                      "criu_image_bytes": c["workers"][0]["criu"]["bytes"],
                                      "gpu_uuids": c["workers"][0]["gpu_uuids"],
                                      "memory_at_checkpoint": c["workers"][0]["memory_at_checkpoint"]} for c in caps}
    result["reply"] = cap0["acceptance_reply"]
    # The baseline: a pinned host->device copy of one rank's bytes on each GPU, before the
    # restores (so a failed restore still leaves it measured).
    import torch

    per_rank_bytes = max(v["model_bytes"] for v in result["per_rank"].values())
    result["pinned_h2d_gbps"] = {}
    for dev in (0, 1):
        with torch.cuda.device(dev):
            result["pinned_h2d_gbps"][dev] = round(pinned_h2d_gbps(per_rank_bytes), 2)
    restores: list = []
    result["restores"] = restores
    save()
    restore("same-gpus", (0, 1), caps)
    # What restore admission says about swapping these ranks (NCCL on P2P/SHM, as captured).
    result["swap_admission"] = _swap_admission(caps, env)
    save()
    if args.swap_on_sockets:
        # The supported way to move co-located NCCL ranks: capture with NCCL on sockets.
        env.update(NCCL_SOCKETS_ONLY)
        sock = capture("-sockets")
        sock.sort(key=lambda c: c["unit"])
        result["cold_sockets"] = sock[0]["readiness"]
        result["swap_admission_sockets"] = _swap_admission(sock, env)
        restore("sockets-ranks-swapped", (1, 0), sock, tag="-sockets")
    best = restores[0]
    result["summary"] = {
        "cold_ttft_s": result["cold"]["ttft_s"], "restore_ttft_s": best["readiness"]["ttft_s"],
        "restore_over_cold_ttft": round(best["readiness"]["ttft_s"] / result["cold"]["ttft_s"], 4),
        "hydration_gbps_per_rank": {u: round(result["per_rank"][u]["model_bytes"] / p["engine.hydrate"] / 1e9, 2)
                                    for r in restores[:1] for u, p in r["phases"].items() if "engine.hydrate" in p},
    }
    # Rank i hydrated on GPU i in the first (same-GPU) restore.
    result["summary"]["hydration_over_pinned"] = {
        u: round(gbps / result["pinned_h2d_gbps"][int(u.rsplit("-", 1)[1])], 3)
        for u, gbps in result["summary"]["hydration_gbps_per_rank"].items()}
    return emit(result, args.out)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.exit(main())
