"""The coldsnap.fleet.coordinator module run by Ansible itself (AnsiballZ, zip-packaged library)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord import daemon
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.client import CoordinatorClient
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.endpoint import read_endpoint

ANSIBLE = Path(sys.executable).parent / "ansible"

pytestmark = pytest.mark.skipif(not ANSIBLE.exists() and not shutil.which("ansible"),
                                reason="ansible-core is not installed in this environment")


def run_module(args: str, *extra: str) -> tuple[str, dict, str]:
    """Run the module on localhost; returns (ansible's status word, the result, the full output)."""
    env = {
        **os.environ,
        "ANSIBLE_COLLECTIONS_PATH": str(daemon._collection_root()),
        "ANSIBLE_PYTHON_INTERPRETER": sys.executable,
        "ANSIBLE_LOCALHOST_WARNING": "false",
        "ANSIBLE_INVENTORY_UNPARSED_WARNING": "false",
        "ANSIBLE_NOCOLOR": "1",
    }
    out = subprocess.run(
        [str(ANSIBLE if ANSIBLE.exists() else shutil.which("ansible")), "localhost", "-o",
         "-m", "coldsnap.fleet.coordinator", "-a", args, *extra],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )
    text = out.stdout + out.stderr
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("localhost | ")), None)
    assert line is not None, text
    word, _sep, payload = line[len("localhost | "):].partition(" => ")
    return word.strip(), json.loads(payload), text


@pytest.fixture
def endpoint_file(tmp_path) -> Path:
    path = tmp_path / "coordinator.json"
    yield path
    daemon.stop_coordinator(path)


def test_started_twice_status_and_stopped(endpoint_file) -> None:
    word, first, _unused = run_module(f"endpoint_file={endpoint_file} scope=op-mod")
    assert word == "CHANGED" and first["changed"] and first["healthy"]
    assert first["endpoint"] == {"address": "127.0.0.1", "port": first["endpoint"]["port"], "scope": "op-mod",
                                 "endpoint_file": str(endpoint_file)}
    # The module's temporary files are gone; the server runs on from its private code copy.
    CoordinatorClient.from_file(endpoint_file).health()
    assert daemon.code_dir_for(endpoint_file).is_dir()

    word, second, _unused = run_module(f"endpoint_file={endpoint_file} scope=op-mod")
    assert word == "SUCCESS" and not second["changed"] and second["pid"] == first["pid"]

    word, status, _unused = run_module(f"endpoint_file={endpoint_file} state=status")
    assert not status["changed"] and status["running"] and status["endpoint"] == first["endpoint"]

    word, stopped, _unused = run_module(f"endpoint_file={endpoint_file} state=stopped")
    assert word == "CHANGED" and stopped["changed"] and not stopped["running"]
    assert not endpoint_file.exists() and not daemon.code_dir_for(endpoint_file).exists()
    word, again, _unused = run_module(f"endpoint_file={endpoint_file} state=stopped")
    assert word == "SUCCESS" and not again["changed"]


def test_check_mode_changes_nothing(endpoint_file) -> None:
    word, result, _unused = run_module(f"endpoint_file={endpoint_file} scope=op-check", "--check")
    assert word == "CHANGED" and result["changed"] and not result["running"]
    assert not endpoint_file.exists() and not daemon.pid_file_for(endpoint_file).exists()
    assert not daemon.coordinator_status(endpoint_file).running


def test_token_absent_from_verbose_output(endpoint_file) -> None:
    _unused, started, text_start = run_module(f"endpoint_file={endpoint_file} scope=op-vvv", "-vvv")
    token = read_endpoint(endpoint_file).token
    _unused, _unused2, text_status = run_module(f"endpoint_file={endpoint_file} state=status", "-vvv")
    _unused, _unused2, text_again = run_module(f"endpoint_file={endpoint_file} scope=op-vvv", "-vvv")
    for text in (text_start, text_status, text_again):
        assert token not in text
    assert started["endpoint"]["port"] > 0


def test_errors_are_clear(endpoint_file) -> None:
    word, result, _unused = run_module(f"endpoint_file={endpoint_file}")
    assert word.startswith("FAILED") and "scope" in result["msg"]
    run_module(f"endpoint_file={endpoint_file} scope=op-a")
    word, result, _unused = run_module(f"endpoint_file={endpoint_file} scope=op-b")
    assert word.startswith("FAILED") and "stop the running coordinator first" in result["msg"]
    word, result, _unused = run_module(f"endpoint_file={endpoint_file}.2 scope=op-a address=localhost")
    assert word.startswith("FAILED") and "not an IP address" in result["msg"]
