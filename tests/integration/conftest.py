"""Fixtures shared by the integration tests: the reference engine's tiny model (made once per
session; no test writes to it), the digest of this host's runtime environment, and a state root
per test module."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import environment


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The reference engine's tiny preset (a few MiB of safetensors): (directory, model info)."""
    from coldsnap_engines.reference.config import PRESETS
    from coldsnap_engines.reference.weights import make_model

    d = tmp_path_factory.mktemp("models") / "reference-tiny"
    return d, make_model(d, PRESETS["tiny"], model_id="coldsnap/reference-tiny")


@pytest.fixture(scope="session")
def env_digest() -> str:
    """This interpreter's environment digest as a capture computes it: in a fresh process, so that what
    earlier tests put on this process's sys.path (an engine's site directory, a probe's metadata) is
    not counted."""
    return environment.of_python(sys.executable)


@pytest.fixture(scope="module")
def state_root(module_tmp) -> Path:
    return module_tmp("state")
