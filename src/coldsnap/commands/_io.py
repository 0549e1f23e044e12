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
