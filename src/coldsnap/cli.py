"""``coldsnap``: the controller's command line.

Each sub-command lives in ``coldsnap.commands.<name>`` and registers itself;
errors a user can fix exit 2 with one clear message, unexpected ones exit 1.
Without the collection coldsnap.fleet, ``--help`` and ``--version`` still work and
every command says how to install it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from coldsnap import __version__
from coldsnap._collection import CollectionNotFound

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


DESCRIPTION = "Snapshot running LLM inference servers and restore them fast (Ansible collection coldsnap.fleet)."


def _base_parser(**kwargs) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="coldsnap", description=DESCRIPTION, **kwargs)
    parser.add_argument("--version", action="version", version=f"coldsnap {__version__}")
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The full parser; CollectionNotFound when the collection is not importable."""
    parser = _base_parser()
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


def _without_collection(argv: list[str] | None, missing: CollectionNotFound) -> int:
    """Help and version work; any command fails with how to install the collection."""
    parser = _base_parser(formatter_class=argparse.RawDescriptionHelpFormatter, epilog=(
        "The commands are unavailable: the Ansible collection coldsnap.fleet is not importable.\n"
        f"Looked in: {', '.join(map(str, missing.searched))}\nFix: {missing.fix}"))
    parser.add_argument("command", nargs="?", help="(needs the collection coldsnap.fleet)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    print(f"coldsnap: error: {missing}", file=sys.stderr)
    return 2


def _closed_stdio_to_devnull() -> None:
    """A standard stream the caller closed (``>&-``) becomes /dev/null: what a command prints there is dropped
    instead of failing with a traceback (its exit status still says how it went), and no file the command opens
    later takes the descriptor, where a child process or a stray print would write into it."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        if getattr(sys, name) is not None:
            continue
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_WRONLY)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
        setattr(sys, name, open(fd, "w", encoding="utf-8", errors="replace", closefd=False))


def main(argv: list[str] | None = None) -> int:
    _closed_stdio_to_devnull()
    try:
        parser = build_parser()
    except CollectionNotFound as missing:
        return _without_collection(argv, missing)
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
        ColdSnapError,
        FormatError,
    )

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
    except OSError as exc:
        # A file the user named that cannot be used (exists, missing directory, permission): said in one
        # line with the path, not a traceback. Errors ColdSnap anticipates carry their own fix above; any
        # other OSError (no path to name) keeps its traceback.
        if not exc.filename:
            raise
        print(f"coldsnap: error: {exc.filename}: {exc.strerror or exc}; check that path and run again",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
