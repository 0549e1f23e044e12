"""Output for people: the summary on a terminal, the receipt JSON with --json or when piped; runs list/show."""

from __future__ import annotations

import datetime as dt
import io
import json
import os
import pty
import select
import sys
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import file_lock
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.timing import SpanRecorder

from coldsnap import api
from coldsnap.cli import main
from coldsnap.receipts import build_receipt, receipt_bytes, write_receipt
from coldsnap.runner.driver import OperationResult
from coldsnap.summary import format_duration, format_summary

T0 = dt.datetime(2026, 11, 29, 11, 0, 0, tzinfo=dt.UTC)


class _Terminal(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def _request(text: str, operation: str) -> dict:
    req = json.loads(text)
    req["operation"] = operation
    return req


def _receipt(request_text: str, operation: str = "restore", *, operation_id: str = "op-1", error: dict | None = None,
             result_operation: dict | None = None, started: dt.datetime = T0, duration: float = 11.4,
             running: bool = False, cancelled: bool = False) -> dict:
    rec = SpanRecorder("controller")
    rec.end_span(rec.start_span(f"coldsnap.{operation}"))
    result = {"playbook": "x.yml", "runner": {"ident": "1", "status": "failed" if error else "successful",
                                              "rc": 1 if error else 0, "cancelled": cancelled},
              "tasks": [], "stats": {}, "unreachable_hosts": [], "failed_hosts": ["gpu-a"] if error else [],
              "custom_stats": {}, "operation": result_operation}
    return build_receipt(operation_id=operation_id, operation=operation, prepare_only=False,
                         succeeded=error is None, request=_request(request_text, operation), started_at=started,
                         completed_at=None if running else started + dt.timedelta(seconds=duration),
                         duration_seconds=0.0 if running else duration, timing=rec.finish(operation_id),
                         result=None if running else result, error=error, running=running)


RESTORED = {"capture_id": "cap-1", "units": [
    {"unit": "unit-0", "host": "gpu-a", "ok": True, "warm": False,
     "readiness": {"ttr_port_open_s": 0.136975, "ttr_http_ready_s": 0.246975, "ttft_s": 0.261761}},
    {"unit": "unit-1", "host": "gpu-b", "ok": True, "warm": False, "readiness": {"ttr_port_open_s": 0.2}},
]}
CAPTURED = {"artifact": "/srv/coldsnap/captures/cap-1/artifact.json", "capture_id": "cap-1", "generation": 3,
            "capsules": [{"unit": "unit-0"}],
            "acceptance": {"reply": "x",
                           "evidence": {"unit-0": {"host": "gpu-a", "readiness": {"ttft_s": 1.5}}}}}
FAILED = {"message": "unit unit-0: validation reply differs from the accepted one; recapture, or check the weights",
          "host": "gpu-a", "task": "Restore the units on this host", "phase": "Evict and restore"}


# ----------------------------------------------------------------------------- the summary itself

def test_summary_of_a_restore(example_request_text) -> None:
    text = format_summary(_receipt(example_request_text, result_operation=RESTORED), receipt_path="/s/runs/op-1/r.json")
    lines = text.splitlines()
    assert lines[0] == "coldsnap restore op-1: succeeded in 11.40 s"
    assert "2026-11-29T11:00:00.000000Z" in text and "reference" in text
    unit0 = next(line for line in lines if "unit-0 @ gpu-a" in line)
    assert "ok" in unit0 and "port open 0.137 s, HTTP ready 0.247 s, TTFT 0.262 s" in unit0
    assert "unit-1 @ gpu-b" in text and "port open 0.200 s" in text
    assert lines[-1].split() == ["receipt", "/s/runs/op-1/r.json"]
    assert "error" not in text
    assert len(text) < 1000  # a summary, not the receipt


def test_summary_of_a_restore_onto_another_port_says_where_it_serves(example_request_text) -> None:
    moved = {"capture_id": "cap-1", "units": [
        {"unit": "unit-0", "host": "gpu-a", "ok": True, "served": {"address": "127.0.0.1", "port": 9000},
         "listeners_moved": [{"worker": "worker-0", "from": ["127.0.0.1", 8000], "to": ["127.0.0.1", 9000]}],
         "readiness": {"ttft_s": 0.5}},
        {"unit": "unit-1", "host": "gpu-b", "ok": True, "served": {"address": "127.0.0.1", "port": 8001},
         "listeners_moved": [], "readiness": {"ttft_s": 0.5}}]}
    lines = format_summary(_receipt(example_request_text, result_operation=moved)).splitlines()
    assert "serving 127.0.0.1:9000, TTFT 0.500 s" in next(line for line in lines if "unit-0 @ gpu-a" in line)
    assert "serving" not in next(line for line in lines if "unit-1 @ gpu-b" in line), "only a move is worth a word"


def test_summary_of_a_capture_names_the_artifact(example_request_text) -> None:
    text = format_summary(_receipt(example_request_text, "capture", result_operation=CAPTURED))
    assert "artifact  /srv/coldsnap/captures/cap-1/artifact.json" in text
    assert "cap-1 (generation 3)" in text
    assert "unit-0 @ gpu-a" in text and "TTFT 1.500 s" in text


def test_summary_of_a_failure_has_the_message_and_where(example_request_text) -> None:
    text = format_summary(_receipt(example_request_text, error=FAILED, cancelled=True))
    assert text.splitlines()[0].startswith("coldsnap restore op-1: failed (cancelled) in")
    flat = " ".join(text.split())
    assert "error validation" not in flat and "unit unit-0: validation reply differs" in flat
    assert "recapture, or check the weights" in flat  # the fix travels in the message
    assert "phase 'Evict and restore' task 'Restore the units on this host' on gpu-a" in flat
    assert "failed on gpu-a" in flat


@pytest.mark.parametrize(("seconds", "text"), [(0.844, "0.84 s"), (59.994, "59.99 s"), (187, "3 min 07 s"),
                                               (3725, "1 h 02 min"), (None, "-")])
def test_durations(seconds, text) -> None:
    assert format_duration(seconds) == text


# ----------------------------------------------------------------------------- the operation verbs

@pytest.fixture
def fake_run(monkeypatch, tmp_path, example_request_text):
    """run_playbook replaced: it returns a receipt built with the real builder, written where the driver would."""
    state = {"receipt": _receipt(example_request_text, "capture", result_operation=CAPTURED)}

    def run_playbook(*, operation, request, state_root, **_kwargs):
        receipt = state["receipt"]
        run_dir = Path(state_root) / "runs" / receipt["operation_id"]
        run_dir.mkdir(parents=True, exist_ok=True)
        path = write_receipt(run_dir / "receipt.json", receipt)
        return OperationResult(operation_id=receipt["operation_id"], operation=operation,
                               succeeded=receipt["state"] == "succeeded", cancelled=False, receipt=receipt,
                               receipt_path=path, run_dir=run_dir, artifact_dir=run_dir / "artifacts" / "1",
                               runner_status="successful", rc=0)

    monkeypatch.setattr(api, "run_playbook", run_playbook)
    req = tmp_path / "request.json"
    req.write_text(example_request_text)
    return state, req, tmp_path / "state"


def test_piped_stdout_gets_the_receipt_json_as_before(fake_run, capsys) -> None:
    state, req, root = fake_run
    assert main(["capture", "--request-json", str(req), "--state-root", str(root)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == state["receipt"]
    assert out == json.dumps(state["receipt"], indent=2) + "\n"  # byte for byte what scripts parse today
    assert "coldsnap capture: succeeded\nreceipt: stdout" in err


def _run_on_pty(argv: list[str]) -> tuple[int, str]:
    """Run the CLI with stdout on a pseudo-terminal; return (exit status, what the terminal got)."""
    master, slave = pty.openpty()
    stream = open(slave, "w", encoding="utf-8", closefd=True)
    old = sys.stdout
    sys.stdout = stream
    try:
        rc = main(argv)
        stream.flush()
    finally:
        sys.stdout = old
        stream.close()
    chunks = []
    while select.select([master], [], [], 0.2)[0]:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the slave side is closed and drained
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return rc, b"".join(chunks).decode().replace("\r\n", "\n")


def test_terminal_gets_the_summary(fake_run, capsys) -> None:
    _state, req, root = fake_run
    rc, shown = _run_on_pty(["capture", "--request-json", str(req), "--state-root", str(root)])
    assert rc == 0
    assert shown.startswith("coldsnap capture op-1: succeeded in 11.40 s\n")
    assert "artifact  /srv/coldsnap/captures/cap-1/artifact.json" in shown
    assert f"receipt   {root / 'runs' / 'op-1' / 'receipt.json'}" in shown
    assert "{" not in shown  # no JSON
    assert capsys.readouterr().err == ""  # the summary is not repeated on stderr


def test_terminal_with_json_gets_the_receipt(fake_run, monkeypatch, capsys) -> None:
    state, req, root = fake_run
    monkeypatch.setattr(sys, "stdout", _Terminal())
    assert main(["capture", "--request-json", str(req), "--state-root", str(root), "--json"]) == 0
    assert json.loads(sys.stdout.getvalue()) == state["receipt"]


def test_failed_run_on_a_terminal_keeps_exit_status_1(fake_run, monkeypatch, example_request_text) -> None:
    state, req, root = fake_run
    state["receipt"] = _receipt(example_request_text, "capture", error=FAILED)
    monkeypatch.setattr(sys, "stdout", _Terminal())
    assert main(["capture", "--request-json", str(req), "--state-root", str(root)]) == 1
    shown = sys.stdout.getvalue()
    assert "op-1: failed in" in shown and "validation reply differs" in shown


def test_receipt_file_and_terminal(fake_run, monkeypatch, tmp_path) -> None:
    state, req, root = fake_run
    monkeypatch.setattr(sys, "stdout", _Terminal())
    out = tmp_path / "receipt.json"
    assert main(["capture", "--request-json", str(req), "--state-root", str(root), "--receipt-json", str(out)]) == 0
    assert json.loads(out.read_text()) == state["receipt"]
    assert f"receipt   {out}" in sys.stdout.getvalue()


def test_every_operation_verb_takes_json() -> None:
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import OPERATIONS

    from coldsnap.cli import build_parser

    parser = build_parser()
    for verb in OPERATIONS:
        args = parser.parse_args([verb, "--request-json", "-", "--json"])
        assert args.json is True, verb


# ----------------------------------------------------------------------------- runs list / show

@pytest.fixture
def state_root(tmp_path, example_request_text) -> Path:
    root = tmp_path / "state"
    runs = root / "runs"
    made = [
        _receipt(example_request_text, "capture", operation_id="cap-1", result_operation=CAPTURED),
        _receipt(example_request_text, "restore", operation_id="restore-1", result_operation=RESTORED,
                 started=T0 + dt.timedelta(minutes=5), duration=187.0),
        _receipt(example_request_text, "restore", operation_id="restore-2", error=FAILED,
                 started=T0 + dt.timedelta(minutes=10), duration=3.0),
        _receipt(example_request_text, "sleep", operation_id="sleep-1", running=True,
                 started=T0 + dt.timedelta(minutes=20)),
        _receipt(example_request_text, "wake", operation_id="wake-1", running=True,
                 started=T0 + dt.timedelta(minutes=15)),
    ]
    for r in made:
        (runs / r["operation_id"]).mkdir(parents=True)
        write_receipt(runs / r["operation_id"] / "receipt.json", r)
    (runs / "empty-1").mkdir()  # a run that stopped before it wrote a receipt
    (runs / "broken-1").mkdir()
    (runs / "broken-1" / "receipt.json").write_text('{"format": 2}')
    for name in ("empty-1", "broken-1"):  # without a start time they sort by the directory's age: the oldest
        os.utime(runs / name, (T0.timestamp() - 86400, T0.timestamp() - 86400))
    return root


def test_runs_list_json(state_root, capsys) -> None:
    with file_lock(state_root / "runs" / "sleep-1" / ".lock", timeout=0):  # a controller is running sleep-1
        assert main(["runs", "list", "--state-root", str(state_root)]) == 0
    rows = json.loads(capsys.readouterr().out)
    by_id = {r["operation_id"]: r for r in rows}
    assert [r["operation_id"] for r in rows] == ["sleep-1", "wake-1", "restore-2", "restore-1", "cap-1",
                                                 "empty-1", "broken-1"]  # newest first
    assert by_id["sleep-1"]["state"] == "running" and by_id["sleep-1"]["duration_seconds"] is None
    assert by_id["wake-1"]["state"] == "running (no controller)"
    assert by_id["restore-2"]["state"] == "failed" and by_id["restore-1"]["duration_seconds"] == 187.0
    assert by_id["empty-1"]["state"] == "no receipt" and by_id["empty-1"]["operation"] is None
    assert by_id["broken-1"]["state"] == "invalid receipt" and "receipt is invalid" in by_id["broken-1"]["problem"]
    assert "$.kind" in by_id["broken-1"]["problem"], "what is wrong, not only how many things are"
    assert by_id["cap-1"]["receipt"] == str(state_root / "runs" / "cap-1" / "receipt.json")


def test_runs_list_table_on_a_terminal(state_root, monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdout", _Terminal())
    assert main(["runs", "list", "--state-root", str(state_root), "-n", "4"]) == 0
    lines = sys.stdout.getvalue().splitlines()
    assert lines[0].split() == ["OPERATION", "ID", "OPERATION", "STATE", "STARTED", "DURATION"]
    assert len(lines) == 5
    assert lines[1].startswith("sleep-1 ") and "running (no controller)" in lines[1]
    restore = next(line for line in lines if line.startswith("restore-2"))
    assert "failed" in restore and "2026-11-29T11:10:00.000000Z" in restore and "3.00 s" in restore


def test_runs_list_without_runs(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdout", _Terminal())
    assert main(["runs", "list", "--state-root", str(tmp_path / "none")]) == 0
    assert sys.stdout.getvalue().startswith("no runs under ")


def test_runs_show(state_root, monkeypatch, capsys) -> None:
    path = state_root / "runs" / "restore-1" / "receipt.json"
    assert main(["runs", "show", "restore-1", "--state-root", str(state_root)]) == 0
    assert capsys.readouterr().out == path.read_text()  # piped: the receipt as written
    monkeypatch.setattr(sys, "stdout", _Terminal())
    assert main(["runs", "show", "restore-1", "--state-root", str(state_root)]) == 0
    shown = sys.stdout.getvalue()
    assert shown.startswith("coldsnap restore restore-1: succeeded in 3 min 07 s")
    assert "TTFT 0.262 s" in shown and str(path) in shown
    monkeypatch.setattr(sys, "stdout", _Terminal())
    assert main(["runs", "show", "restore-1", "--state-root", str(state_root), "--json"]) == 0
    assert sys.stdout.getvalue().encode() == receipt_bytes(json.loads(path.read_text()))


@pytest.mark.parametrize(("run_id", "message"), [("nope", "no run 'nope'"), ("empty-1", "has no receipt"),
                                                 ("broken-1", "has invalid receipt"), ("../x", "not an operation id")])
def test_runs_show_errors(state_root, capsys, run_id, message) -> None:
    assert main(["runs", "show", run_id, "--state-root", str(state_root)]) == 2
    assert message in capsys.readouterr().err


def test_runs_state_root_default(state_root, monkeypatch, capsys) -> None:
    monkeypatch.setenv("COLDSNAP_STATE_ROOT", str(state_root))
    assert main(["runs", "list", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 7


def test_runs_show_of_a_run_whose_controller_died_says_so(state_root, capsys) -> None:
    assert main(["runs", "show", "wake-1", "--state-root", str(state_root)]) == 0
    assert "no controller holds it" in capsys.readouterr().err
