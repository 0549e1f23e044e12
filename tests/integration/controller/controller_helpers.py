"""Helpers of the controller's integration tests (real ansible-runner runs against localhost).

A uniquely named module rather than conftest.py: ``from conftest import`` would pick whichever
conftest module was imported first when the whole suite runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PLAYBOOKS = REPO / "tests" / "fixtures" / "playbooks"
REQUEST = REPO / "tests" / "fixtures" / "requests" / "capture-reference.json"
ENV_TOKEN = "envtok-7fa9c3e1d2b4a6f8"  # a fake credential in the controller's environment
SECRET_VAR = "sekret-0b1c2d3e4f5a6978"  # a fake credential passed as a secret extra var


def request_for(operation: str = "capture", **changes) -> dict:
    """The fixture request, turned into ``operation`` (restore-like operations name an artifact)."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request

    req = json.loads(REQUEST.read_text())
    req["operation"] = operation
    if operation != "capture":
        req["artifact"] = {"path": "/var/lib/coldsnap/artifacts/fixture/artifact.json"}
    req.update(changes)
    return validate_request(req)


def local_inventory(**extra_hosts: dict) -> dict:
    """localhost through the local connection with this Python, plus any extra hosts."""
    hosts = {"localhost": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}}
    hosts.update(extra_hosts)
    return {"all": {"hosts": hosts}}


def all_files(root: Path) -> list[Path]:
    """Every regular file below ``root`` (symlinks are not followed: project/ points at the repo)."""
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()
            and not any(part == "project" for part in p.relative_to(root).parts)]


def read_ndjson(path: Path) -> list[dict]:
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.timing import parse_ndjson

    return parse_ndjson(path.read_text())
