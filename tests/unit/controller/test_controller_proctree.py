"""Cancelling stops ansible-playbook's whole tree, also workers in sessions of their own."""

from __future__ import annotations

import subprocess
import sys
import time

from coldsnap.runner.proctree import _alive, descendants, find_child, terminate_tree

# A child that starts a grandchild in a new session (as ansible-core's workers are),
# prints the grandchild's pid and waits.
SPAWNER = (
    "import subprocess, sys, time\n"
    "g = subprocess.Popen(['sleep', '47.913'], start_new_session=True)\n"
    "print(g.pid, flush=True)\n"
    "time.sleep(60)\n"
)


def test_terminate_tree_reaches_other_sessions() -> None:
    child = subprocess.Popen([sys.executable, "-c", SPAWNER, "proctree-marker"], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        assert descendants(child.pid) == [child.pid, grandchild]
        assert find_child("proctree-marker") == child.pid
        assert terminate_tree(child.pid, grace_s=5) == 2
        child.wait(timeout=10)
        deadline = time.monotonic() + 5
        while _alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(grandchild)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_terminate_tree_of_a_gone_process_is_a_no_op() -> None:
    p = subprocess.Popen(["true"])
    p.wait()
    assert terminate_tree(p.pid) == 0


def _fake_playbook(bindir, run_dir, collection):
    """A process named ansible-playbook, started as ansible-runner starts one: in the run's ``project``
    (a link to the collection) with the run's artifact directory in its environment."""
    import os

    (run_dir / "artifacts" / "ident").mkdir(parents=True)
    (run_dir / "project").symlink_to(collection, target_is_directory=True)
    env = {**os.environ, "AWX_ISOLATED_DATA_DIR": str(run_dir / "artifacts" / "ident")}
    return subprocess.Popen([str(bindir / "ansible-playbook"), "-c", "import time; time.sleep(60)"],
                            cwd=run_dir / "project", env=env)


def test_playbooks_in_sees_only_its_own_runs_playbook(tmp_path) -> None:
    """Every run's project links to the same collection: another run's playbook (another workload or state
    root) is not this run's orphan, or one operation would refuse to start while any other one runs."""
    from coldsnap.runner.proctree import playbooks_in

    bindir, collection = tmp_path / "bin", tmp_path / "collection"
    bindir.mkdir()
    collection.mkdir()
    (bindir / "ansible-playbook").symlink_to(sys.executable)
    mine, other, idle = (tmp_path / n / "runs" / "op" for n in ("a", "b", "c"))
    procs = [_fake_playbook(bindir, mine, collection), _fake_playbook(bindir, other, collection)]
    idle.mkdir(parents=True)
    (idle / "project").symlink_to(collection, target_is_directory=True)
    try:
        deadline = time.monotonic() + 10
        while len(playbooks_in(mine / "project")) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert playbooks_in(mine / "project") == [procs[0].pid]
        assert playbooks_in(other / "project") == [procs[1].pid]
        assert playbooks_in(idle / "project") == []
    finally:
        for p in procs:
            p.kill()
            p.wait()
