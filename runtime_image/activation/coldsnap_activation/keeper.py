"""The unit keeper: the restored engine's parent on a host without a container.

CRIU restores a detached process tree as a child of the ``criu`` process; when
``criu`` exits the tree is re-parented to the nearest *subreaper* ancestor, or to
init. Not every init reaps promptly, and an unreaped restored engine keeps its pid
— which CRIU needs free for the next restore. The keeper marks itself a child
subreaper, runs ``criu restore``, reports the result, then stays as the restored
tree's parent and reaps it when it exits. Docker units do not need it: the rank
controller is the container's PID 1.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process (which must reap them)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def reap_orphans(timeout: float) -> None:
    """Reap every child that exits within ``timeout`` s (return at once when none is left): the
    processes of a dumped tree whose parent died first come here as zombies, and a zombie still
    holds its pid, which a restore of the same tree needs free."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        except InterruptedError:
            continue
        if pid == 0:
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)


def _write(result_file: Path, doc: dict) -> None:
    tmp = result_file.with_name(f".{result_file.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(doc))
    os.replace(tmp, result_file)


def run(images: Path, result_file: Path, *, leave_stopped: bool, criu_binary: str | None,
        options: dict | None = None, huge_pages: bool = False) -> int:
    """Restore ``images`` as our descendant, report, then reap until the tree is gone."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
    from ansible_collections.coldsnap.fleet.plugins.module_utils.process import criu as criu_mod

    try:
        become_subreaper()
        res = criu_mod.restore(criu_mod.find_criu(criu_binary), images, work_dir=result_file.parent,
                               leave_stopped=leave_stopped, options=criu_mod.CriuOptions.from_json(options),
                               huge_pages=huge_pages)
    except (ColdSnapError, OSError) as exc:
        _write(result_file, {"ok": False, "error": str(exc)})
        return 1
    _write(result_file, {"ok": True, "pid": res.pid, "seconds": res.seconds, "keeper": os.getpid()})
    while True:
        try:
            os.wait()
        except ChildProcessError:
            return 0
        except InterruptedError:
            continue


def start(images: Path, *, work_dir: Path, leave_stopped: bool, criu_binary: str | None, log_path: Path,
          timeout: float = 600, options: dict | None = None, huge_pages: bool = False) -> dict:
    """Spawn a keeper for ``images`` and wait for its restore result (pid, seconds).

    CRIU's log and the result go to ``work_dir`` (fresh, 0700), never into the image directory."""
    import subprocess

    from ansible_collections.coldsnap.fleet.plugins.module_utils.process.criu import private_work_dir

    result_file = private_work_dir(work_dir) / "keeper-result.json"
    result_file.unlink(missing_ok=True)
    args = [sys.executable, "-m", "coldsnap_activation", "keeper", "--images", str(images),
            "--result", str(result_file)]
    if leave_stopped:
        args.append("--leave-stopped")
    if huge_pages:
        args.append("--huge-pages")
    if criu_binary:
        args += ["--criu", criu_binary]
    if options:
        args += ["--options", json.dumps(options)]
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    with os.fdopen(log_fd, "ab") as log:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                                cwd="/", close_fds=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result_file.exists():
            return json.loads(result_file.read_text())
        if proc.poll() is not None and not result_file.exists():
            return {"ok": False, "error": f"the unit keeper exited with status {proc.returncode}; see {log_path}"}
        time.sleep(0.002)
    return {"ok": False, "error": f"the unit keeper did not report within {timeout:.0f}s; see {log_path}"}
