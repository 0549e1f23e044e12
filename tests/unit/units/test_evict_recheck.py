"""The restore's evict step checks again, right before it kills, what prepare checked: the captured pids and
the ports the listeners come back on. Only what the eviction ends may hold them; a stranger that took one
after prepare passed is refused, naming it and the fix, with nothing evicted. Real processes and sockets;
runtime docker with its container lookups stood in for."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import AdmissionError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import new_evidence
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import ports
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import docker_runtime, host_units
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.host_runtime import HostRuntime
from standin_engine import start_engine

STRANGER = ("import socket,sys,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); print('up', flush=True); time.sleep(120)")

REQUEST = {"id": "op1", "workload": {"recipe": "demo"}, "launch": {"units": [{"id": "u0", "host": "h1"}]}}
ARTIFACT = {"capture_id": "cap1", "capsule": {"units": [{"unit": "u0", "image_id": "sha256:" + "ab" * 32}]}}


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _i in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def stranger(port: int) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", STRANGER, str(port)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"
    return p


def captured(pid: int, listeners: list[tuple[str, int]], tids: list[int] | None = None) -> dict:
    ev = new_evidence(operation="capture", operation_id="cap1", capture_id="cap1", unit="u0", host="h1",
                      workers=[{"worker": "w0", "pid": pid, "tids": tids or [pid], "listeners": listeners}],
                      readiness=None, reply=None, reply_sha256=None, logprobs=None, logprobs_check=None,
                      timing={"spans": [], "marks": [], "t0_ns": 0}, ok=True)
    return ev


def served(worker: dict) -> list[tuple[str, int]]:
    """Where a worker's listeners come back: where they were captured."""
    return [(str(a), int(p)) for a, p in worker["listeners"]]


@pytest.fixture
def unmoved(monkeypatch):
    """Listeners come back where they were captured (the placement itself is tested elsewhere)."""
    def unmoved_listeners(_artifact, _request, _unit):
        return served, "captured listening port"
    monkeypatch.setattr(host_units, "listeners_served", unmoved_listeners)
    monkeypatch.setattr(docker_runtime, "listeners_served", unmoved_listeners)


@pytest.fixture
def engine(tmp_path):
    """A running engine of workload 'demo' unit u0 serving on a port; (state root, its process, its port)."""
    state = tmp_path / "state"
    wdir = state / "workloads" / "demo" / "u0"
    wdir.mkdir(parents=True)
    port = free_ports(1)[0]
    proc = start_engine(wdir, port=port)
    try:
        yield state, proc, port
    finally:
        proc.kill()


def write_evidence(state: Path, ev: dict) -> None:
    unit_dir = state / "captures" / "cap1" / "units" / "u0"
    unit_dir.mkdir(parents=True, exist_ok=True)
    (unit_dir / "evidence.json").write_text(json.dumps(ev))


def test_the_shared_check_lets_the_replaced_workload_hold_what_it_frees_and_names_a_stranger():
    port, = free_ports(1)
    holder = stranger(port)
    try:
        workers = [{"worker": "w0", "pid": holder.pid, "tids": [holder.pid], "listeners": [["127.0.0.1", port]]}]
        ports.require_restorable(workers, unit="u0", served=served, replaced={holder.pid})  # the one evicted
        with pytest.raises(AdmissionError) as err:  # in prepare: as before
            ports.require_restorable(workers, unit="u0", served=served, pids=False)
        assert f"127.0.0.1:{port} is taken on this host by pid {holder.pid}" in err.value.problem
        assert ports.TAKEN_AFTER_PREPARE not in err.value.problem and err.value.fix == ports.RESTORE_PORT_FIX
        with pytest.raises(AdmissionError) as err:  # in the evict step: saying that nothing was evicted
            ports.require_restorable(workers, unit="u0", served=lambda _w: [], at_evict=True)
        assert f"captured pid {holder.pid} is in use" in err.value.problem, err.value.problem
        assert err.value.problem.endswith(f"({ports.TAKEN_AFTER_PREPARE})") and "docker runtime" in err.value.fix
    finally:
        holder.kill()
        holder.wait()


