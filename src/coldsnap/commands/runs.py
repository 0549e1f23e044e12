"""``coldsnap runs list`` and ``coldsnap runs show ID``: the runs under the state root.

On a terminal both print for people; with ``--json`` (or when stdout is piped)
``list`` prints a JSON array and ``show`` the run's receipt exactly as written.
"""

from __future__ import annotations

import sys

from coldsnap.api import resolve_state_root
from coldsnap.commands._io import print_json, wants_json, whole_number
from coldsnap.commands.operations import STATE_ROOT_HELP
from coldsnap.runs import STALE_RUNNING, find_run, list_runs
from coldsnap.summary import format_duration, format_summary


def register(sub) -> None:
    p = sub.add_parser("runs", help="list recent runs and show their receipts",
                       description="The runs under <state root>/runs/: one directory per operation id, holding "
                                   "the latest run's receipt.")
    runs_sub = p.add_subparsers(dest="runs_command", metavar="list|show")

    def usage(_args) -> int:
        p.print_help(sys.stderr)
        return 2

    p.set_defaults(func=usage)

    lst = runs_sub.add_parser("list", help="recent runs, newest first",
                              description="Operation id, operation, state ('running' while a controller holds "
                                          "the run; 'no receipt' for a run that wrote none), start and duration.")
    lst.add_argument("-n", "--limit", type=whole_number(0), default=20, metavar="N",
                     help="at most N runs (default: %(default)s; 0: all)")
    lst.add_argument("--state-root", metavar="PATH", help=STATE_ROOT_HELP)
    lst.add_argument("--json", action="store_true", help="print a JSON array (the default when stdout is piped)")
    lst.set_defaults(func=run_list)

    show = runs_sub.add_parser("show", help="the summary of one run's receipt",
                               description="The human summary of <state root>/runs/ID/receipt.json; "
                                           "--json prints the receipt itself.")
    show.add_argument("operation_id", metavar="ID", help="operation id (see 'coldsnap runs list')")
    show.add_argument("--state-root", metavar="PATH", help=STATE_ROOT_HELP)
    show.add_argument("--json", action="store_true", help="print the receipt JSON (the default when stdout is piped)")
    show.set_defaults(func=run_show)


def run_list(args) -> int:
    state_root = resolve_state_root(args.state_root)
    entries = list_runs(state_root, limit=args.limit if args.limit and args.limit > 0 else None)
    if wants_json(args):
        print_json([e.as_json() for e in entries])
        return 0
    if not entries:
        print(f"no runs under {state_root / 'runs'}")
        return 0
    rows = [(e.operation_id, (e.operation or "-") + (" --prepare-only" if e.prepare_only else ""), e.state,
             e.started_at or "-", format_duration(e.duration_seconds)) for e in entries]
    header = ("OPERATION ID", "OPERATION", "STATE", "STARTED", "DURATION")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    return 0


def run_show(args) -> int:
    entry = find_run(resolve_state_root(args.state_root), args.operation_id)
    if wants_json(args):
        # The receipt as written (what the operation printed with --json), byte for byte.
        sys.stdout.write(entry.raw.decode("utf-8"))
    else:
        print(format_summary(entry.receipt, receipt_path=entry.receipt_path))
    if entry.state == STALE_RUNNING:
        print(f"coldsnap: run {entry.operation_id} says running, but no controller holds it: the controller "
              "that ran it is gone and its receipt was never finished (`coldsnap status` shows the workload)",
              file=sys.stderr)
    return 0
