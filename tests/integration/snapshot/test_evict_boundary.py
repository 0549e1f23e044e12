"""The evict step checks again what prepare checked (fault 18), with real CRIU and a running workload:
prepare may pass minutes before the eviction (other hosts preparing, weights downloaded), and a
stranger that takes a captured pid, the captured port or the port a restore moves the listeners to in
between would make the restore fail after the running workload was killed. The evict step refuses
instead, naming the holder and the fix, and the running workload keeps serving; check mode says the
same and kills nothing."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from module_runner import run_module
from netports import another_free_port, free_port_in, squatting
from snapshot_workload import Workload, units_of
from test_faults import _spawn_with_pid
from test_placement import on_port

from coldsnap.runner import operation_extravars, run_playbook

pytestmark = [pytest.mark.criu, pytest.mark.slow]

UNIT, WORKER = "unit-0", "worker-0"
PREPARE_TASK = "Prepare the restore"  # roles/coldsnap_restore/tasks/main.yml, phase prepare
EVICT_TASK = "Evict this workload's running engines on the host"  # tasks/activate.yml, phase evict
NOTHING_EVICTED = "nothing was evicted"


def evidence(state_root: Path, art: dict) -> dict:
    return json.loads((state_root / "captures" / art["capture_id"] / "units" / UNIT / "evidence.json").read_text())


def serving_address(ev: dict, port: int) -> str:
    return next(a for a, p in ev["workers"][0]["listeners"] if p == port)


@pytest.fixture(scope="module")
def running(state_root, tiny_model, env_digest):
    """Two captures of one workload (A, B), and A running on another port than the captured one (so
    that A's captured port and B's captured pids are free while it runs)."""
    wl = Workload(state_root, tiny_model, env_digest, tp=1, name="evict-boundary")
    arts = []
    for _capture in ("a", "b"):
        cap = wl.run(wl.request("capture"))
        assert cap.succeeded, cap.receipt["error"]
        path = Path(cap.receipt["result"]["operation"]["artifact"])
        arts.append((path, json.loads(path.read_text())))
    captured_port, moved = wl.port, another_free_port(wl.port)
    res = wl.run(wl.request("restore", artifact=arts[0][0], mutate=on_port(moved)))
    assert res.succeeded, res.receipt["error"]
    wl.port = moved  # where it serves now: status, stop and the checks below use it
    assert wl.complete() == arts[0][1]["acceptance"]["reply"]
    try:
        yield wl, captured_port, arts
    finally:
        wl.stop()


def prepared(wl: Workload, req: dict) -> None:
    """The restore's prepare step passed on every host (the controller's --prepare-only run)."""
    res = wl.run(req, prepare_only=True)
    assert res.succeeded, res.receipt["error"]


def evict_step(wl: Workload, req: dict, art: dict, *extra: str) -> dict:
    """The restore's evict step, as tasks/activate.yml runs it."""
    return run_module("unit_restore", {"phase": "evict", "request": req, "artifact": art, "host": "localhost",
                                       "state_root": str(wl.state_root)}, *extra)


def still_serving(wl: Workload, pids: list[int], reply: str) -> None:
    assert pids and wl.engines() == pids, "the evict step must refuse before killing anything"
    assert wl.complete() == reply


def test_a_stranger_on_the_captured_port_after_prepare_is_refused_by_the_evict_step(running, state_root):
    wl, captured_port, arts = running
    path, art = arts[0]
    pids = wl.engines()
    req = wl.request("restore", artifact=path, mutate=on_port(captured_port))  # back onto the captured port
    prepared(wl, req)
    with squatting(serving_address(evidence(state_root, art), captured_port), captured_port) as squatter:
        out = evict_step(wl, req, art)
        assert out.get("failed"), out
        msg = out["msg"]
        assert f":{captured_port} is taken" in msg and f"pid {squatter.pid}" in msg, msg
        assert "restore onto another port" in msg, "the fix prepare names"
        assert NOTHING_EVICTED in msg, msg
        assert "stopped" not in out, out
        still_serving(wl, pids, art["acceptance"]["reply"])