def test_the_host_evict_step_refuses_a_stranger_that_took_a_port_or_pid_after_prepare(engine, unmoved):
    state, proc, serving = engine
    other, = free_ports(1)
    rt = HostRuntime(REQUEST, host="h1", state_root=state)
    # The running engine holds the captured pid and serving port: it is what the eviction ends.
    write_evidence(state, captured(proc.pid, [("127.0.0.1", serving), ("127.0.0.1", other)]))
    rt.require_restorable(ARTIFACT, check_mode=False)
    holder = stranger(other)  # a stranger binds a captured port after prepare passed
    try:
        for check_mode in (False, True):
            with pytest.raises(AdmissionError) as err:
                rt.require_restorable(ARTIFACT, check_mode=check_mode)
            assert f"127.0.0.1:{other} is taken on this host by pid {holder.pid}" in err.value.problem
            assert "nothing was evicted" in err.value.problem and "restore onto another port" in err.value.fix
        # ... or a captured thread id
        write_evidence(state, captured(proc.pid, [("127.0.0.1", serving)], tids=[proc.pid, holder.pid]))
        with pytest.raises(AdmissionError, match=rf"captured pid {holder.pid} is in use .*nothing was evicted"):
            rt.require_restorable(ARTIFACT, check_mode=False)
    finally:
        holder.kill()
        holder.wait()
    assert proc.poll() is None, "a refusal kills nothing"
    assert rt.engine_pids("u0") == [proc.pid]


def test_the_host_evict_step_without_the_captured_state_refuses_but_in_check_mode(engine, unmoved):
    state, proc, _serving = engine
    rt = HostRuntime(REQUEST, host="h1", state_root=state)
    rt.require_restorable(ARTIFACT, check_mode=True)  # a check-mode prepare extracted nothing: not checked
    with pytest.raises(AdmissionError, match=r"captured state cannot be read .*nothing was evicted"):
        rt.require_restorable(ARTIFACT, check_mode=False)
    assert proc.poll() is None


def test_the_docker_evict_step_refuses_a_stranger_on_a_port_but_not_the_replaced_container(monkeypatch, unmoved):
    port, = free_ports(1)
    holder = stranger(port)
    in_container: set[int] = set()
    ev = captured(os.getpid(), [("127.0.0.1", port)])  # a live pid: a docker unit has its own pid namespace
    monkeypatch.setattr(docker_runtime, "canonical_container", lambda *_a, **_k: SimpleNamespace(status="running"))
    monkeypatch.setattr(docker_runtime, "_container_pids", lambda _c: set(in_container))
    monkeypatch.setattr(docker_runtime, "capsule_image", lambda *_a, **_k: (SimpleNamespace(id="sha256:img"), "/s"))
    monkeypatch.setattr(docker_runtime, "captured_evidence", lambda *_a, **_k: ev)
    rt = docker_runtime.DockerRuntime(REQUEST, host="h1", state_root="/nonexistent", client=object())
    try:
        with pytest.raises(AdmissionError) as err:
            rt.require_restorable(ARTIFACT, check_mode=True)
        assert f"127.0.0.1:{port} is taken on this host by pid {holder.pid}" in err.value.problem
        assert "nothing was evicted" in err.value.problem
        in_container.add(holder.pid)  # the running unit container holds it: its removal frees it
        rt.require_restorable(ARTIFACT, check_mode=False)
    finally:
        holder.kill()
        holder.wait()


