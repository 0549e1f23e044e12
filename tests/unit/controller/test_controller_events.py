"""Pieces of event handling that need no ansible run: unit timing import, messages, progress."""

from __future__ import annotations

import io

from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.timing import (
    SpanRecorder,
    validate_event,
)

from coldsnap.runner.events import normalize_unit_timing, result_message
from coldsnap.runner.progress import ProgressReporter, format_progress


def _unit_payload() -> dict:
    rec = SpanRecorder("unit:unit-0", host="gpu-a", unit="unit-0")
    with rec.span("unit.restore"), rec.span("unit.criu.restore", pages=3):
        pass
    rec.mark("unit.ready")
    return {"spans": rec.spans, "marks": rec.marks}


def test_unit_timing_is_kept_on_its_clock_and_ids_are_prefixed() -> None:
    spans, marks, problems = normalize_unit_timing(_unit_payload(), host="gpu-a", tag="gpu-a#12.0")
    assert problems == []
    assert {s["clock"] for s in spans} == {"unit:unit-0"}
    by_name = {s["name"]: s for s in spans}
    assert by_name["unit.criu.restore"]["parent_id"] == by_name["unit.restore"]["span_id"]
    assert all(s["span_id"].startswith("gpu-a#12.0/") for s in spans)
    assert by_name["unit.criu.restore"]["attrs"] == {"pages": 3}
    assert marks[0]["name"] == "unit.ready" and marks[0]["clock"] == "unit:unit-0"


def test_unit_timing_fills_host_and_unit() -> None:
    payload = {"spans": [{"name": "unit.x", "clock": "unit:u7", "start_ns": 5, "end_ns": 9}]}
    spans, _unused, problems = normalize_unit_timing(payload, host="h1", tag="t")
    assert problems == []
    assert spans[0]["host"] == "h1" and spans[0]["unit"] == "u7" and spans[0]["status"] == "ok"


def test_unit_timing_cannot_claim_the_controller_clock() -> None:
    payload = {"spans": [{"name": "x", "clock": "controller", "start_ns": 1, "end_ns": 2},
                         {"name": "y", "clock": "unit:u", "start_ns": 5, "end_ns": 4},
                         {"name": "", "clock": "unit:u", "start_ns": 1, "end_ns": 2},
                         {"name": "z", "clock": "unit:u", "start_ns": True, "end_ns": 2},
                         "nonsense"],
               "marks": [{"name": "m", "clock": "controller", "t_ns": 1}]}
    spans, marks, problems = normalize_unit_timing(payload, host="h", tag="t")
    assert spans == [] and marks == []
    assert len(problems) == 6
    assert any("controller" in p for p in problems)
    assert normalize_unit_timing([1, 2], host="h", tag="t")[2]


def test_imported_spans_stream_valid_events() -> None:
    events: list[dict] = []
    rec = SpanRecorder("controller", sink=events.append)
    spans, marks, _unused = normalize_unit_timing(_unit_payload(), host="gpu-a", tag="x")
    rec.import_spans(spans, marks)
    assert len(events) == 2
    for e in events:
        validate_event(e)
        assert e["clock"] == "unit:unit-0" and e["host"] == "gpu-a"


def test_start_and_end_span_stream_a_pair() -> None:
    events: list[dict] = []
    rec = SpanRecorder("controller", sink=events.append)
    span = rec.start_span("Stage payload", parent_id="controller/0", host="gpu-a")
    rec.end_span(span, status="failed", changed=True)
    assert [e["event"] for e in events] == ["span-start", "span-end"]
    assert events[0]["span_id"] == events[1]["span_id"] == span["span_id"]
    assert events[1]["attrs"]["status"] == "failed" and events[1]["attrs"]["changed"] is True
    env = rec.envelope("op")
    assert env["spans"][0]["parent_id"] == "controller/0" and env["spans"][0]["end_ns"] >= span["start_ns"]


