"""Operation receipt, format 2, and the replay semantics of each operation."""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import FormatError, FormatIssue
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import OPERATIONS, Digest, Ident
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.schema import (
    AnyJSON,
    Bool,
    Const,
    Field,
    Nullable,
    Num,
    Obj,
    Str,
    json_schema_document,
    validate_document,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.strictjson import strict_loads
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.timing import (
    ENVELOPE_KIND,
    TIMING_FORMAT,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.versions import (
    RECEIPT_FORMAT,
    RECEIPT_KIND,
)

REPLAY_SEMANTICS = {
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
PREPARE_ONLY_SEMANTICS = "safe-repeat"
SEMANTICS = tuple(sorted(set(REPLAY_SEMANTICS.values()) | {PREPARE_ONLY_SEMANTICS}))


def replay_semantics(operation: str, *, prepare_only: bool = False) -> str:
    """What repeating the operation does: the receipt states it for every run."""
    if prepare_only:
        return PREPARE_ONLY_SEMANTICS
    return REPLAY_SEMANTICS[operation]


_RFC3339 = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,6})?(?:Z|[+-]\d\d:\d\d)")


# A receipt's timing and result describe the whole fleet's run: one restored host adds some 750 JSON values
# of spans, so the opaque-data bound of task arguments (MAX_OPAQUE_VALUES) would refuse a receipt of about
# 135 hosts after the playbook acted. Receipts are bounded for fleets of thousands of hosts instead (and the
# controller reads no document above 64 MiB).
MAX_RECEIPT_VALUES = 2_000_000
_RECEIPT_TOO_BIG_FIX = (f"a receipt holds at most {MAX_RECEIPT_VALUES} values in each of timing and result (the "
                        "spans of some 2,500 hosts): run the operation on fewer hosts at a time, or check where "
                        "this receipt came from")


def _receipt_data() -> AnyJSON:
    return AnyJSON(object_only=True, max_values=MAX_RECEIPT_VALUES, too_big_fix=_RECEIPT_TOO_BIG_FIX)


_RFC3339_FIX = "write an RFC 3339 time with its offset (at most microseconds), such as 2026-11-29T11:08:00.123456Z"


def _rfc3339(value: str) -> tuple[str, str] | None:
    """A real date and time in the RFC 3339 form the pattern admits (no 30 February, no offset minute 60)."""
    try:
        dt.datetime.fromisoformat(value)
    except ValueError:
        return f"{value!r} is not a valid date and time", _RFC3339_FIX
    if not value.endswith("Z") and int(value[-2:]) > 59:
        return f"{value!r} has an offset minute above 59", _RFC3339_FIX
    return None


def Timestamp(description: str = "") -> Str:
    """An RFC 3339 date and time with its offset."""
    return Str(description=description, pattern=_RFC3339.pattern, check=_rfc3339, pattern_fix=_RFC3339_FIX)


RECEIPT_SCHEMA = Obj({
    "format": Field(Const(RECEIPT_FORMAT)),
    "kind": Field(Const(RECEIPT_KIND)),
    "operation_id": Field(Ident()),
    "operation": Field(Str(enum=OPERATIONS)),
    "prepare_only": Field(Bool(), required=False, default=False),
    "state": Field(Str(enum=("succeeded", "failed", "running")),
                   description="'running' is written when a run starts and replaced when it ends: a run whose "
                               "controller died keeps saying so, never an older run's outcome"),
    "request_sha256": Field(Nullable(Digest())),
    "engine": Field(Nullable(Str())),
    "snapshot_driver": Field(Nullable(Str())),
    "replay_semantics": Field(Str(enum=SEMANTICS)),
    "started_at": Field(Timestamp()),
    "completed_at": Field(Nullable(Timestamp()), description="null while running"),
    "duration_seconds": Field(Num(minimum=0)),
    "timing": Field(_receipt_data()),
    "result": Field(Nullable(_receipt_data())),
    "error": Field(Nullable(Obj({
        "message": Field(Str()),
        "host": Field(Nullable(Str()), required=False, default=None),
        "task": Field(Nullable(Str()), required=False, default=None),
        "phase": Field(Nullable(Str()), required=False, default=None),
    }))),
}, title="ColdSnap operation receipt (format 2)")


def receipt_json_schema() -> dict:
    """JSON Schema of receipt format 2."""
    return json_schema_document(RECEIPT_SCHEMA, schema_id="https://coldsnap.invalid/schemas/receipt-v2.json",
                                title="ColdSnap operation receipt, format 2")


def validate_receipt(value: Any, *, document: str = "receipt") -> dict:
    """Validate a receipt object (what the controller writes)."""
    receipt = validate_document(RECEIPT_SCHEMA, value, document=document)
    issues: list[FormatIssue] = []
    want = replay_semantics(receipt["operation"], prepare_only=receipt["prepare_only"])
    if receipt["replay_semantics"] != want:
        verb = receipt["operation"] + (" --prepare-only" if receipt["prepare_only"] else "")
        problem = f"{receipt['replay_semantics']!r} is not what repeating {verb} does"
        issues.append(FormatIssue("$.replay_semantics", problem, f"set it to {want!r}"))
    state, completed, error = receipt["state"], receipt["completed_at"], receipt["error"]
    if state == "running":
        if completed is not None:
            issues.append(FormatIssue("$.completed_at", "a running operation has no completion time",
                                      "set it to null, or state to the outcome"))
    elif completed is None:
        issues.append(FormatIssue("$.completed_at", f"a {state} operation has ended: its completion time is missing",
                                  "give the time it ended (RFC 3339)"))
    elif dt.datetime.fromisoformat(completed) < dt.datetime.fromisoformat(receipt["started_at"]):
        issues.append(FormatIssue("$.completed_at", f"{completed} is before started_at {receipt['started_at']}",
                                  "give the time the operation ended, after it started"))
    timing = receipt["timing"]
    if state != "running" and not (timing.get("format") == TIMING_FORMAT and timing.get("kind") == ENVELOPE_KIND
                                   and timing.get("operation_id") == receipt["operation_id"]
                                   and isinstance(timing.get("spans"), list) and isinstance(timing.get("marks"), list)):
        issues.append(FormatIssue("$.timing", f"is not the timing envelope (format {TIMING_FORMAT}, kind "
                                  f"{ENVELOPE_KIND!r}, spans and marks) of operation {receipt['operation_id']!r}",
                                  "embed the envelope the operation's timing stream ended with"))
    if state == "failed" and error is None:
        issues.append(FormatIssue("$.error", "a failed operation must say why", "give error.message"))
    if state != "failed" and error is not None:
        issues.append(FormatIssue("$.error", f"a {state} operation has no error", "set it to null, or state to failed"))
    if issues:
        raise FormatError(issues, document=document)
    return receipt


def load_receipt(text: str | bytes, *, document: str = "receipt") -> dict:
    """Decode and validate a receipt file (another ColdSnap document is named as such, not dissected);
    ``document``: how errors name it (``receipt /path/receipt.json``)."""
    return validate_receipt(strict_loads(text, document=document), document=document)