def test_the_host_evict_step_ends_a_unit_of_the_workload_the_restore_places_elsewhere(engine):
    """Ranks swapped between hosts: u0 runs here and the restore places u1 here, u0 on another host. The old u0
    is this workload's engine too: prepare counts what it holds as freed, and the evict step ends it (left
    running, it would serve the replaced generation beside the restored one, out of reach of status and stop)."""
    state, proc, serving = engine
    swapped = {"id": "op2", "workload": {"recipe": "demo"},
               "launch": {"units": [{"id": "u0", "host": "h2"}, {"id": "u1", "host": "h1"}]}}
    rt = HostRuntime(swapped, host="h1", state_root=state)
    assert proc.pid in rt.evicted_ids()
    ports.require_ports_free([("127.0.0.1", serving)], unit="u1", replaced=rt.evicted_ids())
    assert rt.evict(check_mode=True) == [{"unit": "u0", "pid": proc.pid, "pids": [proc.pid], "processes": 1}]
    assert proc.poll() is None, "check mode kills nothing"
    stopped = rt.evict(check_mode=False)
    assert [s["unit"] for s in stopped] == ["u0"]
    proc.wait(10)
    assert not list((state / "workloads" / "demo" / "u0").glob("control-*.json"))
    # a workload directory without a control file (a stopped unit) is nothing to end
    assert rt.units_here() == ["u1"] and rt.evict(check_mode=False) == []


def test_the_docker_evict_step_ends_the_container_of_a_unit_the_restore_places_elsewhere(monkeypatch, tmp_path):
    """The same swap on runtime docker: u0's canonical container runs here, the restore places u1 here and u0 on
    another host. Prepare and the evict step's check count its processes as freed, and the evict step removes it
    (check mode names it and removes nothing)."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units import docker_units

    removed: list[str] = []
    old_u0 = SimpleNamespace(id="c-u0", name="coldsnap-demo-u0", status="running", attrs={"Image": "sha256:old"},
                             remove=lambda force: removed.append("c-u0"))
    here = {"u0": old_u0}
    monkeypatch.setattr(docker_units, "canonical_container", lambda _r, uid, client: here.get(uid))
    monkeypatch.setattr(docker_units, "container_exists", lambda _c, cid: cid not in removed)
    swapped = {"id": "op2", "workload": {"recipe": "demo"},
               "launch": {"units": [{"id": "u0", "host": "h2"}, {"id": "u1", "host": "h1"}]}}
    rt = docker_runtime.DockerRuntime(swapped, host="h1", state_root=tmp_path, client=object())
    assert rt.units_here() == ["u1", "u0"]
    expected = [{"unit": "u0", "container": "coldsnap-demo-u0", "status": "running", "image": "sha256:old"}]
    assert rt.evict(check_mode=True) == expected and removed == []
    assert rt.evict(check_mode=False) == expected and removed == ["c-u0"]
    here.clear()
    assert rt.units_here() == ["u1"] and rt.evict(check_mode=False) == []


def test_a_colliding_container_of_another_workload_never_fails_a_unit_placed_elsewhere(monkeypatch, tmp_path):
    """Canonical names can collide (recipe a-b unit c, recipe a unit b-c): another workload's container under the
    name of a unit this restore places on another host is not this workload's. The step of this host goes on;
    only a unit placed here is refused for it."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units import docker_units

    def lookup(_r, uid, client):
        if uid == "u0":
            raise AdmissionError("container coldsnap-demo-u0 belongs to another workload")

    monkeypatch.setattr(docker_units, "canonical_container", lookup)
    swapped = {"id": "op2", "workload": {"recipe": "demo"},
               "launch": {"units": [{"id": "u0", "host": "h2"}, {"id": "u1", "host": "h1"}]}}
    rt = docker_runtime.DockerRuntime(swapped, host="h1", state_root=tmp_path, client=object())
    assert rt.units_here() == ["u1"]
    assert rt.evict(check_mode=True) == []
    placed_here = docker_runtime.DockerRuntime(swapped, host="h2", state_root=tmp_path, client=object())
    with pytest.raises(AdmissionError):
        placed_here.evict(check_mode=True)
