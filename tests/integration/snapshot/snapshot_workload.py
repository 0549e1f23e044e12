"""The snapshot tests' workload harness: one workload (recipe) on localhost, its requests,
controller runs and engines. Kept out of conftest.py so test modules import it by a unique name."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from netports import free_port  # pylint: disable=unused-import

import coldsnap  # noqa: F401  # pylint: disable=unused-import
from coldsnap.demo import reference_request
from coldsnap.runner import operation_extravars, run_playbook


class Workload:
    """One workload (recipe) on localhost: its requests, runs and engines."""

    def __init__(self, state_root: Path, model: tuple[Path, dict], env_digest: str, tp: int, name: str) -> None:
        self.state_root = state_root
        self.model_dir, self.ident = model
        self.env_digest = env_digest
        self.tp = tp
        self.port = free_port()
        self.name = name
        self.counter = 0

    def request(self, operation: str, *, artifact: Path | None = None, mutate=None) -> dict:
        self.counter += 1
        op_id = f"{self.name}-{operation}-{self.counter}"
        req = reference_request(operation=operation, op_id=op_id, model_dir=self.model_dir, model=self.ident,
                                port=self.port, state_root=self.state_root, env_digest=self.env_digest,
                                artifact=artifact, tp=self.tp, threads=1,
                                artifact_dir=(self.state_root / "artifacts" / op_id) if operation == "capture" else None)
        req["workload"]["recipe"] = self.name
        if mutate is not None:
            mutate(req)
        return req

    def run(self, req: dict, *, prepare_only: bool = False, envvars: dict | None = None, secrets: dict | None = None,
            live: bool = False):
        """One operation (``live``: the long steps run as async jobs with live progress, as on a terminal)."""
        extravars = operation_extravars(req, prepare_only=prepare_only, state_root=self.state_root)
        return run_playbook(operation=req["operation"], request=req, playbook=f"coldsnap.fleet.{req['operation']}",
                            extravars={**extravars, "coldsnap_live_progress": live},
                            inventory=None, state_root=self.state_root, prepare_only=prepare_only,
                            envvars=envvars, secret_extravars=secrets)

    def engines(self) -> list[int]:
        pids = []
        for f in (self.state_root / "workloads" / self.name).glob("*/control-*.json"):
            try:
                pid = json.loads(f.read_text())["pid"]
                os.kill(pid, 0)
                pids.append(pid)
            except (OSError, ValueError, KeyError):
                pass
        return pids

    def stop(self) -> None:
        for pid in self.engines():
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while self.engines() and time.monotonic() < deadline:
            time.sleep(0.1)

    def complete(self, prompt: str = "ColdSnap says:", max_tokens: int = 16, *, port: int | None = None) -> str:
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", port or self.port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": prompt, "max_tokens": max_tokens}),
                     headers={"Content-Type": "application/json"})
        body = json.loads(conn.getresponse().read())
        conn.close()
        return body["choices"][0]["text"]


def units_of(receipt: dict) -> list[dict]:
    return receipt["result"]["operation"]["units"]
