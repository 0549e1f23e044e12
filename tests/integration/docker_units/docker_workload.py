"""Runtime ``docker`` workloads of the reference engine, driven through the real controller.

A uniquely named module (not conftest.py) so the docker-unit and publish tests
can both import it. It mirrors tests/integration/snapshot's Workload: requests
come from ``coldsnap.demo.reference_request`` and playbooks run through
``coldsnap.runner.run_playbook``; the units carry the runtime image built by
runtime_image/build.py instead of an environment digest.
"""

from __future__ import annotations

import importlib
import json
import os
import pwd
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request
from netports import free_port  # pylint: disable=unused-import

from coldsnap.demo import reference_request
from coldsnap.runner import operation_extravars, run_playbook

REPO = Path(__file__).resolve().parents[3]


def integration_module(area: str, name: str) -> Any:
    """Import a helper module of another integration test directory (e.g. capsule/capsule_helpers)."""
    where = str(REPO / "tests" / "integration" / area)
    if where not in sys.path:
        sys.path.insert(0, where)
    return importlib.import_module(name)


def build_runtime_image() -> dict:
    """runtime_image/build.py through the capsule tests' helper (cached: an unchanged rebuild is instant)."""
    return integration_module("capsule", "capsule_helpers").build_runtime_image()


def docker_registry(root: Path, *, readonly: bool = False) -> Any:
    """Debian's docker-registry on loopback (the capsule tests' helper); a context manager yielding host:port."""
    return integration_module("capsule", "capsule_helpers").docker_registry(root, readonly=readonly)


class DockerWorkload:
    """One docker workload (recipe) on localhost: its requests and runs."""

    def __init__(self, state_root: Path, model: tuple[Path, dict], image: str, name: str, *,
                 owner: tuple[int, int] | None = None, tp: int = 1) -> None:
        self.state_root = state_root
        self.tp = tp
        self.model_dir, self.ident = model
        self.image = image
        self.name = name
        self.port = free_port()
        self.owner = owner
        self.counter = 0

    def request(self, operation: str, *, artifact: Path | None = None, output: Path | None = None,
                mutate=None) -> dict:
        self.counter += 1
        op_id = f"{self.name}-{operation}-{self.counter}-{uuid.uuid4().hex[:6]}"
        publish = operation in ("publish", "publish-native")
        # A publish request is a restore request of the same workload plus an output directory.
        req = reference_request(operation="restore" if publish else operation,
                                op_id=op_id, model_dir=self.model_dir, model=self.ident, port=self.port,
                                state_root=self.state_root, env_digest="sha256:" + "0" * 64, artifact=artifact,
                                threads=1, tp=self.tp,
                                artifact_dir=(self.state_root / "artifacts" / op_id) if operation == "capture"
                                else None)
        req["operation"] = operation
        req["launch"]["runtime"] = "docker"
        for u in req["launch"]["units"]:
            u.pop("environment_digest", None)
            u["image"] = self.image
        req["workload"]["recipe"] = self.name
        if publish:
            req["output"] = {"artifact_dir": str(output or (self.state_root / "artifacts" / op_id))}
        if mutate is not None:
            mutate(req)
        return validate_request(req)

    def run(self, req: dict, *, prepare_only: bool = False, extravars: dict | None = None,
            secrets: dict | None = None, envvars: dict | None = None):
        extra = dict(extravars or {})
        if self.owner is not None:
            extra.setdefault("coldsnap_owner", f"{self.owner[0]}:{self.owner[1]}")
        extra.update(operation_extravars(req, prepare_only=prepare_only, state_root=self.state_root))
        return run_playbook(operation=req["operation"], request=req,
                            playbook=f"coldsnap.fleet.{req['operation'].replace('-', '_')}",
                            extravars=extra, inventory=None, state_root=self.state_root,
                            prepare_only=prepare_only, secret_extravars=secrets, envvars=envvars)

    def container(self, unit: str = "unit-0") -> Any:
        import docker
        from ansible_collections.coldsnap.fleet.plugins.module_utils.units.containers import (
            canonical_container_name,
        )

        client = docker.from_env()
        try:
            return client.containers.get(canonical_container_name(self.name, unit))
        except docker.errors.NotFound:
            return None

    def stop(self) -> None:
        c = self.container()
        if c is not None:
            c.remove(force=True)

    def complete(self, prompt: str = "ColdSnap says:", max_tokens: int = 16, *, port: int | None = None) -> str:
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", port or self.port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": prompt, "max_tokens": max_tokens}),
                     headers={"Content-Type": "application/json"})
        body = json.loads(conn.getresponse().read())
        conn.close()
        return body["choices"][0]["text"]


class throwaway_user:  # lower case: a context manager used like a function
    """An unprivileged user created with useradd for the test and removed afterwards."""

    def __init__(self) -> None:
        self.name = f"csnap{uuid.uuid4().hex[:8]}"
        self.uid = self.gid = -1

    def __enter__(self) -> throwaway_user:
        subprocess.run(["useradd", "--system", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin",
                        self.name], check=True, capture_output=True)
        pw = pwd.getpwnam(self.name)
        self.uid, self.gid = pw.pw_uid, pw.pw_gid
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["userdel", self.name], check=False, capture_output=True)


def not_owned(paths: list[Path], uid: int, gid: int) -> list[str]:
    """Every entry at or below ``paths`` not owned by uid:gid (symlinks themselves)."""
    bad = []
    for root in paths:
        if not os.path.lexists(root):
            continue
        for p in [root, *root.rglob("*")]:
            st = os.lstat(p)
            if (st.st_uid, st.st_gid) != (uid, gid):
                bad.append(f"{p} ({st.st_uid}:{st.st_gid})")
    return bad


def remove_workload_objects(recipe: str) -> None:
    """Remove the containers and capsule images of ``recipe`` (test cleanup)."""
    import docker

    client = docker.from_env()
    for c in client.containers.list(all=True, filters={"label": f"org.coldsnap.recipe={recipe}"}):
        try:
            c.remove(force=True)
        except docker.errors.APIError:
            pass
    for image in client.images.list(filters={"label": "org.coldsnap.kind=capsule"}):
        if image.labels.get("org.coldsnap.recipe") == recipe:
            try:
                client.images.remove(image.id, force=True)
            except docker.errors.APIError:
                pass
    client.close()
