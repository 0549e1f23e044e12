"""Live progress from inside a long step: an async job waited for with coldsnap.fleet.job_wait,
run through the controller (real ansible-runner runs against localhost)."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.receipt import load_receipt
from controller_helpers import PLAYBOOKS, local_inventory

from coldsnap.runner import run_playbook
from coldsnap.runner.contract import RESULT_PROGRESS_KEY

MODULE = "coldsnap_fixture_slow_step"


def _run(tmp_path: Path, *, cancel: threading.Event | None = None, on_event=None, **fixture_vars):
    stream = io.StringIO()
    events: list[tuple[float, dict]] = []

    def handler(event: dict) -> None:
        events.append((time.monotonic(), event))
        if on_event is not None:
            on_event(event)

    extravars = {"fixture_progress_root": str(tmp_path / "progress"), **fixture_vars}
    result = run_playbook(operation="status", request=None, playbook=PLAYBOOKS / "live_progress.yml",
                          extravars=extravars, inventory=local_inventory(), state_root=tmp_path / "state",
                          progress=True, progress_stream=stream, event_handler=handler, cancel_event=cancel)
    return result, [e for _t, e in events], stream.getvalue()


def _progress_retries(events: list[dict]) -> list[dict]:
    return [e["event_data"]["res"] for e in events if e.get("event") == "runner_retry"
            and RESULT_PROGRESS_KEY in (e["event_data"].get("res") or {})]


def _job_processes() -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                # The module itself, not Ansible's async wrapper (it outlives a job by a few seconds).
                # (Ansible runs it as AnsiballZ_<module>.py or its exploded ansible_<module>_payload; a linter
                # that merely names the file is not the job.)
                ran = (b"AnsiballZ_" + MODULE.encode()) in cmdline or (b"ansible_" + MODULE.encode()) in cmdline
                if ran and b"async_wrapper" not in cmdline:
                    state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_progress_arrives_while_the_step_runs_then_its_own_result(tmp_path: Path) -> None:
    result, events, shown = _run(tmp_path, fixture_steps=12, fixture_interval=0.5)
    assert result.succeeded, result.receipt["error"]
    retries = _progress_retries(events)
    done = [r[RESULT_PROGRESS_KEY][0]["done"] for r in retries]
    assert len(set(done)) >= 2, done  # at least two distinct updates before the step ended
    assert all(r["finished"] is False for r in retries)
    names = [e["event"] for e in events]
    last_retry = max(i for i, e in enumerate(events) if e.get("event") == "runner_retry")
    finished = next(i for i, e in enumerate(events) if e.get("event") == "runner_on_ok"
                    and e["event_data"]["task"] == "Count slowly")
    assert last_retry < finished, names
    # The wait task hands back the step's own result: the register reads as in the foreground.
    final = events[finished]["event_data"]["res"]
    assert final["counted"] == 12 and final["changed"] is True and final["finished"] is True
    assert result.receipt["result"]["operation"] == {"counted": 12, "changed": True}
    # The terminal saw the progress lines live.
    assert "progress" in shown and "fixture count:" in shown and "steps" in shown
    # The receipt's phase of the step spans the job's real duration (launch + wait rows).
    rows = {t["task"]: t for t in result.receipt["result"]["tasks"]}
    assert rows["Count slowly"]["status"] == "ok" and rows["Count slowly (start)"]["changed"] is False
    spans = {s["name"]: s for s in result.receipt["timing"]["spans"]}
    assert (spans["Count slowly"]["end_ns"] - spans["Count slowly (start)"]["start_ns"]) / 1e9 >= 12 * 0.5
    # Job file and progress directory are gone.
    launch = next(e for e in events if e.get("event") == "runner_on_ok"
                  and e["event_data"]["task"] == "Count slowly (start)")["event_data"]["res"]
    assert not Path(launch["results_file"]).exists()
    assert not (tmp_path / "progress" / "count-localhost").exists()


def test_a_failure_inside_the_async_step_fails_with_the_modules_message(tmp_path: Path) -> None:
    msg = "payload sha256:ab12 does not match the artifact; stage it again"
    result, events, _shown = _run(tmp_path, fixture_steps=2, fixture_interval=0.2, fixture_fail_msg=msg)
    receipt = load_receipt(result.receipt_path.read_bytes())
    assert not result.succeeded and receipt["state"] == "failed"
    assert receipt["error"]["message"] == f"task 'Count slowly' failed on localhost: {msg}"
    assert receipt["error"]["task"] == "Count slowly"
    failed = next(e for e in events if e.get("event") == "runner_on_failed")["event_data"]["res"]
    assert failed["msg"] == msg and failed["counted"] == 2


def test_a_cancelled_run_leaves_no_job_running(tmp_path: Path) -> None:
    assert _job_processes() == []
    cancel = threading.Event()

    def on_event(event: dict) -> None:
        if event.get("event") == "runner_retry" and RESULT_PROGRESS_KEY in (event["event_data"].get("res") or {}):
            cancel.set()

    result, events, _shown = _run(tmp_path, cancel=cancel, on_event=on_event, fixture_steps=200,
                                  fixture_interval=0.2, fixture_lease=2)
    assert result.cancelled and result.exit_code == 130
    # The job is no longer below ansible-playbook (Ansible daemonizes it): its lease runs out and it
    # stops itself, saying why.
    deadline = time.monotonic() + 20
    while _job_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _job_processes() == []
    records = list((tmp_path / "progress" / "count-localhost").glob("*.progress.json"))
    assert any("cancelled" in p.read_text() for p in records)
    # Nobody waits for the job any more: its job file (a failure, the module was stopped) is left to us.
    launch = next(e for e in events if e.get("event") == "runner_on_ok"
                  and e["event_data"]["task"] == "Count slowly (start)")["event_data"]["res"]
    deadline = time.monotonic() + 10
    while '"failed": true' not in _read(Path(launch["results_file"])) and time.monotonic() < deadline:
        time.sleep(0.2)
    Path(launch["results_file"]).unlink(missing_ok=True)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
