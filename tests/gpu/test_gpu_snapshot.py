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


@pytest.mark.parametrize(("provider", "compiled", "engine_core"),
                         [("native", False, False), ("recovery", False, False), ("native", True, False),
                          ("native", False, True)],
                         ids=["native", "recovery", "native-compiled", "native-engine-core-process"])
def test_gpu_capture_restore(tmp_path, provider, compiled, engine_core, native_fill_built):
    """With ``--compile`` the TorchInductor graphs built at start-up must serve the restored
    process as they are: no recompilation after the restore (TORCH_LOGS=recompiles). With
    ``--engine-core-process`` (vLLM V1's shape) CUDA lives in the unit's child process only: the
    CUDA checkpoint and restore act on it, not on the API server."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units import activation_stage as activation
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units import specs as unit
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units.host_units import run_units
    from coldsnap_engines.reference.config import PRESETS
    from coldsnap_engines.reference.weights import make_model

    model_dir = tmp_path / "model"
    ident = make_model(model_dir, PRESETS["small"], model_id="coldsnap/reference-small")
    state = tmp_path / "state"
    port = _port()
    req = validate_request({
        "format": 4, "kind": "coldsnap-operation-request", "operation": "capture", "id": "gpu-test",
        "snapshot_driver": {"id": "n610"}, "output": {"artifact_dir": str(tmp_path / "artifact")},
        "launch": {"engine": "reference", "runtime": "host",
                   "model": {"id": ident["id"], "revision": ident["revision"],
                             "source": {"kind": "local-safetensors", "path": str(model_dir)}},
                   "units": [{"id": "unit-0", "index": 0, "host": "localhost", "devices": [0],
                              "command": [sys.executable, "-m", "coldsnap_engines.reference.server", "--model",
                                          str(model_dir), "--port", str(port), "--device", "cuda",
                                          *(["--compile"] if compiled else []),
                                          *(["--engine-core-process"] if engine_core else [])],
                              "environment": {"PYTHONPATH": os.environ.get("PYTHONPATH", ""),
                                              **({"TORCH_LOGS": "recompiles"} if compiled else {})},
                              "environment_digest": "sha256:" + "0" * 64,
                              "mounts": [{"source": str(model_dir), "target": str(model_dir)}]}],
                   "execution": {"workers": [{"id": "worker-0", "unit": "unit-0", "rank": 0, "device_slot": 0}],
                                 "services": [{"id": "api", "unit": "unit-0", "port": port}],
                                 "adapter": {"schema": "reference-v1", "digest": "sha256:" + "1" * 64}}},
        "policy": {"weights": {"native": {"materialize": "off"}}},
        "validation": {"prompt": "ColdSnap says:", "max_tokens": 8},
        "workload": {"recipe": "gpu-test"},
    })
    digest, _adir, _staged = activation.stage(Path(__file__).resolve().parents[2] / "runtime_image" / "activation", state)
    cap = run_units(unit.build_specs(req, host="localhost", operation="capture", capture_id="c",
                                               state_root=state), state_root=state, activation_digest=digest)[0]
    w = cap["workers"][0]
    assert w["cuda"] is True
    assert (w["cuda_pids"] != [w["pid"]] and len(w["cuda_pids"]) == 1) if engine_core else w["cuda_pids"] == [w["pid"]]
    # The weights were released before the checkpoint: GPU memory in use is far below the model + context.
    assert w["memory_at_checkpoint"]["gpu_used_mib"] * (1 << 20) < 2 * (1 << 30)
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
        hydrate = [s["attrs"] for s in ev["timing"]["spans"] if s["name"] == "engine.hydrate"]
        assert [h["fill"] for h in hydrate] == ["native" if native_fill_built else "python"], hydrate
        if compiled:  # the log was reset before the dump: these are the restored process's lines
            assert not [line for line in log if "ecompil" in line], log
    finally:
        os.kill(ev["workers"][0]["pid"], signal.SIGKILL)
        time.sleep(0.5)
