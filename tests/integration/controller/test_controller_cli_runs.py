"""`coldsnap <operation>` end to end: receipts on stdout or in a file, prepare-only, SIGTERM, timeline."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.canonical import canonical_sha256
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.receipt import load_receipt
from controller_helpers import PLAYBOOKS, REQUEST, read_ndjson, request_for

from coldsnap.timeline import timeline_model


def _coldsnap(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coldsnap.cli", *argv], check=False, capture_output=True, text=True,
                          timeout=120, **kwargs)


def _request_file(tmp_path: Path, operation: str) -> Path:
    path = tmp_path / f"request-{operation}.json"
    path.write_text(json.dumps(request_for(operation)))
    return path


def test_capture_prints_the_receipt_on_stdout(tmp_path: Path) -> None:
    p = _coldsnap("capture", "--request-json", str(REQUEST), "--playbook", str(PLAYBOOKS / "succeed.yml"),
                  "--state-root", str(tmp_path / "state"), "--timing-ndjson", str(tmp_path / "t.ndjson"),
                  "-e", "fixture_note=hello", "--quiet")
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""  # --quiet
    receipt = load_receipt(p.stdout)
    assert receipt["state"] == "succeeded"
    assert receipt["replay_semantics"] == "conflict-on-existing-output" and receipt["prepare_only"] is False
    assert read_ndjson(tmp_path / "t.ndjson")[-1]["attrs"]["sha256"] == canonical_sha256(receipt["timing"])
    stored = json.loads((tmp_path / "state" / "runs" / receipt["operation_id"] / "env" / "extravars").read_text())
    assert stored["fixture_note"] == "hello" and stored["coldsnap_prepare_only"] is False
    assert stored["coldsnap_state_root"] == str(tmp_path / "state")
    assert stored["coldsnap_request"]["operation"] == "capture"


def test_restore_prepare_only_writes_the_receipt_file_and_a_timeline(tmp_path: Path) -> None:
    out = tmp_path / "receipt.json"
    p = _coldsnap("restore", "--prepare-only", "--request-json", str(_request_file(tmp_path, "restore")),
                  "--playbook", str(PLAYBOOKS / "succeed.yml"), "--state-root", str(tmp_path / "state"),
                  "--receipt-json", str(out))
    assert p.returncode == 0, p.stderr
    assert p.stdout == ""
    assert "coldsnap restore: succeeded" in p.stderr and str(out) in p.stderr
    receipt = load_receipt(out.read_bytes())
    assert receipt["replay_semantics"] == "safe-repeat" and receipt["prepare_only"] is True
    assert receipt["result"]["operation"]["prepare_only"] is True  # the playbook saw coldsnap_prepare_only
    png = tmp_path / "timeline.png"
    t = _coldsnap("timeline", str(out), "-o", str(png))
    assert t.returncode == 0, t.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    lanes = timeline_model(receipt).lanes
    assert lanes[:2] == ("controller", "controller -> localhost") and "unit:unit-0 @ localhost" in lanes


def test_failed_run_exits_1_with_the_error(tmp_path: Path) -> None:
    p = _coldsnap("status", "--request-json", str(_request_file(tmp_path, "status")),
                  "--playbook", str(PLAYBOOKS / "fail.yml"), "--state-root", str(tmp_path / "state"))
    assert p.returncode == 1
    receipt = load_receipt(p.stdout)
    assert receipt["state"] == "failed" and receipt["replay_semantics"] == "convergent"
    assert "the disk is on fire" in receipt["error"]["message"]
    assert "coldsnap status: failed" in p.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_signal_cancels_and_still_writes_the_receipt(tmp_path: Path, signum: int) -> None:
    out, ndjson = tmp_path / "receipt.json", tmp_path / "t.ndjson"
    proc = subprocess.Popen(
        [sys.executable, "-m", "coldsnap.cli", "sleep", "--request-json", str(_request_file(tmp_path, "sleep")),
         "--playbook", str(PLAYBOOKS / "long.yml"), "--state-root", str(tmp_path / "state"),
         "--receipt-json", str(out), "--timing-ndjson", str(ndjson), "--progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if ndjson.exists() and '"name":"Long task"' in ndjson.read_text():
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        else:
            raise AssertionError("the long task never started")
        time.sleep(0.3)
        os.kill(proc.pid, signum)
        _unused, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    receipt = load_receipt(out.read_bytes())
    assert receipt["state"] == "failed" and receipt["error"]["task"] == "Long task"
    assert "cancelled" in receipt["error"]["message"]
    assert "CANCELLED" in stderr and "Long task" in stderr  # --progress lines
    assert read_ndjson(ndjson)[-1]["event"] == "envelope"


def _pids_of(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], check=False, capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_a_controller_killed_with_9_leaves_a_playbook_that_blocks_the_workload_until_it_ends(tmp_path: Path) -> None:
    from coldsnap.runner.proctree import playbooks_in, terminate_tree

    state = tmp_path / "state"
    request = _request_file(tmp_path, "sleep")
    other = tmp_path / "request-other.json"
    other.write_text(json.dumps(request_for("sleep", id="sleep-after-a-kill")))
    proc = subprocess.Popen([sys.executable, "-m", "coldsnap.cli", "sleep", "--request-json", str(request),
                             "--playbook", str(PLAYBOOKS / "long.yml"), "--state-root", str(state)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first_id = request_for("sleep")["id"]
    project = state / "runs" / first_id / "project"
    try:
        deadline = time.monotonic() + 60
        while not _pids_of("sleep 61.737"):
            assert time.monotonic() < deadline and proc.poll() is None, "the long task never started"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        orphans = playbooks_in(project)
        assert orphans, "the playbook went with its controller: nothing to guard"
        for again in (request, other):  # the same operation, then another one of the same workload
            p = _coldsnap("sleep", "--request-json", str(again), "--playbook", str(PLAYBOOKS / "succeed.yml"),
                          "--state-root", str(state))
            assert p.returncode != 0 and f"operation {first_id}" in p.stderr, p.stderr
            assert "is still running" in p.stderr and f"kill {orphans[0]}" in p.stderr, p.stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in playbooks_in(project):
            terminate_tree(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in _pids_of("sleep 61.737"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while playbooks_in(project) and time.monotonic() < deadline:
        time.sleep(0.2)
    p = _coldsnap("sleep", "--request-json", str(other), "--playbook", str(PLAYBOOKS / "succeed.yml"),
                  "--state-root", str(state))
    assert p.returncode == 0, p.stderr
