"""The reference engine's two-process shape (``--engine-core-process``, like vLLM V1): the API
server loads no torch and holds no model, its child does; either dying takes the other down (a
unit is never half alive); tensor-parallel ranks are refused with the fix."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.process.affinity import format_cpus

pytest.importorskip("torch")

from engines_testlib import REPO, free_port, make_reference_model

sys.path.insert(0, str(REPO / "runtime_image" / "activation"))
from coldsnap_activation import probes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("models") / "reference-tiny"
    make_reference_model(d)
    return d


def _start(model_dir: Path, log: Path, *flags: str, **env_extra) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLDSNAP_")}
    env.update(OMP_NUM_THREADS="1", **env_extra)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "runtime_image" / "integrations"), env.get("PYTHONPATH", "")])
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "coldsnap_engines.reference.server", "--model", str(model_dir),
                                 "--port", str(port), "--device", "cpu", "--engine-core-process", *flags],
                                env=env, stdout=fh, stderr=subprocess.STDOUT)
    return proc, port


def _children(pid: int) -> list[int]:
    return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _gone(pid: int, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as fh:  # a zombie has exited
            if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("who_dies", ["engine core", "API server"])
def test_the_api_server_holds_no_model_and_either_process_dying_ends_both(model_dir, tmp_path, who_dies):
    proc, port = _start(model_dir, tmp_path / "engine.log")
    try:
        probes.wait_http_ready("127.0.0.1", port, "/health", timeout=120, alive=lambda: proc.poll() is None)
        assert probes.stream_completion("127.0.0.1", port, model="", prompt="ColdSnap says:",
                                        max_tokens=16).text == "2VD{D{DDDDDDDDDD"
        (core,) = _children(proc.pid)
        assert "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text()
        assert "libtorch" in Path(f"/proc/{core}/maps").read_text()
        if who_dies == "engine core":
            os.kill(core, signal.SIGKILL)
            assert proc.wait(timeout=20) != 0
            assert "the engine core" in (tmp_path / "engine.log").read_text()
        else:
            proc.kill()
            proc.wait()
            assert _gone(core), "the engine core must not outlive its API server"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_tensor_parallel_ranks_are_refused_with_the_fix(model_dir, tmp_path):
    proc, _port = _start(model_dir, tmp_path / "engine.log", COLDSNAP_WORLD_SIZE="2")
    assert proc.wait(timeout=60) != 0
    assert "--engine-core-process serves one rank" in (tmp_path / "engine.log").read_text()


def _cpus(tid: int) -> str:
    return format_cpus(os.sched_getaffinity(tid))


def test_bind_cpus_pins_the_engine_core_and_leaves_the_api_server_free(model_dir, tmp_path):
    """``--bind-cpus`` (vLLM's CPU worker pins its threads): every thread of the process that runs the
    model, none of the API server's."""
    allowed = sorted(os.sched_getaffinity(0))
    assert len(allowed) >= 2, "pinning is only visible with two CPUs or more (CI has two)"
    proc, port = _start(model_dir, tmp_path / "engine.log", "--bind-cpus", str(allowed[-1]))
    try:
        probes.wait_http_ready("127.0.0.1", port, "/health", timeout=120, alive=lambda: proc.poll() is None)
        assert probes.stream_completion("127.0.0.1", port, model="", prompt="ColdSnap says:",
                                        max_tokens=16).text == "2VD{D{DDDDDDDDDD"
        (core,) = _children(proc.pid)
        assert {_cpus(int(t.name)) for t in Path(f"/proc/{core}/task").iterdir()} == {str(allowed[-1])}
        assert {_cpus(int(t.name)) for t in Path(f"/proc/{proc.pid}/task").iterdir()} == {format_cpus(allowed)}
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("value, says", [("abc", "'abc' is not a CPU number"), ("3-1", "ascending range"),
                                         ("", "non-empty"), ("NOT_ALLOWED", "this process may only run on CPUs")])
def test_bind_cpus_names_what_is_wrong_with_the_list(model_dir, tmp_path, value, says):
    if value == "NOT_ALLOWED":
        value = str(max(os.sched_getaffinity(0)) + 1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLDSNAP_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "runtime_image" / "integrations"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "coldsnap_engines.reference.server", "--model", str(model_dir),
                           "--port", str(free_port()), "--device", "cpu", "--bind-cpus", value],
                          check=False, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
