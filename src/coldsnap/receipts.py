"""Receipt format 2: build, validate and write what an operation did.

A receipt is written for every run that got as far as starting the playbook,
also for failed and cancelled ones. It is validated before it is written and
written atomically (temp name, fsync, rename), so a reader sees either the old
receipt or the complete new one.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import atomic_write_bytes
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.receipt import (
    replay_semantics,
    validate_receipt,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import request_sha256
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.schema import json_safe
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.versions import (
    RECEIPT_FORMAT,
    RECEIPT_KIND,
)


def rfc3339(moment: dt.datetime) -> str:
    """RFC 3339 UTC timestamp with microseconds, e.g. ``2026-11-29T11:08:00.123456Z``."""
    return moment.astimezone(dt.UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def build_receipt(*, operation_id: str, operation: str, prepare_only: bool, succeeded: bool,
                  request: Mapping[str, Any] | None, started_at: dt.datetime, completed_at: dt.datetime | None,
                  duration_seconds: float, timing: dict, result: dict | None, error: dict | None,
                  running: bool = False) -> dict:
    """Assemble and validate a format-2 receipt (raises FormatError if it would be invalid).

    ``running``: the in-progress receipt written when a run starts (no completion time yet)."""
    receipt = {
        "format": RECEIPT_FORMAT,
        "kind": RECEIPT_KIND,
        "operation_id": operation_id,
        "operation": operation,
        "prepare_only": bool(prepare_only),
        "state": "running" if running else ("succeeded" if succeeded else "failed"),
        "request_sha256": request_sha256(dict(request)) if request is not None else None,
        "engine": request["launch"]["engine"] if request is not None else None,
        "snapshot_driver": request["snapshot_driver"]["id"] if request is not None else None,
        "replay_semantics": replay_semantics(operation, prepare_only=prepare_only),
        "started_at": rfc3339(started_at),
        # never before the start, whatever the wall clock did meanwhile
        "completed_at": rfc3339(max(completed_at, started_at)) if completed_at is not None else None,
        "duration_seconds": round(max(duration_seconds, 0.0), 6),
        "timing": timing,
        "result": result,
        "error": error,
    }
    receipt = _loadable(receipt)
    validate_receipt(receipt)
    return receipt


def _loadable(receipt: Mapping[str, Any]) -> dict:
    """What the run recorded (task results, error text, span attributes) as JSON the receipt's loader takes back:
    a message quoting a file name that is not UTF-8, or a NaN rate, must not cost the receipt."""
    return {**receipt, **{k: json_safe(receipt[k]) for k in ("timing", "result", "error") if k in receipt}}


def receipt_bytes(receipt: Mapping[str, Any]) -> bytes:
    """The receipt as written: indented JSON with a trailing newline."""
    return (json.dumps(receipt, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def write_receipt(path: Path, receipt: Mapping[str, Any], *, mode: int = 0o600) -> Path:
    """Validate and write a receipt atomically; returns the path."""
    receipt = _loadable(receipt)
    validate_receipt(receipt)
    atomic_write_bytes(Path(path), receipt_bytes(receipt), mode=mode)
    return Path(path)
