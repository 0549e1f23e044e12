"""Capture and restore of the reference engine on a GPU: CUDA VMM weights released before the
CUDA checkpoint and CRIU dump, re-mapped at the same address and hydrated on restore."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.criu]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(tmp_path: Path, model_dir: Path, ident: dict, port: int, *, workers: int, flags: list[str],
             env: dict, driver: str = "n610") -> dict:
    """A capture request for the reference engine on GPUs 0..workers-1: one unit, ``workers`` ranks."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request

    return validate_request({
        "format": 4, "kind": "coldsnap-operation-request", "operation": "capture", "id": "gpu-test",
        "snapshot_driver": {"id": driver}, "output": {"artifact_dir": str(tmp_path / "artifact")},
        "launch": {"engine": "reference", "runtime": "host",
                   "model": {"id": ident["id"], "revision": ident["revision"],
                             "source": {"kind": "local-safetensors", "path": str(model_dir)}},
                   "units": [{"id": "unit-0", "index": 0, "host": "localhost", "devices": list(range(workers)),
                              "command": [sys.executable, "-m", "coldsnap_engines.reference.server", "--model",
                                          str(model_dir), "--port", str(port), "--device", "cuda", *flags],
                              "environment": {"PYTHONPATH": os.environ.get("PYTHONPATH", ""), **env},
                              "environment_digest": "sha256:" + "0" * 64,
                              "mounts": [{"source": str(model_dir), "target": str(model_dir)}]}],
                   "execution": {"workers": [{"id": f"worker-{r}", "unit": "unit-0", "rank": r, "device_slot": r}
                                             for r in range(workers)],
                                 "groups": [{"kind": "tensor", "workers": [f"worker-{r}" for r in range(workers)]}],
                                 "services": [{"id": "api", "unit": "unit-0", "port": port}],
                                 "adapter": {"schema": "reference-v1", "digest": "sha256:" + "1" * 64,
                                             "payload": {"tp": workers}}}},
        "policy": {"weights": {"native": {"materialize": "off"}}},
        "validation": {"prompt": "ColdSnap says:", "max_tokens": 8},
        "workload": {"recipe": "gpu-test"},
    })


@pytest.mark.parametrize(("provider", "compiled", "engine_core", "driver"),
                         [("native", False, False, "n610"), ("recovery", False, False, "n610"),
                          ("native", True, False, "n610"), ("native", False, True, "n610"),
                          ("native", False, False, "n580"), ("recovery", False, False, "n580")],
                         ids=["native", "recovery", "native-compiled", "native-engine-core-process",
                              "n580-template-native", "n580-template-recovery"])
