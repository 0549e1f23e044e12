"""Daemon management: start/status/stop as real background processes, idempotent and tidy."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord import daemon
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.client import CoordinatorClient
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.endpoint import (
    EndpointDescriptor,
    read_endpoint,
    write_endpoint,
)

PREFIX = "ansible_collections.coldsnap.fleet.plugins.module_utils"


@pytest.fixture
def endpoint_file(tmp_path) -> Path:
    path = tmp_path / "run" / "coordinator.json"
    yield path
    if not path.is_dir():
        daemon.stop_coordinator(path, timeout=10)


def test_start_status_stop(endpoint_file) -> None:
    started = daemon.start_coordinator(endpoint_file, scope="op-1")
    assert started.changed and started.running and started.healthy
    assert started.endpoint() == {"address": "127.0.0.1", "port": started.port, "scope": "op-1",
                                  "endpoint_file": str(endpoint_file)}
    assert stat.S_IMODE(os.stat(endpoint_file).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(endpoint_file.parent).st_mode) == 0o700
    assert daemon.pid_file_for(endpoint_file).read_text().strip() == str(started.pid)
    assert os.getppid() != started.pid and Path(f"/proc/{started.pid}").exists()
    CoordinatorClient.from_file(endpoint_file).set("k", "v")

    status = daemon.coordinator_status(endpoint_file)
    assert (status.running, status.healthy, status.pid, status.changed) == (True, True, started.pid, False)

    stopped = daemon.stop_coordinator(endpoint_file)
    assert stopped.changed and not stopped.running
    assert not Path(f"/proc/{started.pid}/cmdline").exists() or not daemon._is_our_server(
        started.pid, endpoint_file)
    assert not endpoint_file.exists() and not daemon.pid_file_for(endpoint_file).exists()
    assert daemon.log_file_for(endpoint_file).exists()  # kept for diagnosis
    again = daemon.stop_coordinator(endpoint_file)
    assert not again.changed
    assert not daemon.coordinator_status(endpoint_file).running


def test_token_is_nowhere_but_the_endpoint_file(endpoint_file) -> None:
    started = daemon.start_coordinator(endpoint_file, scope="op-secret")
    token = read_endpoint(endpoint_file).token
    proc = Path(f"/proc/{started.pid}")
    assert token.encode() not in (proc / "cmdline").read_bytes()
    assert token.encode() not in (proc / "environ").read_bytes()
    assert token not in json.dumps(started.as_dict())
    assert token not in repr(started)
    daemon.stop_coordinator(endpoint_file)
    assert token not in daemon.log_file_for(endpoint_file).read_text()


def test_the_controllers_credentials_stay_out_of_the_servers_environment(endpoint_file, monkeypatch) -> None:
    """The coordinator outlives the task that starts it and needs none of the controller's credentials."""
    monkeypatch.setenv("HF_TOKEN", "hf_not_for_the_coordinator")
    monkeypatch.setenv("COLDSNAP_REGISTRY_PASSWORD", "nor-this")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # a name that only looks like one stays
    started = daemon.start_coordinator(endpoint_file, scope="op-env")
    environ = Path(f"/proc/{started.pid}/environ").read_bytes()
    assert b"hf_not_for_the_coordinator" not in environ and b"nor-this" not in environ
    assert b"TOKENIZERS_PARALLELISM=false" in environ


def test_start_is_idempotent_and_refuses_a_different_activation(endpoint_file) -> None:
    first = daemon.start_coordinator(endpoint_file, scope="op-1")
    second = daemon.start_coordinator(endpoint_file, scope="op-1")
    assert not second.changed and second.pid == first.pid and second.port == first.port
    same_port = daemon.start_coordinator(endpoint_file, scope="op-1", port=first.port)
    assert not same_port.changed
    with pytest.raises(ColdSnapError, match=r"scope 'op-1'.*stop the running coordinator first"):
        daemon.start_coordinator(endpoint_file, scope="op-2")
    with pytest.raises(ColdSnapError, match="already serves"):
        daemon.start_coordinator(endpoint_file, scope="op-1", port=first.port + 1 if first.port < 65535 else 1)
    assert daemon.coordinator_status(endpoint_file).pid == first.pid


