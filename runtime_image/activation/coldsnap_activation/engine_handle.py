"""Start an engine worker and talk to its loopback control API."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import subprocess
import time
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import UnitError
from ansible_collections.coldsnap.fleet.plugins.module_utils.snapshot.ports import engine_request

CONTROL_FILE = "control-{worker}.json"
LOG_FILE = "target.log"


class EngineHandle:
    """One worker process of a unit (the reference engine runs one worker per process)."""

    def __init__(self, *, unit: str, worker: dict, workload_dir: Path) -> None:
        self.unit = unit
        self.worker = worker
        self.workload_dir = Path(workload_dir)
        self.control_file = self.workload_dir / CONTROL_FILE.format(worker=worker["id"])
        self.log_path = self.workload_dir / LOG_FILE
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self._control: dict | None = None

    # ----------------------------------------------------------- processes
    def spawn(self, command: list[str], env: dict[str, str]) -> int:
        """Start the engine in its own session, stdout/stderr appended to the workload log."""
        self.workload_dir.mkdir(parents=True, exist_ok=True)
        self.control_file.unlink(missing_ok=True)
        log_fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
                                         env={**env, "COLDSNAP_CONTROL_FILE": str(self.control_file)},
                                         cwd="/", start_new_session=True, close_fds=True)
        except FileNotFoundError as exc:
            raise UnitError(f"unit {self.unit}: cannot start {command[0]!r}: {exc.strerror}",
                            fix="check launch.units[].command and the unit's PATH") from None
        finally:
            os.close(log_fd)
        self.pid = self.proc.pid
        return self.pid

    def adopt(self, pid: int, control: dict) -> None:
        """Take over a restored process (not our child unless restored as a sibling)."""
        self.pid = pid
        self._control = control

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        if self.pid is None:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        with contextlib.suppress(OSError):
            return Path(f"/proc/{self.pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
        return True

    def reap(self, timeout: float = 30) -> int | None:
        """Wait for our child to finish (CRIU dump kills it; the parent must reap)."""
        if self.proc is not None:
            try:
                return self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                return None
        return None

    def kill(self) -> None:
        if self.pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, 9)
        self.reap(10)

    def log_tail(self, lines: int = 15) -> str:
        try:
            data = self.log_path.read_bytes()[-20000:].decode(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(data[-lines:])

    def failure(self, what: str) -> UnitError:
        code = self.proc.poll() if self.proc is not None else None
        status = f" (exit status {code})" if code is not None else ""
        return UnitError(f"unit {self.unit} worker {self.worker['id']}: {what}{status}; last engine log lines:\n"
                         f"{self.log_tail()}", fix=f"see {self.log_path}")

    # ------------------------------------------------------------- control
    def control_info(self) -> dict:
        if self._control is None:
            self._control = json.loads(self.control_file.read_text())
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
        info = self.control_info()
        payload = json.dumps(body or {}).encode()
        try:
            with engine_request("127.0.0.1", info["port"], method, path, timeout=timeout,
                                body=payload if method == "POST" else None,
                                headers={"Authorization": f"Bearer {info['token']}",
                                         "Content-Type": "application/json"}) as resp:
                data = json.loads(resp.read() or b"{}")
            if "monotonic_ns" in data:
                # Offset of the engine's clock from ours (a restored engine lives in a time namespace).
                data["clock_offset_ns"] = time.monotonic_ns() - int(data["monotonic_ns"])
        except (OSError, http.client.HTTPException) as exc:
            # A reset is often the engine exiting: give it a moment to be seen dead, so the
            # error carries its exit status and log rather than the socket's complaint.
            grace = time.monotonic() + 2
            while self.alive() and time.monotonic() < grace:
                time.sleep(0.05)
            if not self.alive():
                raise self.failure(f"the engine died during {path}") from None
            raise UnitError(f"unit {self.unit}: control {path} failed: {exc}") from None
        if not data.get("ok"):
            raise UnitError(f"unit {self.unit} worker {self.worker['id']}: engine refused {path}: "
                            f"{data.get('error', 'unknown error')}", fix=f"see {self.log_path}")
        return data

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
