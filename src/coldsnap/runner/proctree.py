"""Stop ansible-playbook and everything it started when an operation is cancelled.

ansible-runner's own cancel kills only the process group of ansible-playbook,
but ansible-core (2.19) runs each worker in a session of its own, so a module
(and the command it runs) would outlive the cancel. This module snapshots the
whole process tree under ansible-playbook from ``/proc`` *before* anything is
killed (once a parent dies its children are re-parented and the tree is lost),
then sends SIGTERM to every process and process group in it, waits a grace
period and SIGKILLs what is left. Processes that a playbook daemonized earlier
(a launched unit) are no longer in the tree and are left alone.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

PROC = Path("/proc")


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgid) of a process, or None when it is gone."""
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may contain spaces: split after the last ')'.
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[2])


def descendants(root: int) -> list[int]:
    """``root`` and every live process below it (parents before children)."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        st = _stat(int(entry.name))
        if st is not None:
            children.setdefault(st[1], []).append(int(entry.name))
    out: list[int] = []
    todo = [root] if _stat(root) is not None else []
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(sorted(children.get(pid, [])))
    return out


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def _signal_all(pids: list[int], pgids: set[int], sig: int) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except OSError:
            pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def terminate_tree(root: int, *, grace_s: float = 3.0) -> int:
    """SIGTERM ``root``'s whole tree, SIGKILL what survives ``grace_s``; returns how many were signalled."""
    pids = descendants(root)
    if not pids:
        return 0
    own_pgid = os.getpgrp()
    pgids = set()
    for pid in pids:
        st = _stat(pid)
        if st is not None and st[2] != own_pgid:  # never signal the controller's own group
            pgids.add(st[2])
    _signal_all(pids, pgids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    survivors = [p for p in pids if _alive(p)]
    if survivors:
        _signal_all(survivors, pgids, signal.SIGKILL)
    return len(pids)


def find_child(marker: str) -> int | None:
    """A direct child of this process whose command line contains ``marker`` (ansible-playbook)."""
    me = os.getpid()
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        st = _stat(int(entry.name))
        if st is None or st[1] != me:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            return int(entry.name)
    return None


def _artifact_dir_of(pid_dir: Path) -> Path | None:
    """The ``AWX_ISOLATED_DATA_DIR`` (ansible-runner's artifact directory of the run) in a process's
    environment, or None."""
    try:
        environ = (pid_dir / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"AWX_ISOLATED_DATA_DIR="):
            return Path(os.fsdecode(item.split(b"=", 1)[1]))
    return None


def playbooks_in(directory: Path) -> list[int]:
    """Live ansible-playbook processes (and their forked workers) of the run whose ``project`` directory is
    ``directory``: ansible-runner starts ansible-playbook in it, with the run's artifact directory (below the
    run directory, ``directory``'s parent) in its environment. Every run's ``project`` links to the same
    collection, so the working directory alone would take another run's playbook (another workload, another
    state root) for this one's. Only processes whose ``/proc`` entries this user may read are seen; what a
    playbook launched (an engine, its keeper) runs another program."""
    try:
        target = directory.resolve(strict=True)
        run_dir = directory.parent.resolve(strict=True)
    except OSError:
        return []
    found = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if Path(os.readlink(entry / "cwd")) != target:
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")[:2]
        except OSError:
            continue
        if not any(Path(a.decode(errors="replace")).name == "ansible-playbook" for a in argv):
            continue
        artifacts = _artifact_dir_of(entry)
        if artifacts is None or not artifacts.resolve().is_relative_to(run_dir):
            continue
        if _alive(int(entry.name)):
            found.append(int(entry.name))
    return sorted(found)
