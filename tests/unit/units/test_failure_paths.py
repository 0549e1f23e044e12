"""When a step goes wrong nothing is lost: eviction ends every engine of the workload, one whose control
API stalls too, before any of its control files goes (an engine left running without its file could
never be stopped or replaced); a failed step keeps its own error when the clean-up after it fails too."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import UnitError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import engine_control as ec
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.host_runtime import HostRuntime
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.runtime import raise_failures
from standin_engine import start_engine


def test_an_engine_whose_control_api_stalls_is_evicted_with_the_others(tmp_path: Path) -> None:
    state = tmp_path / "state"
    wdir = state / "workloads" / "demo" / "u0"
    wdir.mkdir(parents=True)
    request = {"id": "op1", "workload": {"recipe": "demo"}, "launch": {"units": [{"id": "u0", "host": "h1"}]}}
    procs = {w: start_engine(wdir, w, stall=str(tmp_path / f"stall-{w}")) for w in ("w0", "w1")}
    stranger = wdir / ec.CONTROL_FILE_NAME.format(worker="w9")  # a stale file whose pid is someone else's
    stranger.write_text(json.dumps({"port": 1, "token": "t" * 64, "pid": os.getpid()}))
    try:
        rt = HostRuntime(request, host="h1", state_root=state)
        assert sorted(rt.evicted_ids()) == sorted(p.pid for p in procs.values())  # what prepare lets hold ports
        (tmp_path / "stall-w1").touch()  # w1 stops answering between prepare and eviction
        stopped = rt.evict(check_mode=False)
        assert sorted(stopped[0]["pids"]) == sorted(p.pid for p in procs.values())
        for p in procs.values():
            p.wait(10)
        assert list(wdir.glob("control-*.json")) == []
        assert rt.presence("u0") == "stopped"
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()


def test_a_failed_docker_step_keeps_its_own_error_when_giving_the_state_back_fails_too(monkeypatch) -> None:
    """The engine's error (its last log lines) is what the user must see; a failure to give the state
    back to the invoking user afterwards is added to it, never put in its place."""
    import pytest
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import UnitError
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units import docker_runtime, docker_units
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units.ownership import parse_owner

    def broken(*_a, **_k):
        raise RuntimeError("dockerd is not answering")

    monkeypatch.setattr(docker_units, "normalize_ownership", broken)
    rt = object.__new__(docker_runtime.DockerRuntime)
    rt.state_root, rt.owner = Path("/nonexistent"), parse_owner("4242:4242")
    owned = [Path("/nonexistent/captures/c1")]
    with pytest.raises(UnitError) as exc:
        try:
            raise UnitError("unit unit-0: the engine exited: CUDA out of memory", fix="read its log")
        finally:
            rt._hand_back(owned, None, payloads=True)
    assert "CUDA out of memory" in str(exc.value) and "dockerd is not answering" in str(exc.value)
    with pytest.raises(RuntimeError, match="dockerd"):
        rt._hand_back(owned, None, payloads=True)  # on its own, the failure is reported as it is


def test_a_failed_units_error_names_it_once_and_the_root_cause_comes_first():
    results = [{"unit": "unit-1", "ok": False, "error": "stopped because another unit failed"},
               {"unit": "unit-0", "ok": False, "error": "unit unit-0: the engine does not listen on port 8000"},
               {"unit": "unit-2", "ok": False, "error": "health check timed out"},
               {"unit": "unit-3", "ok": True}]
    with pytest.raises(UnitError) as err:
        raise_failures(results)
    assert err.value.problem == ("unit unit-0: the engine does not listen on port 8000; "
                                 "unit unit-2: health check timed out; "
                                 "unit unit-1: stopped because another unit failed")
