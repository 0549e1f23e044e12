"""Fixtures of the process tests: the CRIU in use (and whether it is ColdSnap's own build), test
processes started and waited for, and killed at teardown whatever the test's outcome."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import criu as criu_mod


@pytest.fixture
def criu_build() -> tuple[criu_mod.Criu, bool]:
    """The CRIU the tests use, and whether it is ColdSnap's build (with the patches of scripts/criu/)."""
    criu = criu_mod.find_criu()
    return criu, criu.coldsnap_build


@pytest.fixture
def reap():
    """``reap(proc_or_pid)``: SIGKILL it (and wait for a Popen) when the test ends."""
    held: list = []
    yield held.append
    for p in reversed(held):
        pid = p if isinstance(p, int) else p.pid
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if not isinstance(p, int):
            p.wait(timeout=30)


@pytest.fixture
def spawn_ready(tmp_path, reap):
    """``spawn_ready(script, what)``: run the Python ``script`` in a session of its own, with the path of
    a JSON file as its argument; wait (60 s at most) until it writes that file (it is ready then) and
    return (its Popen, the file's JSON). Killed at teardown."""

    def spawn(script: str, what: str) -> tuple[subprocess.Popen, dict]:
        info_file = tmp_path / f"{what.replace(' ', '-')}.json"
        proc = subprocess.Popen([sys.executable, "-c", script, str(info_file)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                cwd="/")
        reap(proc)
        deadline = time.time() + 60
        while not info_file.exists():
            assert proc.poll() is None, f"the {what} died before it was ready"
            assert time.time() < deadline, f"the {what} did not get ready in 60 s"
            time.sleep(0.05)
        return proc, json.loads(info_file.read_text())

    return spawn