def test_a_stranger_in_a_captured_pid_after_prepare_is_refused_by_the_evict_step(running, state_root):
    wl, captured_port, arts = running
    path, art = arts[1]  # capture B: its pids are not the running workload's
    pids = wl.engines()
    req = wl.request("restore", artifact=path, mutate=on_port(captured_port))
    prepared(wl, req)
    pid = evidence(state_root, art)["workers"][0]["pid"]
    assert not Path(f"/proc/{pid}").exists()
    squatter = _spawn_with_pid(pid)
    try:
        out = evict_step(wl, req, art)
        assert out.get("failed"), out
        assert f"captured pid {pid} is in use on this host by 'sleep'" in out["msg"], out["msg"]
        assert "stop that process, or use the docker runtime" in out["msg"] and NOTHING_EVICTED in out["msg"]
        still_serving(wl, pids, arts[0][1]["acceptance"]["reply"])
    finally:
        squatter.kill()
        squatter.wait()


def test_check_mode_of_the_evict_step_reports_the_refusal_and_kills_nothing(running, state_root):
    wl, captured_port, arts = running
    path, art = arts[0]
    pids = wl.engines()
    req = wl.request("restore", artifact=path, mutate=on_port(captured_port))
    checked = evict_step(wl, req, art, "--check")  # no stranger: what a real run would stop
    assert not checked.get("failed") and checked["changed"], checked
    assert [(s["unit"], s["pids"]) for s in checked["stopped"]] == [(UNIT, pids)]
    with squatting(serving_address(evidence(state_root, art), captured_port), captured_port) as squatter:
        out = evict_step(wl, req, art, "--check")
        assert out.get("failed") and f"pid {squatter.pid}" in out["msg"], out
    still_serving(wl, pids, art["acceptance"]["reply"])


def test_a_restore_whose_moved_port_a_stranger_takes_after_prepare_keeps_the_workload(running, state_root):
    """The whole restore through the controller: a stranger binds the port the restore moves the service
    to right after this host's prepare passed. The evict step refuses, the receipt says the workload that
    ran before is untouched, and it keeps serving; once the stranger is gone the same restore succeeds."""
    wl, captured_port, arts = running
    path, art = arts[0]
    pids = wl.engines()
    target = free_port_in(p for p in range(max(1024, captured_port - 400), min(65535, captured_port + 400) + 1)
                          if p not in (captured_port, wl.port))
    addr = serving_address(evidence(state_root, art), captured_port)
    strangers: list[subprocess.Popen] = []

    def after_prepare(event: dict) -> None:
        data = event.get("event_data") or {}
        if event.get("event") == "runner_on_ok" and str(data.get("task", "")).startswith(PREPARE_TASK) \
                and not strangers:
            s = subprocess.Popen([sys.executable, "-c", (
                "import socket,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
                f"s.bind(({addr!r}, {target})); s.listen(); print('up', flush=True); time.sleep(120)")],
                stdout=subprocess.PIPE, text=True)
            strangers.append(s)
            assert s.stdout.readline().strip() == "up"

    req = wl.request("restore", artifact=path, mutate=on_port(target))
    try:
        res = run_playbook(operation="restore", request=req, playbook="coldsnap.fleet.restore",
                           extravars={**operation_extravars(req, state_root=wl.state_root),
                                      "coldsnap_live_progress": False},
                           inventory=None, state_root=wl.state_root, event_handler=after_prepare)
        assert strangers, "the stranger started after prepare passed"
        assert not res.succeeded
        err = res.receipt["error"]
        assert err["task"] == EVICT_TASK, err
        assert f"{addr}:{target} is taken" in err["message"] and f"pid {strangers[0].pid}" in err["message"], err
        assert "restore onto another port" in err["message"] and NOTHING_EVICTED in err["message"], err
        record = res.receipt["result"]["eviction"]
        assert record["previous_workload"] == "untouched" and record["evicted"] is False, record
        still_serving(wl, pids, art["acceptance"]["reply"])
    finally:
        for s in strangers:
            with contextlib.suppress(OSError):
                s.kill()
            s.wait()
    again = wl.run(wl.request("restore", artifact=path, mutate=on_port(target)))
    assert again.succeeded, again.receipt["error"]
    wl.port = target
    assert units_of(again.receipt)[0]["served"]["port"] == target
    assert wl.complete() == art["acceptance"]["reply"]