def test_result_message_includes_stderr_on_failure() -> None:
    res = {"msg": "non-zero return code", "stderr": "line1\nline2\nfatal: disk full\n"}
    assert result_message(res, failed=True) == "non-zero return code; stderr: line1 / line2 / fatal: disk full"
    assert result_message(res, failed=False) == "non-zero return code"
    assert result_message({}, failed=False) is None
    assert result_message({"msg": {"a": 1}}, failed=False) == '{"a": 1}'
    loop = {"results": [{"failed": True, "msg": "item 2 broke"}, {"failed": False, "msg": "fine"}]}
    assert result_message(loop, failed=True) == "item 2 broke"
    assert len(result_message({"msg": "x" * 10000}, failed=False)) <= 2000


def test_format_progress_shapes() -> None:
    assert format_progress({"phase": "stage", "message": "payload", "done": 512, "total": 1024, "unit": "MiB"}) == [
        "stage: payload 512/1024 MiB (50%)"]
    assert format_progress("plain text") == ["plain text"]
    assert format_progress([{"done": 3}, {"message": "m"}]) == ["3", "m"]
    assert format_progress(None) == []


def test_progress_reporter_writes_only_when_enabled() -> None:
    out = io.StringIO()
    ProgressReporter(False, stream=out).task_started("h", "t")
    assert out.getvalue() == ""
    rep = ProgressReporter(True, stream=out)
    rep.task_started("gpu-a", "Stage payload")
    rep.task_finished("gpu-a", "Stage payload", "failed", 1.25, "checksum mismatch")
    rep.progress("gpu-a", "Stage payload", {"done": 1, "total": 4})
    text = out.getvalue()
    assert "gpu-a" in text and "FAILED" in text and "(1.2s): checksum mismatch" in text and "1/4 (25%)" in text


def test_a_failure_whose_result_runner_left_out_keeps_its_message() -> None:
    """ansible-runner drops an event's result above its size limit (a task with a huge argument): the
    receipt's error still carries the module's message, read from the line ansible-playbook printed."""
    import io

    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.timing import SpanRecorder

    from coldsnap.runner.events import EventCollector
    from coldsnap.runner.progress import ProgressReporter
    from coldsnap.runner.redaction import Redactor

    collector = EventCollector(SpanRecorder("controller"), parent_span_id=None, redactor=Redactor(),
                               progress=ProgressReporter(False, stream=io.StringIO()))
    shown = 'fatal: [localhost]: FAILED! => {"changed": false, "msg": "unit unit-0: the engine refused /resume"}'
    for task, stdout in (("Capture", shown), ("Restore", "fatal: [h]: FAILED! => not json at all")):
        collector({"event": "runner_on_failed", "stdout": stdout,
                   "event_data": {"host": "localhost", "task": task, "res": {}}})
    assert [f["msg"] for f in collector.failures] == ["unit unit-0: the engine refused /resume", "not json at all"]


def test_a_playbook_killed_mid_task_is_named_with_the_task_it_was_in() -> None:
    """ansible-playbook killed from outside (kill -9, the OOM killer) reports no exit status and no failure:
    the receipt's error names the task it was in and the host, never "no task failed" with rc None."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.timing import SpanRecorder

    from coldsnap.runner.driver import _error
    from coldsnap.runner.events import EventCollector
    from coldsnap.runner.redaction import Redactor

    collector = EventCollector(SpanRecorder("controller"), parent_span_id=None, redactor=Redactor(),
                               progress=ProgressReporter(False, stream=io.StringIO()))
    task = "Prepare the restore (admission, capsule state, pids and ports, weight provider)"
    in_flight = [{"host": "localhost", "task": task, "play": "prepare", "action": "coldsnap.fleet.unit_restore"}]
    error = _error(collector, cancelled=False, in_flight=in_flight, controller_error=None, runner_status="failed",
                   rc=None)
    assert error["task"] == task and error["host"] == "localhost"
    assert "killed by a signal" in error["message"] and f"while task {task!r} was running on localhost" \
        in error["message"]
    assert "rc None" not in error["message"]
