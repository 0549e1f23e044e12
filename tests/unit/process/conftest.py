"""Fixtures of the process tests: the CRIU in use (and whether it is ColdSnap's own build), and
processes killed at teardown whatever the test's outcome."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import criu as criu_mod


@pytest.fixture
def criu_build() -> tuple[criu_mod.Criu, bool]:
    """The CRIU the tests use, and whether it is ColdSnap's build (scripts/install-system.sh, with the
    patches of scripts/criu/), which says so in its version."""
    criu = criu_mod.find_criu()
    out = subprocess.run([criu.binary, "--version"], check=True, capture_output=True, text=True).stdout
    return criu, "GitID: coldsnap-" in out


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
