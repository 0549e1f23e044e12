"""The unit keeper: the restored engine's parent on a host without a container.

CRIU restores a detached process tree as a child of the ``criu`` process; when
``criu`` exits the tree is re-parented to the nearest *subreaper* ancestor, or to
init. Not every init reaps promptly, and an unreaped restored engine keeps its pid
— which CRIU needs free for the next restore. The keeper marks itself a child
subreaper, runs ``criu restore``, reports the result, then stays as the restored
tree's parent and reaps it when it exits; once the restored root has ended, it ends
what is left of its tree too (a multi-process engine's children, orphans here). It is
started with the activation (its Python start and imports overlap the activation's
own, off the restore's critical path) and reads what to restore from a pipe. Docker
units do not need it: the rank controller is the container's PID 1.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
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


def _restore_and_reap(criu, images: Path, result_file: Path, *, leave_stopped: bool, options: dict | None,
                      huge_pages: bool) -> int:
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
    from ansible_collections.coldsnap.fleet.plugins.module_utils.process import criu as criu_mod

    try:
        res = criu_mod.restore(criu, images, work_dir=result_file.parent, leave_stopped=leave_stopped,
                               options=criu_mod.CriuOptions.from_json(options), huge_pages=huge_pages)
    except (ColdSnapError, OSError) as exc:
        # A CRIU that ended part way (killed by the OOM killer) leaves what it restored so far here, as
        # orphans holding the captured pids and ports: ended before the failure is reported.
        end_tree(timeout=30)
        _write(result_file, {"ok": False, "error": str(exc)})
        return 1
    _write(result_file, {"ok": True, "pid": res.pid, "seconds": res.seconds, "keeper": os.getpid()})
    while True:  # the restored tree runs: reap what ends, until its root does
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 0
        except InterruptedError:
            continue
        if pid == res.pid:  # how the engine ended, for the activation's error (it is not its child)
            _write(exit_record(result_file.parent), {"pid": pid, "wait_status": status})
            break
    end_tree()
    return 0


def end_tree(timeout: float | None = None) -> None:
    """End every process left below this keeper and reap them (a process forked while they are killed is
    caught by the next round); return once none is left, or after ``timeout`` s."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while deadline is None or time.monotonic() < deadline:
        end_orphans()
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        except InterruptedError:
            continue
        if pid == 0:
            time.sleep(0.02)


def end_orphans() -> None:
    """SIGKILL every process left below this keeper once the restored engine's root has ended: the rest
    of its tree (a multi-process engine's engine core and workers) came here as orphans. Nothing else
    can end them (the control file names the root only), and they would keep the captured pids and
    ports a later restore needs."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.proctree import process_tree

    me = os.getpid()
    for pid in sorted(process_tree(me) - {me}):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def exit_record(work_dir: Path) -> Path:
    """Where a keeper records how its restored engine ended (``pid``, ``wait_status``)."""
    return Path(work_dir) / "keeper-exit.json"


def run(criu_binary: str | None) -> int:
    """Started ahead of its restore: become the subreaper and load CRIU's wrapper now,
    then read what to restore as one JSON line on stdin (``images``, ``result``, ``log``,
    ``leave_stopped``, ``options``, ``huge_pages``). End of input before that line: nothing to do
    (the restore was refused or failed first), exit 0."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
    from ansible_collections.coldsnap.fleet.plugins.module_utils.process import criu as criu_mod

    error = None
    criu = None
    try:
        become_subreaper()
        criu = criu_mod.find_criu(criu_binary)
    except (ColdSnapError, OSError) as exc:
        error = str(exc)
    line = sys.stdin.readline()
    if not line.endswith("\n"):  # end of input (a line cut short: the activation died writing it)
        return 0
    job = json.loads(line)
    # From here on this process outlives the one that started it: its output goes to the keeper's
    # own log, and it holds no end of the pipe (CRIU, its child, would inherit it).
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    result_file = Path(job["result"])
    try:
        log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    except OSError as exc:  # e.g. a symbolic link planted under the log's name
        _write(result_file, {"ok": False, "error": f"cannot open the unit keeper's log {job['log']}: {exc}"})
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    if error is not None:
        _write(result_file, {"ok": False, "error": error})
        return 1
    return _restore_and_reap(criu, Path(job["images"]), result_file, leave_stopped=bool(job["leave_stopped"]),
                             options=job.get("options"), huge_pages=bool(job.get("huge_pages")))


class Prestarted:
    """A keeper process started ahead of a restore (its Python start and imports overlap the
    activation's own start and admission), waiting on a pipe for what to restore."""

    def __init__(self, criu_binary: str | None) -> None:
        import subprocess

        args = [sys.executable, "-m", "coldsnap_activation", "keeper"]
        if criu_binary:
            args += ["--criu", criu_binary]
        # Until it is told what to restore, its output goes where ours does (the activation's log).
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, start_new_session=True, cwd="/", close_fds=True)
        self.sent = False

    def go(self, images: Path, *, work_dir: Path, leave_stopped: bool, log_path: Path, timeout: float = 600,
           options: dict | None = None, huge_pages: bool = False) -> dict:
        """Restore ``images`` and wait for the result (pid, seconds). CRIU's log and the result go
        to ``work_dir`` (fresh, 0700), never into the image directory; the keeper's own output
        to ``log_path``."""
        from ansible_collections.coldsnap.fleet.plugins.module_utils.process.criu import private_work_dir

        result_file = private_work_dir(work_dir) / "keeper-result.json"
        result_file.unlink(missing_ok=True)
        exit_record(result_file.parent).unlink(missing_ok=True)
        job = {"images": str(images), "result": str(result_file), "log": str(log_path),
               "leave_stopped": leave_stopped, "options": options, "huge_pages": huge_pages}
        self.sent = True
        where = str(log_path)
        try:
            self.proc.stdin.write((json.dumps(job) + "\n").encode())
            self.proc.stdin.close()
        except OSError:  # it ended before it was given its restore: what it said is in our own log
            where = "the activation runtime's log"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if result_file.exists():
                return json.loads(result_file.read_text())
            if self.proc.poll() is not None and not result_file.exists():
                return {"ok": False,
                        "error": f"the unit keeper exited with status {self.proc.returncode}; see {where}"}
            time.sleep(0.002)
        # Stopped with its CRIU (its own session): no late restore may appear after this error.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        return {"ok": False, "timed_out": True,
                "error": f"the unit keeper did not report within {timeout:.0f}s and was stopped; see {log_path}"}

    def cancel(self, timeout: float = 10) -> None:
        """Not needed after all: it reads end of input and exits (killed if it does not). A keeper
        that was given its restore stays: it parents the restored tree."""
        import subprocess

        if self.sent:
            return
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def wait_ended(self, timeout: float = 30) -> bool:
        """Wait until the keeper has exited: every process of the tree it parents has ended and been
        reaped (it ends them once their root has). False when it is still running after ``timeout`` s."""
        import subprocess

        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True


def prestart(spec) -> list[Prestarted]:
    """One waiting keeper per worker for a restore that will need them (a unit on a host, whose
    restored tree has no supervisor to parent it); none for any other operation."""
    if spec.operation not in ("restore", "warm") or spec.supervise:
        return []
    return [Prestarted(spec.criu_binary) for _worker in spec.workers]
