"""One operation at a time per workload on each host, whichever controller started it: a step of another
operation (a second AWX job, another operator's controller) is refused while one runs or while a restore's
eviction waits for its own activation, naming the holder, before it changes anything. Real processes hold
the claim; the kernel drops it with them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import StateLayout
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import claim as claim_mod
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import restore as restore_ops
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.claim import (
    WorkloadBusy,
    claimed,
    release_handover,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.lifecycle import lifecycle_units
from standin_engine import start_engine


def claim_path(state: Path) -> Path:
    return StateLayout(state).host_claim("demo", claim_mod.machine_id())


def request(op_id: str, operation: str = "restore") -> dict:
    return {"id": op_id, "operation": operation, "workload": {"recipe": "demo"},
            "launch": {"runtime": "host", "units": [{"id": "u0", "host": "h1"}]}}


HOLDER = r"""
import json, sys, time
from pathlib import Path
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.claim import claimed
state, op_id, step = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
req = {"id": op_id, "operation": "restore", "workload": {"recipe": "demo"}}
with claimed(state, req, host="h1", step=step) as c:
    if step == "evict":
        c.hand_over()
    print("held", flush=True)
    if step != "evict":
        sys.stdin.read()  # until the test closes our stdin
"""


def hold(state: Path, op_id: str, step: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(state), op_id, step], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


@pytest.fixture
def engine(tmp_path):
    """A running engine of workload 'demo' unit u0 (the stand-in's control API); (state root, process)."""
    state = tmp_path / "state"
    wdir = state / "workloads" / "demo" / "u0"
    wdir.mkdir(parents=True)
    proc = start_engine(wdir)
    try:
        yield state, proc
    finally:
        proc.kill()


def test_a_running_step_of_another_operation_refuses_every_changing_step_and_names_it(engine):
    state, proc = engine
    holder = hold(state, "op-a", "activate")
    try:
        for check_mode in (False, True):
            with pytest.raises(WorkloadBusy) as err:
                lifecycle_units(request("op-b", "stop"), None, host="h1", action="stop", state_root=state,
                                activation_digest="sha256:" + "0" * 64, python=None, check_mode=check_mode)
            msg = err.value.problem
            assert "restore op-a" in msg and f"pid {holder.pid}" in msg and "activate step is running" in msg
            assert "changed nothing" in msg and "coldsnap runs show op-a" in err.value.fix
        with pytest.raises(WorkloadBusy, match="op-a"):
            restore_ops.evict(request("op-b"), {}, host="h1", state_root=state, check_mode=False)
        assert proc.poll() is None, "a refused step stops nothing"
    finally:
        holder.stdin.close()
        holder.wait()
    # the holder is gone: the kernel dropped its claim, the other operation goes on
    out = lifecycle_units(request("op-b", "stop"), None, host="h1", action="stop", state_root=state,
                          activation_digest="sha256:" + "0" * 64, python=None, check_mode=False)
    assert out["changed"] and out["units"][0]["stopped"]["pid"] == proc.pid


def test_an_eviction_hands_the_workload_to_its_own_activation_only(tmp_path):
    state = tmp_path / "state"
    evict = hold(state, "op-a", "evict")  # evicts, hands over, exits
    assert evict.wait() == 0
    with pytest.raises(WorkloadBusy) as err:
        with claimed(state, request("op-b"), host="h1", step="prepare"):
            pass
    assert "evicted the workload" in err.value.problem and "its activation comes next" in err.value.problem
    assert "if its controller is gone, run again after" in err.value.fix
    with pytest.raises(WorkloadBusy):  # check mode says the same, writing nothing
        with claimed(state, request("op-b"), host="h1", step="prepare", check_mode=True):
            pass
    with claimed(state, request("op-a"), host="h1", step="activate"):  # its own activation takes it over
        record = json.loads(claim_path(state).read_text())
        assert record["step"] == "activate" and record["pending_until"] is None
    with claimed(state, request("op-b"), host="h1", step="prepare"):  # and once done, it is free
        pass


def test_a_hand_over_lasts_only_so_long(tmp_path, monkeypatch):
    state = tmp_path / "state"
    with claimed(state, request("op-a"), host="h1", step="evict") as c:
        c.hand_over(seconds=0.2)
    with pytest.raises(WorkloadBusy):
        with claimed(state, request("op-b"), host="h1", step="prepare"):
            pass
    time.sleep(0.3)  # its controller died between evict and activate: the workload is free again
    with claimed(state, request("op-b"), host="h1", step="prepare"):
        pass


def test_check_mode_writes_nothing_and_a_link_is_never_followed(tmp_path):
    state = tmp_path / "state"
    with claimed(state, request("op-a"), host="h1", step="stop", check_mode=True):
        pass
    assert not claim_path(state).exists()
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    StateLayout(state).locks.mkdir(parents=True)
    claim_path(state).symlink_to(target)
    with pytest.raises(Exception, match="symbolic link"):
        with claimed(state, request("op-a"), host="h1", step="stop"):
            pass
    assert target.read_text() == "keep"


def test_the_claim_file_is_private_and_names_the_holder(tmp_path):
    state = tmp_path / "state"
    with claimed(state, request("op-a"), host="h1", step="capture"):
        path = claim_path(state)
        assert path.stat().st_mode & 0o777 == 0o600
        record = json.loads(path.read_text())
        assert record["id"] == "op-a" and record["step"] == "capture" and record["pid"] == os.getpid()
    assert claim_mod.HANDOVER_S >= 60


def test_one_claim_per_machine_whatever_an_inventory_calls_it(tmp_path):
    """Two inventories may name one machine differently (an address, a name): still one claim."""
    state = tmp_path / "state"
    holder = hold(state, "op-a", "activate")  # as host "h1"
    try:
        with pytest.raises(WorkloadBusy, match="restore op-a"):
            with claimed(state, request("op-b"), host="10.0.0.7", step="prepare"):
                pass
    finally:
        holder.stdin.close()
        holder.wait()
    assert claim_path(state).name == f"host-workload-demo@{claim_mod.machine_id()}.claim"


def test_two_runs_of_one_request_are_two_operations(tmp_path):
    """An AWX job launched twice, or one request file in two templates: the same id, two run ids."""
    state = tmp_path / "state"
    with claimed(state, request("op-a"), host="h1", step="evict", run="run-1") as c:
        c.hand_over()
    with pytest.raises(WorkloadBusy, match="its activation comes next"):
        with claimed(state, request("op-a"), host="h1", step="activate", run="run-2"):
            pass
    with pytest.raises(WorkloadBusy):  # nor its "rollback"
        with claimed(state, request("op-a-rollback"), host="h1", step="prepare", run="run-2"):
            pass
    with claimed(state, request("op-a-rollback"), host="h1", step="prepare", run="run-1"):
        pass


def test_a_hand_over_whose_activation_never_ran_is_given_back(tmp_path):
    state = tmp_path / "state"
    with claimed(state, request("op-a"), host="h1", step="evict", run="r1") as c:
        c.hand_over()
    assert not release_handover(state, request("op-b"), host="h1", run="r9"), "only by the run that left it"
    assert not release_handover(state, request("op-a"), host="h1", run="r9")
    before = claim_path(state).read_bytes()
    assert release_handover(state, request("op-a"), host="h1", run="r1", check_mode=True), "check mode says so"
    assert claim_path(state).read_bytes() == before, "and writes nothing"
    assert release_handover(state, request("op-a"), host="h1", run="r1")
    assert not release_handover(state, request("op-a"), host="h1", run="r1", check_mode=True)
    with claimed(state, request("op-b"), host="h1", step="prepare"):
        pass
    assert not release_handover(state, request("op-a"), host="h1", run="r1"), "nothing left to give back"


def test_a_moment_held_claim_is_waited_for_not_refused(tmp_path):
    """A rival's refused attempt or a check-mode probe holds the lock for an instant: a real step waits."""
    state = tmp_path / "state"
    with claimed(state, request("op-a"), host="h1", step="stop"):
        pass
    path = claim_path(state)
    blip = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                             "fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX)\n"
                             "print('held', flush=True); time.sleep(0.5)", str(path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert blip.stdout.readline().strip() == "held"
        with claimed(state, request("op-b"), host="h1", step="stop"):
            pass
    finally:
        blip.wait()


def test_a_hand_over_passes_to_the_restores_rollback_only(tmp_path):
    """The controller rolls a restore back (as ``<id>-rollback``) when it failed after its eviction, maybe
    before its activation took the hand-over: the rollback may take it, nobody else."""
    state = tmp_path / "state"
    assert hold(state, "op-a", "evict").wait() == 0
    with pytest.raises(WorkloadBusy):
        with claimed(state, request("op-a-rollback-2"), host="h1", step="prepare"):
            pass
    with claimed(state, request("op-a-rollback"), host="h1", step="prepare"):
        pass


@pytest.mark.skipif(os.geteuid() != 0, reason="root working in another user's state root")
def test_root_leaves_the_claim_the_state_roots_owners(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.chown(state, 65534, 65534)
    with claimed(state, request("op-a"), host="h1", step="stop"):
        pass
    path = claim_path(state)
    for p in (path, path.parent):
        st = p.stat()
        assert (st.st_uid, st.st_gid) == (65534, 65534), p


def test_a_state_root_another_user_planted_in_a_shared_directory_gets_no_claim(world_writable, tmp_path):
    """The claim is the first thing a lifecycle step writes: it must not write (as root, through their links)
    into a state root another user made in /tmp, and a fresh root it makes is private."""
    planted = world_writable / "root"
    planted.mkdir(mode=0o777)
    os.chown(planted, 65534, 65534)
    for check_mode in (True, False):
        with pytest.raises(ColdSnapError, match=r"belongs to uid 65534"), \
                claimed(planted, request("op-a"), host="h1", step="stop", check_mode=check_mode):
            pass
    assert os.listdir(planted) == []
    fresh = tmp_path / "fresh"
    with claimed(fresh, request("op-a"), host="h1", step="stop"):
        pass
    assert fresh.stat().st_mode & 0o777 == 0o700