def test_gpu_capture_restore(tmp_path, provider, compiled, engine_core, driver, native_fill_built):  # noqa: PLR0917
    """With ``--compile`` the TorchInductor graphs built at start-up must serve the restored
    process as they are: no recompilation after the restore (TORCH_LOGS=recompiles). With
    ``--engine-core-process`` (vLLM V1's shape) CUDA lives in the unit's child process only: the
    CUDA checkpoint and restore act on it, not on the API server. Under n580 the image is the
    context-free template (no CUDA state in it); the restore creates CUDA and the weight
    allocations on this host's driver and hydrates them. The engine core pins its threads to one
    CPU (``--bind-cpus``, as vLLM's workers do): they are pinned again after the restore."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.cpulist import format_cpus
    from ansible_collections.coldsnap.fleet.plugins.module_utils.process import affinity
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units import activation_stage as activation
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units import specs as unit
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units.host_units import run_units
    from coldsnap_engines.reference.config import PRESETS
    from coldsnap_engines.reference.weights import make_model

    model_dir = tmp_path / "model"
    ident = make_model(model_dir, PRESETS["small"], model_id="coldsnap/reference-small")
    state = tmp_path / "state"
    req = _request(tmp_path, model_dir, ident, _port(), workers=1,
                   flags=[*(["--compile"] if compiled else []),
                          *(["--engine-core-process", "--bind-cpus", str(max(os.sched_getaffinity(0)))]
                            if engine_core else [])],
                   env={"TORCH_LOGS": "recompiles"} if compiled else {}, driver=driver)
    digest, _adir, _staged = activation.stage(Path(__file__).resolve().parents[2] / "runtime_image" / "activation", state)
    cap = run_units(unit.build_specs(req, host="localhost", operation="capture", capture_id="c",
                                               state_root=state), state_root=state, activation_digest=digest)[0]
    w = cap["workers"][0]
    if driver == "n580":  # dumped as a template: no CUDA context, nothing on the GPU
        assert w["cuda"] is False and w["cuda_pids"] == []
        assert not w["memory_at_checkpoint"].get("gpu_used_mib")
    else:
        assert w["cuda"] is True
        assert (w["cuda_pids"] != [w["pid"]] and len(w["cuda_pids"]) == 1) if engine_core else \
            w["cuda_pids"] == [w["pid"]]
        # The weights were released before the checkpoint: GPU memory in use is far below the model + context.
        assert w["memory_at_checkpoint"]["gpu_used_mib"] * (1 << 20) < 2 * (1 << 30)
        assert w["memory_serving"]["gpu_used_mib"] > w["memory_at_checkpoint"]["gpu_used_mib"], w
        if provider == "native" and not compiled and not engine_core:
            _refused_while_another_process_fills_the_gpu(req, cap)
    pack = w["payload"]["pack"]
    weights = {"model_dir": str(model_dir), "materialize": "off", "workers": {"worker-0": {
        "provider": provider,
        "pack": {"path": str(state / pack["path"]), "sha256": pack["sha256"], "size": pack["size"]}
        if provider == "native" else None}}}
    rreq = {**req, "id": f"gpu-test-{provider}"}
    ev = run_units(unit.build_specs(rreq, host="localhost", operation="restore", capture_id="c",
                                    state_root=state, weights=weights,
                                    validation={**req["validation"], "expected": cap["acceptance_reply"],
                                                "expected_logprobs": cap["logprobs"]}),
                   state_root=state, activation_digest=digest)[0]
    try:
        assert ev["reply"] == cap["acceptance_reply"]
        # The restored engine computes the accepted log-probabilities bit for bit on the same GPU.
        assert cap["logprobs"]["top"] == 5 and ev["logprobs_check"] == "identical", ev["logprobs"]
        log = (state / "workloads" / "gpu-test" / "unit-0" / "target.log").read_text().splitlines()
        assert json.loads(log[0])["provider"] == provider
        assert json.loads(log[0]).get("template", False) is (driver == "n580")
        hydrate = [s["attrs"] for s in ev["timing"]["spans"] if s["name"] == "engine.hydrate"]
        assert [h["fill"] for h in hydrate] == ["native" if native_fill_built else "python"], hydrate
        if engine_core:
            pins = w["affinity"]["threads"]
            assert pins and set(pins.values()) == {str(max(os.sched_getaffinity(0)))}, w["affinity"]
            step = next(s for s in ev["timing"]["spans"] if s["name"] == "unit.criu.restore")
            assert step["attrs"]["affinity"]["pinned"] == len(pins), step["attrs"]
            for tid, cpus in pins.items():
                if Path(f"/proc/{tid}").exists():
                    assert format_cpus(affinity.thread_cpus(int(tid))) == cpus
        if compiled:  # the log was reset before the dump: these are the restored process's lines
            assert not [line for line in log if "ecompil" in line], log
    finally:
        os.kill(ev["workers"][0]["pid"], signal.SIGKILL)
        time.sleep(0.5)


FILLER = r"""
import sys, time, torch
leave, held = int(sys.argv[1]) << 20, []
while True:  # fill the GPU until at most `leave` bytes are free (its own context takes some too)
    free, _total = torch.cuda.mem_get_info()
    if free <= leave:
        break
    try:
        held.append(torch.empty(max(min(free - leave, 1 << 30), 1 << 20), dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError:
        break
print("up", flush=True)
time.sleep(600)
"""


def _refused_while_another_process_fills_the_gpu(req: dict, cap: dict) -> None:
    """Prepare's GPU-memory admission with nvidia-smi's real figures: a process that leaves less free than
    the capture held serving is named, and the unit fits again once it is gone."""
    import subprocess

    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import AdmissionError
    from ansible_collections.coldsnap.fleet.plugins.module_utils.process.gpu_memory import gpu_memory
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units.admission import GpuRoom

    def admit(replaced: set[int]) -> list[dict]:
        room = GpuRoom(req, gpu_memory())
        room.add({"id": "unit-0", "devices": [0]}, cap)
        return room.admit("localhost", replaced=replaced)

    fits = admit(set())
    assert fits and fits[0]["needed_mib"] == cap["workers"][0]["memory_serving"]["gpu_used_mib"], fits
    filler = subprocess.Popen([sys.executable, "-c", FILLER, str(fits[0]["needed_mib"] // 4)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert filler.stdout.readline().strip() == "up"
        with pytest.raises(AdmissionError) as err:
            admit(set())
        assert f"pid {filler.pid} (" in err.value.problem and "nothing was evicted" in err.value.problem, \
            err.value.problem
        assert admit({filler.pid}), "what the workload being replaced holds counts as free: the eviction frees it"
    finally:
        filler.kill()
        filler.wait()
    deadline = time.monotonic() + 30
    while True:  # its memory is given back a moment after it exits
        try:
            assert admit(set())
            break
        except AdmissionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_gpu_unit_with_two_ranks(tmp_path, native_fill_built):
    """vLLM's in-process tensor parallelism in shape: one unit holding two NCCL ranks on two GPUs. The
    unit's CUDA processes are locked and checkpointed together (both ranks), restored together and
    only then unlocked; the reply and log-probabilities are the captured ones."""
    import torch
    from ansible_collections.coldsnap.fleet.plugins.module_utils.coord import daemon
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units import activation_stage as activation
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units import specs as unit
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units.host_units import run_units
    from coldsnap_engines.reference.config import PRESETS
    from coldsnap_engines.reference.weights import make_model

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two NVIDIA GPUs")
    model_dir = tmp_path / "model"
    ident = make_model(model_dir, PRESETS["small"], model_id="coldsnap/reference-small")
    state = tmp_path / "state"
    req = _request(tmp_path, model_dir, ident, _port(), workers=2, flags=[],
                   env={"NCCL_SOCKET_IFNAME": "lo", "NCCL_NVLS_ENABLE": "0",
                        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})
    digest, _adir, _staged = activation.stage(Path(__file__).resolve().parents[2] / "runtime_image" / "activation", state)

    def run(request: dict, operation: str, **kw) -> dict:
        ep = state / "runs" / request["id"] / "coordinator.json"
        daemon.start_coordinator(ep, scope=request["id"])
        try:
            [ev] = run_units(unit.build_specs(request, host="localhost", operation=operation, state_root=state,
                                              capture_id="c", coordinator_endpoint=str(ep), **kw),
                             state_root=state, activation_digest=digest)
        finally:
            daemon.stop_coordinator(ep)
        return ev

    cap = run(req, operation="capture")
    assert [w["worker"] for w in cap["workers"]] == ["worker-0", "worker-1"]
    assert all(w["cuda"] and w["cuda_pids"] == [w["pid"]] for w in cap["workers"])
    weights = {"model_dir": str(model_dir), "materialize": "off", "workers": {
        w["worker"]: {"provider": "native", "pack": {"path": str(state / w["payload"]["pack"]["path"]),
                                                     "sha256": w["payload"]["pack"]["sha256"],
                                                     "size": w["payload"]["pack"]["size"]}}
        for w in cap["workers"]}}
    ev = run({**req, "id": "gpu-test-two-ranks"}, operation="restore", weights=weights,
             validation={**req["validation"], "expected": cap["acceptance_reply"],
                         "expected_logprobs": cap["logprobs"]})
    try:
        assert ev["reply"] == cap["acceptance_reply"]
        assert ev["logprobs_check"] == "identical", ev["logprobs"]
        assert sorted(w["pid"] for w in ev["workers"]) == sorted(w["pid"] for w in cap["workers"])
        restored = [s for s in ev["timing"]["spans"] if s["name"] == "unit.cuda.restore"]
        assert len(restored) == 1, "one CUDA restore step for the whole unit"
    finally:
        for w in ev["workers"]:
            os.kill(w["pid"], signal.SIGKILL)
        time.sleep(0.5)