def test_a_foreground_server_never_takes_over_a_live_coordinators_endpoint(endpoint_file) -> None:
    """`coldsnap coordinator serve` on a running activation's endpoint file would replace its descriptor (new
    token) and remove it on exit, cutting that activation off: refused, the running one untouched."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.serve import run_server_process

    running = daemon.start_coordinator(endpoint_file, scope="op-1")
    before = endpoint_file.read_bytes()
    with pytest.raises(ColdSnapError, match=r"a coordinator already serves .*scope 'op-1'") as err:
        run_server_process(endpoint_file, scope="other", log=lambda _m: None)
    assert "another --endpoint-file" in err.value.fix
    assert endpoint_file.read_bytes() == before and daemon.coordinator_status(endpoint_file).healthy
    daemon.stop_coordinator(endpoint_file)
    assert daemon.coordinator_status(endpoint_file).pid is None and running.pid


def test_the_python_that_would_run_the_server_is_checked_in_check_mode_too(endpoint_file) -> None:
    with pytest.raises(ColdSnapError, match="not found or not executable"):
        daemon.start_coordinator(endpoint_file, scope="op-1", python="/nonexistent/python3", check_mode=True)


def test_check_mode_changes_nothing(endpoint_file) -> None:
    would = daemon.start_coordinator(endpoint_file, scope="op-1", check_mode=True)
    assert would.changed and not would.running
    assert not endpoint_file.exists() and not daemon.pid_file_for(endpoint_file).exists()
    running = daemon.start_coordinator(endpoint_file, scope="op-1")
    assert not daemon.start_coordinator(endpoint_file, scope="op-1", check_mode=True).changed
    would_stop = daemon.stop_coordinator(endpoint_file, check_mode=True)
    assert would_stop.changed
    assert daemon.coordinator_status(endpoint_file).pid == running.pid


def test_check_mode_and_a_stop_with_nothing_there_create_no_file_or_directory(endpoint_file) -> None:
    """Check mode only reads: no directory, no lock file; a stop where nothing ever ran is a no-op
    that makes nothing either (a real stop used to leave the directory and a lock file behind)."""
    run_dir = endpoint_file.parent
    assert daemon.start_coordinator(endpoint_file, scope="op-1", check_mode=True).changed
    assert not daemon.stop_coordinator(endpoint_file, check_mode=True).changed
    assert not daemon.stop_coordinator(endpoint_file).changed
    assert not run_dir.exists()
    run_dir.mkdir()
    assert daemon.start_coordinator(endpoint_file, scope="op-1", check_mode=True).changed
    assert not daemon.stop_coordinator(endpoint_file, check_mode=True).changed
    assert os.listdir(run_dir) == []


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("stale_pid", ["dead", "foreign", "garbage"])
def test_stale_pid_file_is_replaced(endpoint_file, stale_pid) -> None:
    endpoint_file.parent.mkdir(parents=True)
    pid_text = {"dead": str(_dead_pid()), "foreign": str(os.getpid()), "garbage": "not-a-pid"}[stale_pid]
    daemon.pid_file_for(endpoint_file).write_text(pid_text + "\n")
    # The descriptor a killed server leaves behind (its port long closed).
    write_endpoint(endpoint_file, EndpointDescriptor(address="127.0.0.1", port=9, scope="op-0", token="ab" * 32))
    assert not daemon.coordinator_status(endpoint_file).running
    started = daemon.start_coordinator(endpoint_file, scope="op-1")
    assert started.changed and started.healthy
    assert str(endpoint_file) in started.removed
    assert started.pid != os.getpid()


@pytest.mark.parametrize("what", ["a file of the user's", "a directory", "a large pid-named file"])
def test_what_a_coordinator_did_not_write_is_never_removed_or_replaced(endpoint_file, what) -> None:
    """An endpoint_file that names someone's file, or a directory: start and stop refuse (or find nothing
    to stop) and leave it exactly as it was."""
    endpoint_file.parent.mkdir(parents=True)
    if what == "a directory":
        (endpoint_file / "sub").mkdir(parents=True)
        (endpoint_file / "sub" / "data").write_text("keep")
    elif what == "a file of the user's":
        endpoint_file.write_text("precious notes\n")
    else:
        daemon.pid_file_for(endpoint_file).write_text("1234\n" * 100)
    before = _tree(endpoint_file.parent)
    with pytest.raises(ColdSnapError) as exc:
        daemon.start_coordinator(endpoint_file, scope="op-1")
    assert "directory" in str(exc.value) or "not what a coordinator writes" in str(exc.value)
    assert exc.value.fix
    if what != "a directory":
        stopped = daemon.stop_coordinator(endpoint_file)
        assert not stopped.changed and stopped.removed == []
    assert {k: v for k, v in _tree(endpoint_file.parent).items() if not k.endswith(".lock")} == before


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): (p.read_text() if p.is_file() else "dir") for p in sorted(root.rglob("*"))}


def test_two_spellings_of_one_endpoint_file_name_one_coordinator(endpoint_file, tmp_path) -> None:
    started = daemon.start_coordinator(endpoint_file, scope="op-1")
    alias_dir = tmp_path / "alias"
    alias_dir.symlink_to(endpoint_file.parent)
    for alias in (endpoint_file.parent / "sub" / ".." / endpoint_file.name, alias_dir / endpoint_file.name):
        status = daemon.coordinator_status(alias)
        assert status.running and status.pid == started.pid
        assert not daemon.start_coordinator(alias, scope="op-1").changed
    stopped = daemon.stop_coordinator(alias_dir / endpoint_file.name)
    assert stopped.changed and not daemon.coordinator_status(endpoint_file).running


def test_check_mode_refuses_a_scope_the_server_would_refuse(endpoint_file) -> None:
    with pytest.raises(ColdSnapError, match="scope"):
        daemon.start_coordinator(endpoint_file, scope="a\nb", check_mode=True)


def test_killed_server_leaves_files_that_stop_cleans(endpoint_file) -> None:
    started = daemon.start_coordinator(endpoint_file, scope="op-1")
    os.kill(started.pid, 9)
    daemon._wait_gone(started.pid, endpoint_file, 10)
    assert endpoint_file.exists()  # SIGKILL gives the server no chance to clean up
    status = daemon.coordinator_status(endpoint_file)
    assert not status.running
    stopped = daemon.stop_coordinator(endpoint_file)
    assert stopped.changed and str(endpoint_file) in stopped.removed
    assert not daemon.stop_coordinator(endpoint_file).changed


def test_port_in_use_fails_with_the_server_log(endpoint_file) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(ColdSnapError, match=r"did not start.*cannot listen on 127\.0\.0\.1"):
            daemon.start_coordinator(endpoint_file, scope="op-1", port=busy.getsockname()[1])
    assert not endpoint_file.exists() and not daemon.pid_file_for(endpoint_file).exists()


def test_a_server_not_ready_in_time_does_not_outlive_the_failed_start(endpoint_file) -> None:
    with pytest.raises(ColdSnapError, match=r"not ready within 0\.01s and was stopped"):
        daemon.start_coordinator(endpoint_file, scope="op-1", startup_timeout=0.01)
    status = daemon.coordinator_status(endpoint_file)
    assert not status.running, status
    assert not endpoint_file.exists() and not daemon.pid_file_for(endpoint_file).exists()
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(endpoint_file).encode() in cmdline.read_bytes().split(b"\0"):
                left.append(cmdline.parent.name)
        except OSError:
            continue
    assert not left, f"server processes left behind: {left}"
    assert daemon.start_coordinator(endpoint_file, scope="op-1").healthy  # and a real start works after it


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf")])
def test_a_timeout_that_is_not_positive_seconds_is_refused(endpoint_file, timeout) -> None:
    with pytest.raises(ColdSnapError, match=r"timeout .* must be a number of seconds > 0"):
        daemon.start_coordinator(endpoint_file, scope="op-1", startup_timeout=timeout)
    with pytest.raises(ColdSnapError, match=r"timeout .* must be a number of seconds > 0"):
        daemon.stop_coordinator(endpoint_file, timeout=timeout)
    assert not endpoint_file.parent.exists(), "refused before anything is created"


def test_bad_python_is_reported(endpoint_file) -> None:
    with pytest.raises(ColdSnapError, match="python interpreter"):
        daemon.start_coordinator(endpoint_file, scope="op-1", python="/nonexistent/python3")


def _collection_root() -> Path:
    root = daemon._collection_root()
    assert root is not None, "tests run from a plain-file checkout"
    return root


def test_server_code_modules_are_its_whole_import_closure() -> None:
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(_collection_root())!r})
        import {PREFIX}.coord.serve
        print("\\n".join(sorted(m for m in sys.modules if m.startswith({PREFIX!r} + "."))))
    """)
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, check=True)
    loaded = {m[len(PREFIX) + 1:] for m in out.stdout.split()}
    packages = {"common", "formats", "coord"}
    assert loaded - packages == set(daemon.SERVER_CODE_MODULES)


