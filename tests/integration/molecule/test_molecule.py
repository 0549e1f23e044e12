"""Molecule scenarios of the roles (extensions/molecule/): `molecule test -s <name>` on real containers.

The containers run the ColdSnap base image that runtime_image/build.py produces locally
(debootstrap + ``docker import``; cached, so a repeat takes a fraction of a second). It is
tagged ``coldsnap-molecule:<id>`` and handed to the scenarios as ``COLDSNAP_MOLECULE_IMAGE``;
the scenarios set ``pre_build_image: true``, so nothing is built or pulled by Molecule.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCENARIOS = REPO / "extensions" / "molecule"
VENV_BIN = Path(sys.executable).parent

pytestmark = [pytest.mark.docker, pytest.mark.slow]


@pytest.fixture(scope="module")
def molecule_image() -> str:
    """The locally built base image, tagged for Molecule (built on first use, then cached)."""
    r = subprocess.run([sys.executable, str(REPO / "runtime_image" / "build.py"), "--base-only"],
                       capture_output=True, text=True, timeout=1800, check=False)
    assert r.returncode == 0, f"base image build failed:\n{r.stderr[-3000:]}"
    image_id = json.loads(r.stdout)["base_image_id"]
    tag = f"coldsnap-molecule:{image_id.split(':', 1)[1][:12]}"
    subprocess.run(["docker", "tag", image_id, tag], check=True, capture_output=True, timeout=60)
    return tag


def _collections_path() -> str:
    """The collections path holding this checkout as coldsnap.fleet (what the controller uses)."""
    from coldsnap._collection import collection_root

    return str(collection_root())


def run_molecule(scenario: str, image: str, **env: str) -> subprocess.CompletedProcess:
    """``molecule test -s scenario`` from the collection root with the virtualenv's tools on PATH."""
    full_env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
                "ANSIBLE_COLLECTIONS_PATH": _collections_path(), "COLDSNAP_MOLECULE_IMAGE": image,
                "ANSIBLE_FORCE_COLOR": "0", "NO_COLOR": "1", "PY_COLORS": "0", **env}
    return subprocess.run([str(VENV_BIN / "molecule"), "test", "-s", scenario], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=600, check=False)


def _assert_full_sequence(p: subprocess.CompletedProcess, scenario: str) -> None:
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    for action in ("create", "converge", "idempotence", "verify", "destroy"):
        # "➜" on a terminal, ">" otherwise
        assert re.search(rf"^{scenario} \S+ {action}: Executed: Successful", out, re.M), \
            f"{action} did not run:\n{out[-3000:]}"


def test_scenarios_declare_the_full_sequence() -> None:
    from yaml import safe_load

    names = sorted(p.parent.name for p in SCENARIOS.glob("*/molecule.yml"))
    assert {"coldsnap_host", "coldsnap_coordinator"} <= set(names)
    for name in names:
        config = safe_load((SCENARIOS / name / "molecule.yml").read_text())
        assert config["driver"]["name"] == "docker"
        assert all(p["pre_build_image"] for p in config["platforms"]), name
        sequence = config["scenario"]["test_sequence"]
        assert sequence.index("converge") < sequence.index("idempotence") < sequence.index("verify"), name
        assert config["prerun"] is False, f"{name}: prerun installs a stale copy into ~/.ansible/collections"


def test_coldsnap_host(molecule_image: str) -> None:
    p = run_molecule("coldsnap_host", molecule_image)
    _assert_full_sequence(p, "coldsnap_host")


def test_coldsnap_coordinator(molecule_image: str, tmp_path: Path) -> None:
    artifacts = tmp_path / "descriptors"
    artifacts.mkdir()
    p = run_molecule("coldsnap_coordinator", molecule_image, COLDSNAP_MOLECULE_ARTIFACTS=str(artifacts))
    _assert_full_sequence(p, "coldsnap_coordinator")
    descriptors = {f.parent.name: json.loads(f.read_text()) for f in artifacts.glob("*/descriptor.json")}
    assert set(descriptors) == {"coldsnap-molecule-coord-a", "coldsnap-molecule-coord-b"}
    tokens = {d["token"] for d in descriptors.values()}
    assert len(tokens) == 1  # the second host got the coordinator's descriptor
    token = tokens.pop()
    assert len(token) >= 32
    assert token not in p.stdout and token not in p.stderr, "the coordinator token leaked into Molecule's output"
