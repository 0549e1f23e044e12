"""Fixtures of the capsule integration tests: one runtime image build per session (cached across runs),
Debian's docker-registry on a free loopback port, and cleanup of every image and container a test made."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from capsule_helpers import build_runtime_image, docker_registry


@pytest.fixture(scope="session")
def runtime_image() -> dict:
    """The ColdSnap runtime image (built once; an unchanged rebuild is a cache hit)."""
    return build_runtime_image()


@pytest.fixture(scope="session")
def base_image() -> dict:
    """The small debootstrap base image (what the runtime image is built FROM)."""
    return build_runtime_image(base_only=True)


@pytest.fixture(scope="package")
def registry(package_tmp) -> Iterator[str]:
    """A writable local registry for these tests (its blobs go when they are done); yields host:port."""
    with docker_registry(package_tmp("registry")) as addr:
        yield addr


@pytest.fixture
def readonly_registry(tmp_path: Path) -> Iterator[str]:
    """A registry in read-only maintenance mode: it serves pulls and rejects every push."""
    with docker_registry(tmp_path / "ro-registry", readonly=True) as addr:
        yield addr


@pytest.fixture
def capture_id() -> str:
    return f"cap-test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def docker_client() -> Iterator[object]:
    """A Docker client; every capsule image labelled with this test's capture ids is removed afterwards."""
    import docker

    client = docker.from_env(timeout=600)
    before = {i.id for i in client.images.list()}
    yield client
    for image in client.images.list(filters={"label": "org.coldsnap.kind=capsule"}):
        if image.id not in before and image.labels.get("org.coldsnap.capture-id", "").startswith("cap-test-"):
            try:
                client.images.remove(image.id, force=True)
            except docker.errors.APIError:
                pass
    for c in client.containers.list(all=True, filters={"label": "org.coldsnap.operation-id=op-capsule-test"}):
        try:
            c.remove(force=True)
        except docker.errors.APIError:
            pass
    client.close()