def test_zip_packaged_library_materializes_the_server_code(tmp_path) -> None:
    """What happens under AnsiballZ: the library is imported from a zip that vanishes later."""
    root = _collection_root()
    payload = tmp_path / "payload.zip"
    base = root / "ansible_collections" / "coldsnap" / "fleet"
    with zipfile.ZipFile(payload, "w") as z:
        for level in ("ansible_collections", "ansible_collections/coldsnap", "ansible_collections/coldsnap/fleet"):
            z.writestr(f"{level}/__init__.py", "")
        for path in sorted((base / "plugins").rglob("*.py")):
            z.write(path, f"ansible_collections/coldsnap/fleet/{path.relative_to(base)}")
    endpoint_file = tmp_path / "zip" / "coordinator.json"
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(payload)!r})
        from {PREFIX}.coord import daemon
        assert daemon._collection_root() is None, daemon._server.__file__
        state = daemon.start_coordinator({str(endpoint_file)!r}, scope="zip-op")
        print(json.dumps(state.as_dict()))
    """)
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60,
                         check=False)
    try:
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert result["changed"] and result["healthy"]
        payload.unlink()  # like AnsiballZ's temp dir: the server must not need it any more
        code_dir = daemon.code_dir_for(endpoint_file)
        assert stat.S_IMODE(os.stat(code_dir).st_mode) == 0o700
        package_dir = code_dir / Path(*PREFIX.split("."))
        files = {str(p.relative_to(package_dir)) for p in package_dir.rglob("*.py")}
        expected = {f"{m.replace('.', '/')}.py" for m in daemon.SERVER_CODE_MODULES}
        assert expected <= files
        CoordinatorClient.from_file(endpoint_file).health()
    finally:
        daemon.stop_coordinator(endpoint_file)
    assert not daemon.code_dir_for(endpoint_file).exists()


def test_materialized_code_runs_the_server_alone(tmp_path) -> None:
    code_dir = daemon._materialize_code(tmp_path / ".code")
    endpoint_file = tmp_path / "endpoint.json"
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(code_dir)}
    proc = subprocess.Popen(
        [sys.executable, "-S", "-c", textwrap.dedent(f"""
            import sys
            from {PREFIX}.coord import serve
            assert serve.__file__.startswith({str(code_dir)!r}), serve.__file__
            sys.exit(serve.main(sys.argv[1:]))
        """), "--endpoint-file", str(endpoint_file), "--scope", "alone"],
        env=env, stderr=subprocess.PIPE, text=True,
    )
    try:
        CoordinatorClient.from_file(_wait_for(endpoint_file, proc)).health(wait_s=10)
    finally:
        proc.terminate()
        _unused, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert not endpoint_file.exists()  # removed on graceful stop


def _wait_for(path: Path, proc: subprocess.Popen) -> Path:
    import time

    deadline = time.monotonic() + 30
    while not path.exists():
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return path


def test_a_coordinator_is_not_started_in_a_directory_another_user_owns_in_a_shared_one(world_writable) -> None:
    """Its owner could replace the descriptor (and so redirect every rank) or the code the daemon imports."""
    theirs = world_writable / "cskv"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ColdSnapError, match=r"belongs to uid 65534, .*anyone may write to"):
        daemon.start_coordinator(theirs / "coordinator.json", scope="op-1")
    assert os.listdir(theirs) == []