def test_a_second_controllers_steps_are_refused_between_this_restores_eviction_and_activation(running, state_root):
    """Two controllers (two AWX job templates, two operators) share no controller lock: the host's claim
    on the workload refuses the other one's steps once this restore evicted, until its activation (and
    while any of its steps runs: tests/unit/units/test_host_claim.py), naming it; this restore then
    completes, and the other one may go on afterwards."""
    wl, _captured_port, arts = running
    path, art = arts[0]
    req = wl.request("restore", artifact=path, mutate=on_port(wl.port))
    other = wl.request("restore", artifact=path, mutate=on_port(wl.port))  # another controller's restore
    prepared(wl, req)
    out = evict_step(wl, req, art)
    assert not out.get("failed") and out["stopped"], out
    refusals = [evict_step(wl, other, art), evict_step(wl, other, art, "--check"),
                run_module("unit_lifecycle", {"state": "stopped", "request": other, "host": "localhost",
                                              "activation_digest": "sha256:" + "0" * 64,
                                              "state_root": str(wl.state_root)})]
    for out in refusals:
        assert out.get("failed"), out
        assert f"is being changed by another operation: restore {req['id']}" in out["msg"], out["msg"]
        assert "its activation comes next" in out["msg"] and "changed nothing" in out["msg"], out["msg"]
    res = wl.run(req)  # the same restore goes on: its own steps take the hand-over
    assert res.succeeded, res.receipt["error"]
    assert wl.complete() == art["acceptance"]["reply"]
    pids = wl.engines()
    out = evict_step(wl, other, art, "--check")  # and once it ended, the other one may go on
    assert not out.get("failed") and [s["pids"] for s in out["stopped"]] == [pids], out


def test_a_hand_over_no_activation_took_is_given_back_by_the_release_playbook(running, state_root):
    """A restore cancelled between its eviction and its activation (its playbook's ``always`` never ran)
    left the evict step's hand-over: the next restore was refused for two minutes. The controller's
    release run (``playbooks/release.yml``, as ``<id>-release`` with the restore's run id) gives it back
    on the host; the next restore then goes on at once and serves the same reply."""
    import ansible_runner

    from coldsnap.runner import rollback
    from coldsnap.runner.driver import RunConfig, release_runner

    wl, _captured_port, arts = running
    path, art = arts[0]
    req = wl.request("restore", artifact=path, mutate=on_port(wl.port))
    prepared(wl, req)
    out = run_module("unit_restore", {"phase": "evict", "request": req, "artifact": art, "host": "localhost",
                                      "state_root": str(wl.state_root), "run_id": "run-7"})
    assert not out.get("failed") and out["stopped"], out
    nxt = wl.request("restore", artifact=path, mutate=on_port(wl.port))
    refused = evict_step(wl, nxt, art, "--check")
    assert refused.get("failed") and "its activation comes next" in refused["msg"], refused
    config = RunConfig.build(operation="restore", request=req, playbook=None,
                             extravars={"coldsnap_run_id": "run-7", "coldsnap_live_progress": False},
                             inventory=None, state_root=wl.state_root)
    lines: list[str] = []
    said = rollback.give_back(config, build=RunConfig.build, say=lines.append,
                              release=release_runner(ansible_runner))
    assert said == "given back", said
    assert lines == [f"giving back the workload restore {req['id']} evicted (no rollback follows)"]
    receipt = json.loads((wl.state_root / "runs" / f"{req['id']}-release" / "receipt.json").read_text())
    assert receipt["state"] == "succeeded", receipt["error"]
    res = wl.run(nxt)  # at once: nothing holds the workload
    assert res.succeeded, res.receipt["error"]
    assert wl.complete() == art["acceptance"]["reply"]
