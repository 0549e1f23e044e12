"""Fixtures of the publication tests: the runtime image, one docker capture
shared by the module's tests, Debian's docker-registry on loopback, and the Hub stand-in."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.receipt import validate_receipt
from publish_helpers import Capture, DockerWorkload, digest_of, docker_workload, publish


def registry_cache_root(fallback: Path) -> Path:
    """Where the session registry keeps its blobs between runs.

    The first push of a capsule sends the runtime image's layers (about 1 GB of
    torch); a registry that already holds them answers the daemon's HEAD with
    "exists", so later sessions push only the small capsule layer. Blobs are
    content-addressed, so a kept store cannot make a test pass wrongly.
    """
    base = Path(os.environ.get("COLDSNAP_CACHE_DIR") or ("/var/cache/coldsnap" if os.geteuid() == 0 else fallback))
    root = base / "test-registry"
    try:
        root.mkdir(parents=True, exist_ok=True)
        return root
    except OSError:
        return fallback / "registry"


@pytest.fixture(scope="session")
def runtime_image() -> dict:
    return docker_workload.build_runtime_image()


@pytest.fixture(scope="package")
def registry(package_tmp) -> Iterator[str]:
    """A writable docker-registry on 127.0.0.1 for these tests; yields host:port."""
    with docker_workload.docker_registry(registry_cache_root(package_tmp("registry-fallback"))) as addr:
        yield addr


@pytest.fixture
def readonly_registry(tmp_path: Path) -> Iterator[str]:
    """A registry in read-only maintenance mode: every push is rejected."""
    with docker_workload.docker_registry(tmp_path / "ro-registry", readonly=True) as addr:
        yield addr


@pytest.fixture(scope="package")
def captured(package_tmp, runtime_image, tiny_model) -> Iterator[Capture]:
    recipe = "publishing"
    wl = DockerWorkload(package_tmp("publish-state"), tiny_model, runtime_image["runtime_image"], recipe)
    try:
        res = wl.run(wl.request("capture"))
        assert res.succeeded, res.receipt["error"]
        yield Capture(wl, Path(res.receipt["result"]["operation"]["artifact"]))
    finally:
        docker_workload.remove_workload_objects(recipe)


@pytest.fixture(scope="package")
def published(captured, registry, package_tmp) -> tuple[Path, str]:
    """The captured descriptor published to the session registry: (published descriptor, repository)."""
    repository = f"{registry}/coldsnap/capsules"
    out = package_tmp("published")
    source_before = digest_of(captured.path)
    res = publish(captured, repository, out)
    assert res.succeeded, res.receipt["error"]
    validate_receipt(res.receipt)
    assert res.receipt["replay_semantics"] == "content-idempotent"
    assert digest_of(captured.path) == source_before, "publication never rewrites the accepted descriptor"
    return out / "artifact.json", repository
