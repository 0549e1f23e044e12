"""The runtime image: a locally produced, digest-pinned base plus the capture-sensitive runtime."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from capsule_helpers import build_runtime_image

pytestmark = [pytest.mark.docker, pytest.mark.slow]

PINNED_TORCH = next(line.split("==")[1].strip() for line in
                    (Path(__file__).resolve().parents[3] / "runtime_image" / "requirements.txt").read_text().splitlines()
                    if line.startswith("torch=="))


def _run(client, image_id: str, script: str) -> str:
    out = client.containers.run(image_id, ["sh", "-c", script], remove=True, network_mode="none")
    return out.decode()


def test_runtime_image_carries_the_pinned_runtime_and_not_the_activation_runtime(runtime_image, docker_client):
    image = docker_client.images.get(runtime_image["image_id"])
    labels = image.labels
    assert labels["org.coldsnap.kind"] == "runtime"
    assert labels["org.coldsnap.inputs"] == runtime_image["inputs"]
    assert labels["org.coldsnap.base"] == runtime_image["base_image_id"]
    assert labels["org.coldsnap.criu.version"] == runtime_image["criu_version"]
    assert runtime_image["runtime_image"] == "coldsnap-runtime@" + image.id

    base = docker_client.images.get(runtime_image["base_image_id"])
    assert len(base.attrs["RootFS"]["Layers"]) == 1, "the base is one imported debootstrap layer"
    assert base.labels["org.coldsnap.kind"] == "base"

    out = _run(docker_client, image.id, (
        "criu --version | head -1; "
        "python3 -c 'import torch, numpy, safetensors; print(torch.__version__, numpy.__version__, "
        "safetensors.__version__)'; "
        "python3 -c 'import ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.build as b; "
        "print(b.__file__)'; "
        "ls -A /opt/coldsnap/activation | wc -l; cat /opt/coldsnap/runtime.json"))
    lines = out.splitlines()
    assert lines[0] == f"Version: {runtime_image['criu_version']}"
    manifest = json.loads("\n".join(lines[4:]))
    locked_torch = next(r.split()[0].split("==")[1] for r in manifest["requirements"] if r.startswith("torch=="))
    running = lines[1].split()[0]  # PyPI's CUDA builds report e.g. 2.13.0+cu130 for the lock's 2.13.0
    assert running == locked_torch or ("+" not in locked_torch and running.startswith(locked_torch + "+")), (
        f"the image runs torch {running}, not the locked {locked_torch}")
    # The pinned release, as the CPU build where one exists for the base's Python (else PyPI's build).
    assert locked_torch in (PINNED_TORCH, PINNED_TORCH.removesuffix("+cpu"))
    assert lines[2] == "/opt/coldsnap/site/ansible_collections/coldsnap/fleet/plugins/module_utils/capsule/build.py"
    assert lines[3] == "0", "the activation runtime is mounted per host, never baked in"
    assert manifest["inputs"] == runtime_image["inputs"]
    assert manifest["criu"]["sha256"] == labels["org.coldsnap.criu.sha256"]
    assert any(r.startswith(f"torch=={locked_torch} --hash=sha256:") for r in manifest["requirements"])


def test_unchanged_inputs_rebuild_from_cache(runtime_image):
    again = build_runtime_image()
    if again["inputs"] != runtime_image["inputs"]:
        pytest.skip("the working tree changed between the two builds (another edit landed meanwhile)")
    assert again["cached"] is True and again["base_cached"] is True
    assert again["image_id"] == runtime_image["image_id"]
    assert "runtime_build_s" not in again["timings"] and "debootstrap_s" not in again["timings"]
