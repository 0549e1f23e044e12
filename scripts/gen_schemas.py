#!/usr/bin/env python3
"""Write (or --check) docs/schemas/*.schema.json from the format declarations in module_utils."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import coldsnap  # noqa: F401  (collection import path)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import artifact_json_schema
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.receipt import receipt_json_schema
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import request_json_schema

OUT = Path(__file__).resolve().parents[1] / "docs" / "schemas"
SCHEMAS = {
    "request-v4.schema.json": request_json_schema,
    "artifact-v9.schema.json": artifact_json_schema,
    "receipt-v2.schema.json": receipt_json_schema,
}


def main() -> int:
    check = "--check" in sys.argv
    stale = []
    for name, fn in SCHEMAS.items():
        text = json.dumps(fn(), indent=2) + "\n"
        path = OUT / name
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            OUT.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"docs/schemas out of date: {', '.join(stale)}; run 'make schemas'", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
