"""Start an engine worker and talk to its loopback control API (through the library's
:class:`~...process.engine_client.EngineClient`, the one client of that contract)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import UnitError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.proctree import start_time
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import engine_control as ec
from ansible_collections.coldsnap.fleet.plugins.module_utils.process.engine_client import (
    ControlCallError,
    EngineClient,
    pid_alive,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.process.ports import process_tree


class EngineHandle:
    """One worker process of a unit (the reference engine runs one worker per process)."""

    def __init__(self, *, unit: str, worker: dict, workload_dir: Path) -> None:
        self.unit = unit
        self.worker = worker
        self.workload_dir = Path(workload_dir)
        self.control_file = ec.control_file_path(self.workload_dir, worker["id"])
        self.log_path = self.workload_dir / ec.LOG_FILE_NAME
        self.exit_record: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self._started: str | None = None  # an adopted pid's start time: a later process with its number is not it
        self._control: ec.ControlInfo | None = None
        self._members: dict[int, tuple[str | None, str]] = {}  # the restored tree's other processes (note_tree)

    # ----------------------------------------------------------- processes
    def spawn(self, command: list[str], env: dict[str, str], *, private_shm: bool = False) -> int:
        """Start the engine in its own session, stdout/stderr appended to the workload log.

        ``private_shm``: through the launcher (``launch.py``), which gives it a mount namespace with a
        private ``/dev/shm`` and then execs the command (same pid)."""
        if private_shm:
            command = [sys.executable, str(Path(__file__).with_name("launch.py")), "--private-shm", "--", *command]
        self.workload_dir.mkdir(parents=True, exist_ok=True)
        self.control_file.unlink(missing_ok=True)
        log_fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        try:
            self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
                                         env={**env, ec.ENV_CONTROL_FILE: str(self.control_file)},
                                         cwd="/", start_new_session=True, close_fds=True)
        except FileNotFoundError as exc:
            raise UnitError(f"unit {self.unit}: cannot start {command[0]!r}: {exc.strerror}",
                            fix="check launch.units[].command and the unit's PATH") from None
        finally:
            os.close(log_fd)
        self.pid = self.proc.pid
        return self.pid

    def adopt(self, pid: int, control: ec.ControlInfo | dict, *, exit_record: Path | None = None) -> None:
        """Take over a restored process (not our child unless restored as a sibling); ``exit_record``: where
        the unit keeper that reaps it records how it ended."""
        self.pid = pid
        self._started = start_time(pid)
        self._control = control if isinstance(control, ec.ControlInfo) else ec.ControlInfo.from_json(control)
        self.exit_record = exit_record

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return self._is_ours() and pid_alive(self.pid)

    def _is_ours(self) -> bool:
        """The pid still names the process this handle started or adopted: our child stays ours until it is
        reaped; an adopted pid must still carry the start time it had when adopted (once it is gone and
        reaped, the number may be another process's); one already gone when adopted never is."""
        if self.pid is None:
            return False
        return self.proc is not None or (self._started is not None and start_time(self.pid) == self._started)

    def note_tree(self) -> None:
        """Remember the other processes of the engine's tree (a multi-process engine's engine core and
        workers), so that a later failure can say which of them ended."""
        self._members = {}
        for pid in process_tree(self.pid) - {self.pid}:
            try:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            self._members[pid] = (start_time(pid), name)

    def ended_members(self) -> list[str]:
        """The processes of the noted tree that are no longer running (``NAME (pid N)``)."""
        return [f"{name} (pid {pid})" for pid, (started, name) in sorted(self._members.items())
                if started is None or start_time(pid) != started or not pid_alive(pid)]

    def reap(self, timeout: float = 30) -> int | None:
        """Wait for our child to finish (CRIU dump kills it; the parent must reap)."""
        if self.proc is not None:
            try:
                return self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                return None
        return None

    def kill(self) -> None:
        """SIGKILL the engine and every process it started (a multi-process engine's whole tree)."""
        if not self._is_ours():
            return  # gone: its number may be a stranger's now
        tree = process_tree(self.pid) if self.alive() else {self.pid}
        for pid in sorted(tree):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        self.reap(10)

    def log_tail(self, lines: int = 15) -> str:
        try:
            data = self.log_path.read_bytes()[-20000:].decode(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(data[-lines:])

    def failure(self, what: str) -> UnitError:
        tail = self.log_tail() or "(none: it wrote nothing to its log since it was started or restored)"
        return UnitError(f"unit {self.unit} worker {self.worker['id']}: {what}{self._ended()}; last engine log "
                         f"lines:\n{tail}", fix=f"see {self.log_path}")

    def _ended(self, wait: float = 1.0) -> str:
        """`` (exit status N)`` / `` (killed by SIGKILL)`` when it is known how the engine ended, else ''."""
        if self.proc is not None:
            code = self.proc.poll()
            return "" if code is None else (f" (exit status {code})" if code >= 0 else
                                            f" (killed by {_signal_name(-code)})")
        status = None
        if self.pid is not None:  # restored as our own child (a container's first process restores so)
            with contextlib.suppress(ChildProcessError, OSError):
                got, raw = os.waitpid(self.pid, os.WNOHANG)
                status = raw if got == self.pid else None
        deadline = time.monotonic() + wait
        while status is None and self.exit_record is not None:  # or the unit keeper's, which reaps it
            with contextlib.suppress(OSError, ValueError, TypeError):
                doc = json.loads(self.exit_record.read_text())
                if doc.get("pid") == self.pid:
                    status = int(doc["wait_status"])
                    break
            if time.monotonic() >= deadline or self.alive():
                break
            time.sleep(0.05)
        if status is None:
            return ""
        if os.WIFSIGNALED(status):
            return f" (killed by {_signal_name(os.WTERMSIG(status))})"
        return f" (exit status {os.WEXITSTATUS(status)})" if os.WIFEXITED(status) else ""

    # ------------------------------------------------------------- control
    def control_info(self) -> ec.ControlInfo:
        if self._control is None:
            self._control = ec.ControlInfo.load(self.control_file)
        return self._control

    def wait_control(self, timeout: float) -> dict:
        """Wait until the engine's control API answers; fail with its log if it dies."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise self.failure("the engine exited during start-up")
            if self.control_file.exists():
                with contextlib.suppress(OSError, ValueError, ConnectionError):
                    self._control = None
                    return self.call("GET", "/status", timeout=5)
            time.sleep(0.05)
        raise self.failure(f"no control API after {timeout:.0f}s")

    def call(self, method: str, path: str, body: dict | None = None, *, timeout: float = 600) -> dict:
        """One control request; raises UnitError with the engine's message on failure."""
        try:
            return EngineClient(self.control_info()).call(method, path, body, timeout=timeout)
        except ControlCallError as exc:
            ended = self.ended_members()
            if ended:  # a process of its tree died (an engine core killed): say so, with the log's last lines
                raise self.failure(f"engine refused {path}: {exc}; {_tree_lost(ended)}") from None
            raise UnitError(f"unit {self.unit} worker {self.worker['id']}: engine refused {path}: {exc}",
                            fix=f"see {self.log_path}") from None
        except (OSError, http.client.HTTPException) as exc:
            # A reset is often the engine exiting: give it a moment to be seen dead, so the
            # error carries its exit status and log rather than the socket's complaint. A process of its
            # tree that had ended while it still ran (an engine core killed) is named: the cause.
            ended = self.ended_members() if self.alive() else []
            grace = time.monotonic() + 2
            while self.alive() and time.monotonic() < grace:
                time.sleep(0.05)
            first = f" after {_tree_lost(ended)}" if ended else ""
            if not self.alive():
                raise self.failure(f"the engine died during {path}{first}") from None
            raise UnitError(f"unit {self.unit}: control {path} failed: {exc}{first}") from None

    def peek_status(self, *, timeout: float = 2.0) -> dict | None:
        """One ``GET /status`` beside a running step (progress only): None when it does not answer."""
        try:
            return EngineClient(self.control_info()).call("GET", ec.STATUS, None, timeout=timeout)
        except Exception:  # a progress look never changes the step
            return None

    def wait_state(self, states: tuple[str, ...], timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            st = self.call("GET", "/status", timeout=10)
            if st["state"] in states:
                return st
            if st.get("last_error"):
                raise self.failure(f"engine error: {st['last_error']}")
            if time.monotonic() > deadline:
                raise self.failure(f"engine stayed {st['state']!r} for {timeout:.0f}s (waiting for {states})")
            if not self.alive():
                raise self.failure("the engine exited")
            time.sleep(0.05)


def _tree_lost(ended: list[str]) -> str:
    return f"{'processes' if len(ended) > 1 else 'a process'} of the engine's tree had ended: {', '.join(ended)}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
