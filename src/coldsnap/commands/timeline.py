"""``coldsnap timeline RECEIPT.json -o timeline.png``: draw an operation's timing."""

from __future__ import annotations

import sys
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.receipt import load_receipt

from coldsnap.commands._io import read_input


def register(sub) -> None:
    p = sub.add_parser("timeline", help="draw a receipt's timing as a Gantt-style PNG",
                       description="One lane per clock/host/unit, on one axis: seconds since the operation "
                                   "started. Unit clocks are placed by the wall-clock time their spans recorded "
                                   "(a clock without one starts at its own first event, and its lane says so).")
    p.add_argument("receipt", metavar="RECEIPT.json|-", help="receipt (format 2)")
    p.add_argument("-o", "--output", metavar="FILE", default="timeline.png",
                   help="output file: .png (default: %(default)s), .svg or .pdf; '-' writes the PNG to stdout")
    p.set_defaults(func=run)


def run(args) -> int:
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError

    from coldsnap.timeline import render_timeline

    if not args.output or args.output.endswith("/"):
        raise ColdSnapError(f"-o {args.output!r} names no file", fix="give -o a file name, e.g. -o timeline.png")
    receipt = load_receipt(read_input(args.receipt),
                           document="receipt" if args.receipt == "-" else f"receipt {args.receipt}")
    try:
        out = render_timeline(receipt, Path("/dev/stdout" if args.output == "-" else args.output))
    except BrokenPipeError:
        raise  # a reader that went away (| head): the command's own exit status, as every command's
    except OSError as exc:
        raise ColdSnapError(f"cannot write the timeline to {args.output}: {exc.strerror or exc}",
                            fix="give -o a PNG file path in a writable directory") from None
    print(f"timeline: {out}", file=sys.stderr)
    return 0
