"""Fixtures of the docker launch-unit tests: the runtime image (one build per session, cached across
runs) and cleanup of every container and capsule image they made."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from docker_workload import build_runtime_image, remove_workload_objects


@pytest.fixture(scope="session")
def runtime_image() -> dict:
    """The ColdSnap runtime image (runtime_image/build.py; an unchanged rebuild is a cache hit)."""
    return build_runtime_image()


@pytest.fixture(scope="module")
def recipes() -> Iterator[list[str]]:
    """Recipe names a test module used; their containers and capsule images are removed afterwards."""
    used: list[str] = []
    yield used
    for recipe in used:
        remove_workload_objects(recipe)
