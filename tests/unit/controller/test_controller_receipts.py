"""Receipt format 2 as the controller builds it, for every operation."""

from __future__ import annotations

import datetime as dt
import json
import stat
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import FormatError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.receipt import load_receipt
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import OPERATIONS, request_sha256
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.timing import SpanRecorder

from coldsnap.receipts import build_receipt, rfc3339, write_receipt

EXPECTED = {
    "capture": "conflict-on-existing-output",
    "publish": "content-idempotent",
    "publish-native": "content-idempotent",
    "restore": "reconcile-replace",
    "warm": "reconcile-replace",
    "sleep": "convergent",
    "wake": "convergent",
    "status": "convergent",
    "native-status": "convergent",
    "delete": "convergent",
    "stop": "convergent",
}


def _receipt(op: str, *, prepare_only: bool = False, request: dict | None = None, error: dict | None = None) -> dict:
    rec = SpanRecorder("controller")
    span = rec.start_span(f"coldsnap.{op}")
    rec.end_span(span)
    t0 = dt.datetime(2026, 11, 29, 11, 0, 0, tzinfo=dt.UTC)
    return build_receipt(operation_id="op-1", operation=op, prepare_only=prepare_only, succeeded=error is None,
                         request=request, started_at=t0, completed_at=t0 + dt.timedelta(seconds=2.5),
                         duration_seconds=2.5, timing=rec.finish("op-1"), result={"tasks": []}, error=error)


@pytest.mark.parametrize("op", OPERATIONS)
def test_replay_semantics_per_operation(op: str) -> None:
    assert _receipt(op)["replay_semantics"] == EXPECTED[op]


@pytest.mark.parametrize("op", ["restore", "warm"])
def test_prepare_only_is_safe_repeat(op: str) -> None:
    r = _receipt(op, prepare_only=True)
    assert r["replay_semantics"] == "safe-repeat"
    assert r["prepare_only"] is True


def test_receipt_fields_from_request(example_request_text: str) -> None:
    req = json.loads(example_request_text)
    r = _receipt("capture", request=req)
    assert r["request_sha256"] == request_sha256(req)
    assert r["engine"] == "reference" and r["snapshot_driver"] == "n610"
    assert r["started_at"] == "2026-11-29T11:00:00.000000Z"
    assert r["completed_at"] == "2026-11-29T11:00:02.500000Z"
    assert r["state"] == "succeeded" and r["error"] is None


def test_failed_receipt_carries_error() -> None:
    r = _receipt("restore", error={"message": "task 'x' failed on h: boom", "host": "h", "task": "x", "phase": "p"})
    assert r["state"] == "failed"
    assert r["error"]["host"] == "h"


def test_invalid_receipt_is_refused() -> None:
    with pytest.raises(FormatError):
        _receipt("capture", error={"message": 3})


def test_rfc3339_is_utc() -> None:
    moment = dt.datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    assert rfc3339(moment) == "2026-01-02T01:04:05.000006Z"


def test_write_receipt_roundtrips_and_is_atomic(tmp_path: Path) -> None:
    r = _receipt("status")
    path = write_receipt(tmp_path / "out" / "receipt.json", r, mode=0o600)
    assert load_receipt(path.read_bytes())["operation_id"] == "op-1"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["receipt.json"]  # no temp file left behind


def test_a_run_whose_records_are_not_clean_json_still_gets_a_receipt_its_loader_takes(tmp_path: Path) -> None:
    """An error quoting a file name that is not UTF-8 (surrogate escapes), a NaN rate or a 2**70 counter in a
    span: the writer records them as JSON the loader takes back, never fails the receipt."""
    rec = SpanRecorder("controller")
    with pytest.raises(OSError), rec.span("controller.read", rate=float("nan")):
        raise OSError("cannot read /srv/models/caf\udce9")
    rec.mark("controller.bytes", total=2 ** 70, where=Path("/srv"))
    t0 = dt.datetime(2026, 11, 29, 11, 0, 0, tzinfo=dt.UTC)
    receipt = build_receipt(operation_id="op-1", operation="capture", prepare_only=False, succeeded=False,
                            request=None, started_at=t0, completed_at=t0, duration_seconds=1.0,
                            timing=rec.finish("op-1"), result={"why": "open('\udcff')", "inf": float("inf")},
                            error={"message": "cannot read /srv/models/caf\udce9"})
    path = write_receipt(tmp_path / "receipt.json", receipt)
    loaded = load_receipt(path.read_bytes())
    assert loaded["error"]["message"] == "cannot read /srv/models/caf\ufffd"
    assert loaded["result"] == {"why": "open('\ufffd')", "inf": None}
    span = loaded["timing"]["spans"][0]
    assert span["attrs"]["rate"] is None and span["attrs"]["error"].endswith("caf\ufffd")
    assert loaded["timing"]["marks"][0]["attrs"] == {"total": float(2 ** 70), "where": "/srv"}
    # a receipt rewritten later (a rollback appends to its message) is made loadable the same way
    rewritten = {**loaded, "error": {"message": loaded["error"]["message"] + " and /srv/\udcff"}}
    assert load_receipt(write_receipt(tmp_path / "again.json", rewritten).read_bytes())["error"]["message"] \
        .endswith("/srv/\ufffd")
