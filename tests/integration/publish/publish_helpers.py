"""Helpers of the publication tests (a uniquely named module, importable from the tests and conftest)."""

from __future__ import annotations

import hashlib
import importlib
import json
import sys
from pathlib import Path
from typing import Any

_INTEGRATION = Path(__file__).resolve().parents[1]
if str(_INTEGRATION / "docker_units") not in sys.path:
    sys.path.insert(0, str(_INTEGRATION / "docker_units"))
docker_workload = importlib.import_module("docker_workload")
DockerWorkload = docker_workload.DockerWorkload
CorruptingProxy = docker_workload.integration_module("capsule", "capsule_helpers").CorruptingProxy
WritableHubStandin = docker_workload.integration_module("payload", "hub_standin").WritableHubStandin


class Capture:
    """A docker workload captured once; tests publish and restore its descriptor."""

    def __init__(self, wl: Any, path: Path) -> None:
        self.wl = wl
        self.path = path

    def artifact(self) -> dict:
        return json.loads(self.path.read_text())


def digest_of(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def publish(captured: Capture, repository: str, out: Path):
    """Run ``coldsnap publish`` of the captured descriptor into ``out``."""

    def to(req: dict) -> None:
        req["policy"]["capsule"]["repository"] = repository

    req = captured.wl.request("publish", artifact=captured.path, output=out, mutate=to)
    return captured.wl.run(req)
