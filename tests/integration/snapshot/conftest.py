"""Real capture/restore runs of the reference engine through the controller (ansible-runner,
the collection's playbooks, CRIU). Module-scoped captures are shared by several restores."""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.snapshot import environment


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> tuple[Path, dict]:
    from coldsnap_engines.reference.config import PRESETS
    from coldsnap_engines.reference.weights import make_model

    d = tmp_path_factory.mktemp("models") / "reference-tiny"
    return d, make_model(d, PRESETS["tiny"], model_id="coldsnap/reference-tiny")


@pytest.fixture(scope="session")
def env_digest() -> str:
    return environment.compute()


@pytest.fixture(scope="module")
def state_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("state")
