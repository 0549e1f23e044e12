"""An engine whose control API lives in a child process is found from the process its launcher started:
the oldest ancestor carrying the same control-file variable, never a process outside the engine."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.proctree import marked_root, process_tree

import coldsnap  # noqa: F401  # pylint: disable=unused-import

CHILD = "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
        "print(p.pid, flush=True); time.sleep(60)"


def _start(env: dict) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD], env={**os.environ, **env}, stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    # A vfork()ed child's pid is known before the kernel has laid out its new environment: until then
    # /proc/<pid>/environ reads empty. Wait for it (a launcher's engine is long past that point).
    deadline = time.monotonic() + 10
    while not Path(f"/proc/{child}/environ").read_bytes() and time.monotonic() < deadline:
        time.sleep(0.001)
    return proc, child


def _end(proc: subprocess.Popen, child: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(child, signal.SIGKILL)
    proc.kill()
    proc.wait()


def test_the_root_is_the_launched_process_not_its_launcher():
    proc, child = _start({"COLDSNAP_CONTROL_FILE": "/run/x/control-worker-0.json"})
    try:
        assert marked_root(child, "COLDSNAP_CONTROL_FILE") == proc.pid  # this test process has no such variable
        assert marked_root(proc.pid, "COLDSNAP_CONTROL_FILE") == proc.pid
        assert process_tree(marked_root(child, "COLDSNAP_CONTROL_FILE")) >= {proc.pid, child}
    finally:
        _end(proc, child)


def test_another_value_or_no_value_stops_the_walk(monkeypatch):
    monkeypatch.setenv("COLDSNAP_CONTROL_FILE", "/run/other/control-worker-0.json")
    proc, child = _start({"COLDSNAP_CONTROL_FILE": "/run/x/control-worker-0.json"})
    try:
        assert marked_root(child, "COLDSNAP_CONTROL_FILE") == proc.pid  # the parent's value differs from ours
        assert marked_root(child, "COLDSNAP_NOT_SET") == child
        assert marked_root(999999999, "COLDSNAP_CONTROL_FILE") == 999999999  # gone: itself
    finally:
        _end(proc, child)
