"""``coldsnap validate`` and ``coldsnap schema``: check documents, print the JSON Schemas."""

from __future__ import annotations

import json
import os
import sys

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError, FormatError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import (
    artifact_json_schema,
    load_artifact,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.receipt import (
    load_receipt,
    receipt_json_schema,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import (
    driver_candidates,
    request_json_schema,
    validate_request,
)

from coldsnap import api
from coldsnap.commands._io import print_json, read_input

SCHEMAS = {"request": request_json_schema, "artifact": artifact_json_schema, "receipt": receipt_json_schema}


def register(sub) -> None:
    p = sub.add_parser("validate", help="check a request (or artifact/receipt) and print its normalized form")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--request-json", metavar="PATH|-", help="operation request (format 4)")
    src.add_argument("--artifact-json", metavar="PATH|-", help="artifact descriptor (format 9)")
    src.add_argument("--receipt-json", metavar="PATH|-", help="operation receipt (format 2)")
    p.add_argument("--json-errors", action="store_true", help="print errors as JSON on stdout")
    p.set_defaults(func=run)
    s = sub.add_parser("schema", help="print the JSON Schema of a format")
    s.add_argument("document", choices=sorted(SCHEMAS))
    s.set_defaults(func=lambda a: print_json(SCHEMAS[a.document]()) or 0)


def _request(name: str) -> dict:
    """The normalized request; one without a snapshot driver is shown normalized for the newest driver it is
    valid under (stderr says the run chooses among them from the hosts' facts)."""
    raw, document = api.decoded_request(name)
    if not isinstance(raw, dict) or "snapshot_driver" in raw:
        # the decoded document itself (api.load would read a top-level JSON string as another file's path)
        return validate_request(raw, document=document)
    candidates, refused = driver_candidates(raw, document=document)
    if not candidates:
        raise next(iter(refused.values()))
    print(f"snapshot_driver is left out: the controller chooses at run time the newest of "
          f"{', '.join(candidates)} every placed host supports (capture: from host facts; otherwise the "
          f"artifact's); shown normalized for {candidates[0]}", file=sys.stderr)
    return validate_request(raw, document=document, snapshot_driver=candidates[0])


def _invalid(report: dict) -> int:
    """Print the --json-errors report and exit 2: the document is invalid whether or not anyone still reads
    stdout (a reader that closed it, ``| true``, must not turn the verdict into success)."""
    try:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # what is still buffered, and Python's flush at exit, go nowhere instead of failing again
        try:
            fd = sys.stdout.fileno()
        except (OSError, ValueError):  # a stream without a descriptor of its own
            return 2
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    return 2


def run(args) -> int:
    # "is not None": an empty path ('') is the option given, refused by read_input with its fix
    given = next(p for p in (args.request_json, args.artifact_json, args.receipt_json) if p is not None)
    try:
        if args.request_json is not None:
            doc = _request(args.request_json)
        elif args.artifact_json is not None:
            doc = load_artifact(read_input(args.artifact_json),
                                document="artifact" if args.artifact_json == "-" else f"artifact {args.artifact_json}")
        else:
            doc = load_receipt(read_input(args.receipt_json),
                               document="receipt" if args.receipt_json == "-" else f"receipt {args.receipt_json}")
    except FormatError as exc:
        if args.json_errors:
            return _invalid({"valid": False, "document": exc.document, "errors": [i.as_dict() for i in exc.issues]})
        raise
    except ColdSnapError as exc:  # the document could not be read (no such file, a directory, too large)
        if args.json_errors:
            return _invalid({"valid": False, "document": given,
                             "errors": [{"path": "$", "message": exc.problem, "fix": exc.fix}]})
        raise
    print_json(doc)
    return 0
