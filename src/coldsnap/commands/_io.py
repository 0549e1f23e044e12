"""Small I/O helpers shared by sub-commands."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def read_input(path: str) -> bytes:
    """Read a file, or standard input for '-'."""
    if path == "-":
        return sys.stdin.buffer.read()
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError

        raise ColdSnapError(f"{path}: no such file", fix="give the path of the JSON document, or '-' for stdin") from None


def print_json(obj: Any) -> None:
    """Pretty JSON on stdout."""
    json.dump(obj, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def stdout_is_terminal() -> bool:
    """True when stdout is a terminal (a person reads it); False when piped or redirected."""
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # replaced or closed stream
        return False


def wants_json(args: Any) -> bool:
    """Machine output: ``--json`` given, or stdout is not a terminal (scripts keep the JSON they had)."""
    return bool(getattr(args, "json", False)) or not stdout_is_terminal()
