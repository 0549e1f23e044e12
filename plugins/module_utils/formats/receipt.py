"""Operation receipt, format 2, and the replay semantics of each operation."""

from __future__ import annotations

from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import OPERATIONS, Digest, Ident
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.schema import (
    AnyJSON,
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


RECEIPT_SCHEMA = Obj({
    "format": Field(Const(RECEIPT_FORMAT)),
    "kind": Field(Const(RECEIPT_KIND)),
    "operation_id": Field(Ident()),
    "operation": Field(Str(enum=OPERATIONS)),
    "prepare_only": Field(AnyJSON(), required=False, default=False),
    "state": Field(Str(enum=("succeeded", "failed", "running")),
                   description="'running' is written when a run starts and replaced when it ends: a run whose "
                               "controller died keeps saying so, never an older run's outcome"),
    "request_sha256": Field(Nullable(Digest())),
    "engine": Field(Nullable(Str())),
    "snapshot_driver": Field(Nullable(Str())),
    "replay_semantics": Field(Str(enum=SEMANTICS)),
    "started_at": Field(Str(min_len=1)),
    "completed_at": Field(Nullable(Str(min_len=1)), description="null while running"),
    "duration_seconds": Field(Num(minimum=0)),
    "timing": Field(AnyJSON(object_only=True)),
    "result": Field(Nullable(AnyJSON(object_only=True))),
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


def validate_receipt(value: Any) -> dict:
    """Validate a receipt object (what the controller writes)."""
    return validate_document(RECEIPT_SCHEMA, value, document="receipt")


def load_receipt(text: str | bytes) -> dict:
    """Decode and validate a receipt file."""
    return validate_receipt(strict_loads(text, document="receipt"))
