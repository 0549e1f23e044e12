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
