"""Fixtures of the lifecycle unit tests (builders are in lifecycle_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def state_root(tmp_path) -> Path:
    root = tmp_path / "state"
    root.mkdir()
    return root
