"""``coldsnap``: the controller's command line.

Each sub-command lives in ``coldsnap.commands.<name>`` and registers itself;
errors a user can fix exit 2 with one clear message, unexpected ones exit 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError, FormatError

from coldsnap import __version__

COMMAND_MODULES = (
    "capabilities",
    "validate",
    "operations",
    "runs",
    "payload",
    "coordinator",
    "timeline",
    "environment",
    "demo",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coldsnap",
        description="Snapshot running LLM inference servers and restore them fast (Ansible collection coldsnap.fleet).",
    )
    parser.add_argument("--version", action="version", version=f"coldsnap {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(f"coldsnap.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"coldsnap.commands.{name}":
                continue
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except FormatError as exc:
        print(f"coldsnap: {exc}", file=sys.stderr)
        return 2
    except ColdSnapError as exc:
        print(f"coldsnap: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("coldsnap: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout closed early (e.g. piped into head): not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
