"""An engine handle that adopted a restored pid signals that process only: once the process is gone, a
later process with the same number (a stranger, after pid reuse) is never killed or taken for alive."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ACTIVATION = Path(__file__).resolve().parents[3] / "runtime_image" / "activation"
sys.path.insert(0, str(ACTIVATION))
from coldsnap_activation.engine_handle import EngineHandle  # noqa: E402


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def _handle(tmp_path: Path) -> EngineHandle:
    return EngineHandle(unit="u0", worker={"id": "w0"}, workload_dir=tmp_path / "wl")


def test_adopted_pid_taken_by_a_later_process_is_not_killed(tmp_path):
    engine = _sleeper()
    time.sleep(0.05)  # start times count clock ticks (10 ms): the later process starts in a later one
    stranger = _sleeper()
    try:
        handle = _handle(tmp_path)
        handle.adopt(engine.pid, {"pid": engine.pid, "port": 1, "token": "t" * 32})
        assert handle.alive()
        engine.kill()
        engine.wait()
        # The number comes back as another process: what pid reuse does (the stranger started later).
        handle.pid = stranger.pid
        assert not handle.alive()
        handle.kill()
        time.sleep(0.1)
        assert stranger.poll() is None, "the handle killed a process it never adopted"
    finally:
        for p in (engine, stranger):
            p.kill()
            p.wait()


def _parent_of_a_sleeper() -> tuple[subprocess.Popen, int]:
    """A process with one child, both sleeping: the parent and the child's pid."""
    parent = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys, time\n"
                               "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
                               "print(c.pid, flush=True)\n"
                               "time.sleep(120)\n"], stdout=subprocess.PIPE, text=True)
    return parent, int(parent.stdout.readline())


def test_adopted_pid_is_killed_with_its_tree(tmp_path):
    parent, child = _parent_of_a_sleeper()
    try:
        handle = _handle(tmp_path)
        handle.adopt(parent.pid, {"pid": parent.pid, "port": 1, "token": "t" * 32})
        handle.kill()
        assert parent.wait(timeout=10) == -9
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not Path(f"/proc/{child}").exists() or \
            Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    finally:
        parent.kill()
        parent.wait()


def test_a_pid_already_gone_when_adopted_is_never_signalled(tmp_path):
    gone = _sleeper()
    gone.kill()
    gone.wait()
    time.sleep(0.05)
    stranger = _sleeper()
    try:
        handle = _handle(tmp_path)
        handle.adopt(gone.pid, {"pid": gone.pid, "port": 1, "token": "t" * 32})
        handle.pid = stranger.pid  # whatever holds the number later
        assert not handle.alive()
        handle.kill()
        time.sleep(0.1)
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_a_refusal_after_a_process_of_the_tree_died_names_that_process(tmp_path):
    """A multi-process engine (vLLM's API server over its engine core) whose child is killed mid-step answers
    its control call with a bare error (vLLM: ``CancelledError:``): the failure names the process of the
    tree that ended and carries the log's last lines."""
    import http.server
    import threading

    import pytest
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import UnitError

    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = b'{"ok": false, "error": "CancelledError: "}'
            self.send_response(500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    parent, child = _parent_of_a_sleeper()
    try:
        handle = _handle(tmp_path)
        handle.workload_dir.mkdir(parents=True)
        handle.log_path.write_text("engine core exited unexpectedly\n")
        handle.adopt(parent.pid, {"pid": parent.pid, "port": server.server_address[1], "token": "t" * 32})
        handle.note_tree()
        with pytest.raises(UnitError) as before:
            handle.call("POST", "/resume", {})
        assert "engine refused /resume: CancelledError" in str(before.value) and "ended" not in str(before.value)
        subprocess.run(["kill", "-9", str(child)], check=True)
        deadline = time.monotonic() + 10
        while not handle.ended_members() and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(UnitError) as after:
            handle.call("POST", "/resume", {})
        msg = str(after.value)
        assert f"a process of the engine's tree had ended: python (pid {child})" in msg, msg
        assert "engine core exited unexpectedly" in msg, "the log's last lines come with it"
    finally:
        server.shutdown()
        parent.kill()
        parent.wait()
