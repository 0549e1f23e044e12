"""The execution-environment metadata ansible-builder reads (meta/execution-environment.yml) names
files that exist, and requirements.txt lists the controller's own dependencies."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
# What an execution environment brings itself (ansible-builder leaves these out anyway).
PROVIDED_BY_THE_EE = {"ansible-core", "pyyaml"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0].lower()


def test_metadata_names_existing_files() -> None:
    meta = yaml.safe_load((REPO / "meta" / "execution-environment.yml").read_text())
    assert meta["version"] == 1
    assert set(meta["dependencies"]) == {"python", "system"}
    for name in meta["dependencies"].values():
        assert (REPO / name).is_file(), name


def test_requirements_are_the_controller_dependencies() -> None:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    lines = [ln.split("#")[0].strip() for ln in (REPO / "requirements.txt").read_text().splitlines()]
    listed = {ln for ln in lines if ln}
    assert listed == {d for d in deps if _name(d) not in PROVIDED_BY_THE_EE}
