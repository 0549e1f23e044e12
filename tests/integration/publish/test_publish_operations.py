"""``coldsnap publish`` end to end: a docker capture's capsule pushed to a real registry (Debian's
docker-registry on loopback), a separate published descriptor, restore pulling the capsule by digest,
a push the registry rejects, and a pull whose bytes do not match."""

from __future__ import annotations

import hashlib
import json
import uuid

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.registry import RegistryClient
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import load_artifact
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.containers import (
    canonical_container_name,
)
from publish_helpers import CorruptingProxy, digest_of, publish

pytestmark = [pytest.mark.docker, pytest.mark.criu, pytest.mark.registry, pytest.mark.slow]


def forget_local_capsule(captured) -> str:
    """Remove the workload's container and the capture host's capsule image: the next restore must pull."""
    import docker

    client = docker.from_env()
    try:
        client.containers.get(canonical_container_name(captured.wl.name, "unit-0")).remove(force=True)
    except docker.errors.NotFound:
        pass
    image_id = captured.artifact()["capsule"]["units"][0]["image_id"]
    try:
        client.images.remove(image_id, force=True)
    except docker.errors.ImageNotFound:
        pass
    return image_id


def test_publish_writes_a_separate_descriptor_with_immutable_digests(captured, published):
    path, repository = published
    source = captured.artifact()
    pub = load_artifact(path.read_bytes())
    assert pub["state"] == "published" and source["state"] == "accepted"
    assert pub["parent"] == digest_of(captured.path)
    (unit,) = pub["capsule"]["units"]
    ref = unit["repository_digest"]
    assert ref.startswith(f"{repository}@sha256:")
    assert unit["image_id"] == source["capsule"]["units"][0]["image_id"]

    # Everything but the capsule section, the state, the parent and the creation time is the source's.
    def strip(a: dict) -> dict:
        return {k: v for k, v in a.items() if k not in ("capsule", "state", "parent", "created_at")}

    assert strip(pub) == strip(source)
    # The digest is the registry's manifest digest, and that manifest names the capsule's config (image id).
    client = RegistryClient(repository)
    manifest = client.get_manifest(ref.split("@", 1)[1], ("application/vnd.docker.distribution.manifest.v2+json",
                                                          "application/vnd.oci.image.manifest.v1+json"),
                                   what="published capsule")
    assert "sha256:" + hashlib.sha256(manifest).hexdigest() == ref.split("@", 1)[1]
    assert json.loads(manifest)["config"]["digest"] == unit["image_id"]


def test_publish_again_is_content_idempotent(captured, published):
    path, repository = published
    before = path.read_bytes()
    res = publish(captured, repository, path.parent)
    assert res.succeeded, res.receipt["error"]
    result = res.receipt["result"]["operation"]
    assert result["changed"] is False
    # Nothing is pushed again: the registry already serves the capsule under its publish tag (the local
    # image keeps no repo digest once the push's tag is removed), so the publish works against a registry
    # that has since turned read-only too; the published descriptor is the same file.
    assert set(result["actions"].values()) == {"present"}, result["actions"]
    assert result["capsules"] == load_artifact(before)["capsule"]["units"]
    assert path.read_bytes() == before


def test_restore_of_the_published_descriptor_pulls_the_assigned_capsule(captured, published):
    import docker

    path, _repository = published
    image_id = forget_local_capsule(captured)
    req = captured.wl.request("restore", artifact=path)
    res = captured.wl.run(req)
    assert res.succeeded, res.receipt["error"]
    accepted = captured.artifact()["acceptance"]["reply"]
    assert res.receipt["result"]["operation"]["units"][0]["reply"] == accepted
    assert captured.wl.complete() == accepted
    ref = load_artifact(path.read_bytes())["capsule"]["units"][0]["repository_digest"]
    image = docker.from_env().images.get(image_id)
    assert ref in image.attrs["RepoDigests"], "the capsule came from the registry, by digest"
    container = captured.wl.container()
    assert container.image.id == image_id and container.status == "running"


def test_a_push_the_registry_rejects_commits_nothing(captured, readonly_registry, tmp_path):
    out = tmp_path / "never"
    res = publish(captured, f"{readonly_registry}/coldsnap/capsules", out)
    assert not res.succeeded
    message = res.receipt["error"]["message"]
    assert "registry refused the push" in message and "nothing was recorded" in message
    assert not (out / "artifact.json").exists()


def test_a_pull_whose_bytes_do_not_match_fails_in_prepare(captured, registry, tmp_path):
    import docker

    with CorruptingProxy(registry, min_bytes=4096) as proxy:
        out = tmp_path / f"via-proxy-{uuid.uuid4().hex[:6]}"
        res = publish(captured, f"{proxy.address}/coldsnap/capsules", out)
        assert res.succeeded, res.receipt["error"]
        image_id = forget_local_capsule(captured)
        res = captured.wl.run(captured.wl.request("restore", artifact=out / "artifact.json"))
        assert not res.succeeded
        assert proxy.corrupted, "the proxy served altered blob bytes"
    error = res.receipt["error"]
    assert "prepare every host" in error["phase"], "the pull fails before anything is evicted"
    assert "pull of capsule" in error["message"]
    client = docker.from_env()
    with pytest.raises(docker.errors.ImageNotFound):
        client.images.get(image_id)
    assert captured.wl.container() is None
