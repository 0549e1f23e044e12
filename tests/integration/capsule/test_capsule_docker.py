"""Docker capsules: one local image per unit FROM the exact runtime image, state and caches inside,
the model pack and model mounts never."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.build import (
    build_capsule_detailed,
    docker_capsule_name,
    extract_capsule,
    inspect_capsule,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from capsule_helpers import make_state

pytestmark = [pytest.mark.docker, pytest.mark.slow]

TARGET = "/var/lib/coldsnap/captures/x/units/unit-0"
MODEL_MOUNT = "/var/lib/coldsnap/models/reference-tiny"


def _build(tmp_path: Path, capture_id: str, base: str, **over):
    cache = tmp_path / "cache"
    if not cache.exists():
        (cache / "inductor").mkdir(parents=True)
        (cache / "inductor" / "graph.py").write_text("compiled = True\n")
    state = tmp_path / "state" if (tmp_path / "state").exists() else make_state(tmp_path)
    kw = dict(unit="unit-0", capture_id=capture_id, files=state, state_target=TARGET,
              cache_paths=["/root/.cache/vllm/torch_compile_cache"],
              cache_sources={"/root/.cache/vllm/torch_compile_cache": cache}, forbidden_paths=[MODEL_MOUNT],
              layout="docker", base_image=base, oci_root=None,
              labels={"org.coldsnap.operation-id": "op-capsule-test", "org.coldsnap.recipe": "r"})
    kw.update(over)
    return build_capsule_detailed(**kw)


def test_docker_capsule_holds_state_and_caches_but_never_the_pack(tmp_path, capture_id, runtime_image,
                                                                  docker_client):
    base = runtime_image["runtime_image"]
    first = _build(tmp_path, capture_id, base)
    ref = first.ref
    assert first.changed and ref.layout == "docker" and ref.location == docker_capsule_name("unit-0", capture_id)
    image = docker_client.images.get(ref.image_id)
    assert image.labels["org.coldsnap.capsule.base"] == runtime_image["image_id"]
    assert image.labels["org.coldsnap.capture-id"] == capture_id
    assert image.labels["org.coldsnap.unit"] == "unit-0"
    # Built FROM the exact runtime image: its layers plus exactly one state layer.
    base_layers = docker_client.images.get(runtime_image["image_id"]).attrs["RootFS"]["Layers"]
    assert image.attrs["RootFS"]["Layers"][:-1] == base_layers
    assert ref.bytes > 64 * 1024
    assert image.attrs["Config"]["Cmd"] == docker_client.images.get(runtime_image["image_id"]).attrs["Config"]["Cmd"]

    script = (f"cd {TARGET} && find . | sort && stat -c %a tool.sh && "
              "cat /root/.cache/vllm/torch_compile_cache/inductor/graph.py && stat -c %a /root")
    out = docker_client.containers.run(ref.image_id, ["sh", "-c", script], remove=True, network_mode="none").decode()
    listed = out.splitlines()
    assert "./criu/pages-1.img" in listed and "./weights.blob" in listed and "./replay-plan.json" in listed
    assert not any(x.endswith(".pack") for x in listed)
    assert "4755" in listed, "mode bits (set-user-ID included) survive the build"
    assert "compiled = True" in listed
    assert listed[-1] == "700", "existing parents such as /root keep the base image's mode"

    again = _build(tmp_path, capture_id, base)
    assert not again.changed and again.ref.image_id == ref.image_id
    dry = _build(tmp_path, capture_id, base, dry_run=True)
    assert not dry.changed and dry.ref.image_id == ref.image_id

    info = inspect_capsule(ref)
    assert info["state_target"] == TARGET and info["cache_paths"] == ["/root/.cache/vllm/torch_compile_cache"]

    dest = tmp_path / "extracted"
    extract_capsule(ref, dest)
    assert (dest / "weights.blob").read_bytes() == (tmp_path / "state" / "weights.blob").read_bytes()
    # The image keeps the bits (above); an extraction onto a host never does (set-id, sticky, world-write).
    assert stat.S_IMODE(os.stat(dest / "tool.sh").st_mode) == 0o755
    assert not list(dest.glob("*.pack"))


@pytest.mark.parametrize(("cache_path", "message"), [
    (MODEL_MOUNT, "overlaps the unit's mount"),
    ("/root/.cache/huggingface/hub", "Hugging Face"),
])
def test_model_mounts_and_hf_caches_are_refused_before_docker_is_touched(tmp_path, capture_id, runtime_image, *,
                                                                         docker_client, cache_path, message):
    with pytest.raises(ColdSnapError, match=message):
        _build(tmp_path, capture_id, runtime_image["runtime_image"], cache_paths=[cache_path],
               cache_sources={cache_path: tmp_path})
    assert docker_client.images.list(filters={"label": f"org.coldsnap.capture-id={capture_id}"}) == []


def test_a_mutable_base_reference_is_refused(tmp_path, capture_id, runtime_image, docker_client):
    with pytest.raises(ColdSnapError, match="digest"):
        _build(tmp_path, capture_id, "coldsnap-runtime:latest")


def test_a_path_through_a_symlink_of_the_base_is_refused(tmp_path, capture_id, runtime_image, docker_client):
    # Debian's /var/run is a link to /run: a directory entry for it would replace the link and break the image.
    with pytest.raises(ColdSnapError, match="not a directory in the base image"):
        _build(tmp_path, capture_id, runtime_image["runtime_image"], state_target="/var/run/coldsnap/state")
    assert docker_client.images.list(filters={"label": f"org.coldsnap.capture-id={capture_id}"}) == []
