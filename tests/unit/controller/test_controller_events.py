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


def _restore_events(collector, *, activated: bool) -> None:
    """A one-host restore as ansible-runner reports it: the evict step stopped unit-0's engine, then the
    activation failed (or passed)."""
    evict = {"changed": True, "stopped": [{"unit": "unit-0", "pid": 4242, "pids": [4242], "processes": 3}],
             "coldsnap_evicted": {"host": "gpu-a", "units": [{"unit": "unit-0", "pid": 4242, "pids": [4242],
                                                              "processes": 3}]}}
    collector({"event": "runner_on_ok", "counter": 1, "event_data": {
        "host": "gpu-a", "task": "Evict this workload's running engines on the host", "res": evict,
        "play": "ColdSnap restore | evict and activate"}})
    if activated:
        res, event = {"changed": True, "units": [], "coldsnap_evicted": {"host": "gpu-a", "restored": True}}, "ok"
    else:
        res, event = {"failed": True, "msg": "unit unit-0: the engine (pid 4242) died right after CRIU restored it"}, \
            "failed"
    collector({"event": f"runner_on_{event}", "counter": 2, "event_data": {
        "host": "gpu-a", "task": "Restore the units on this host", "res": res,
        "play": "ColdSnap restore | evict and activate"}})


def test_a_restore_that_failed_after_eviction_says_so_in_its_error_and_records_it() -> None:
    """The receipt of a restore that failed after eviction: result.eviction says the workload that ran
    before was evicted (unit, pids) and is not running, the error message says it once with how to serve
    again; the receipt stays a valid format-2 receipt. One that succeeded says the workload was replaced."""
    import datetime as dt

    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import eviction
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.timing import SpanRecorder

    from coldsnap.receipts import build_receipt
    from coldsnap.runner.driver import _error, with_eviction
    from coldsnap.runner.events import EventCollector
    from coldsnap.runner.redaction import Redactor

    def collector() -> EventCollector:
        return EventCollector(SpanRecorder("controller"), parent_span_id=None, redactor=Redactor(),
                              progress=ProgressReporter(False, stream=io.StringIO()))

    failed = collector()
    _restore_events(failed, activated=False)
    record = eviction.receipt_record(failed.evictions, succeeded=False, interrupted=False)
    assert record["previous_workload"] == "evicted" and record["evicted"] is True
    assert record["units"] == [{"host": "gpu-a", "unit": "unit-0", "pid": 4242, "pids": [4242], "processes": 3,
                                "restored": False}]
    error = _error(failed, cancelled=False, in_flight=[], controller_error=None, runner_status="failed", rc=2)
    error["message"] = with_eviction(error["message"], record)
    assert error["message"].count(eviction.EVICTED_PHRASE) == 1, error["message"]
    assert "unit unit-0 on gpu-a (engine pid 4242)" in error["message"]
    assert "restore again" in error["message"] and "recovery" in error["message"]
    # Said by the module already: not told twice.
    assert with_eviction(error["message"], record) == error["message"]

    now = dt.datetime.now(dt.UTC)
    receipt = build_receipt(operation_id="op-1", operation="restore", prepare_only=False, succeeded=False,
                            request=None, started_at=now, completed_at=now, duration_seconds=0.0,
                            timing=SpanRecorder("controller").finish("op-1"), result={"eviction": record},
                            error=error)
    assert receipt["result"]["eviction"]["previous_workload"] == "evicted"

    ok = collector()
    _restore_events(ok, activated=True)
    assert eviction.receipt_record(ok.evictions, succeeded=True, interrupted=False)["previous_workload"] == "replaced"


def test_a_restore_that_failed_before_eviction_says_nothing_was_evicted() -> None:
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import eviction

    from coldsnap.runner.driver import _may_evict, with_eviction

    record = eviction.receipt_record({}, succeeded=False, interrupted=False)
    said = with_eviction("task 'Prepare the restore' failed on gpu-a: unit unit-0: GPU model differs", record)
    assert said.count(eviction.UNTOUCHED_PHRASE) == 1 and eviction.EVICTED_PHRASE not in said
    # Cut off in the play that evicts, before its evict step reported: not known, and said so.
    assert _may_evict("ColdSnap restore | evict and activate")
    assert not _may_evict("ColdSnap restore | prepare every host (nothing is evicted)")
    unknown = eviction.receipt_record({}, succeeded=False, interrupted=True)
    assert "may have evicted" in with_eviction("operation cancelled while task 'Evict' was running", unknown)
