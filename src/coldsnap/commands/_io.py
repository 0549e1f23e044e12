"""Small I/O helpers shared by sub-commands."""

from __future__ import annotations

import json
import os
import stat
import sys
from typing import Any

# No ColdSnap document comes near this (a receipt of a large fleet is a few MiB); a bound keeps a
# mistaken path (/dev/zero, a pack) from filling memory.
MAX_INPUT_BYTES = 64 << 20


def read_input(path: str) -> bytes:
    """Read a JSON document from a file (a pipe such as ``<(jq ...)`` too), or standard input for '-'."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError

    fix = "give the path of the JSON document, or '-' for stdin"
    if not path:
        # an unset shell variable ("$R") must not surface as ": no such file"
        raise ColdSnapError("the path is empty", fix=fix)
    if path == "-":
        data = sys.stdin.buffer.read(MAX_INPUT_BYTES + 1)
    else:
        try:
            with open(path, "rb") as fh:
                if stat.S_ISDIR(os.fstat(fh.fileno()).st_mode):
                    raise IsADirectoryError(path)
                data = fh.read(MAX_INPUT_BYTES + 1)
        except FileNotFoundError:
            raise ColdSnapError(f"{path}: no such file", fix=fix) from None
        except IsADirectoryError:
            raise ColdSnapError(f"{path}: is a directory", fix=fix) from None
        except PermissionError:
            raise ColdSnapError(f"{path}: cannot be read by this user (permission denied)",
                                fix="make it readable by this user, or run as its owner (or root)") from None
        except OSError as exc:
            raise ColdSnapError(f"{path}: cannot be read ({exc.strerror or exc})",
                                fix="give the path of a JSON document this user can read, or '-' for stdin") from None
    if len(data) > MAX_INPUT_BYTES:
        raise ColdSnapError(f"{'standard input' if path == '-' else path}: more than {MAX_INPUT_BYTES >> 20} MiB, "
                            "larger than any ColdSnap document", fix=fix)
    return data


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


def whole_number(minimum: int, maximum: int | None = None, *, what: str = "a whole number"):
    """An argparse ``type`` for a whole number within [minimum, maximum] (the message names the range)."""
    import argparse

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"{minimum}-{maximum}" if maximum is not None else f"{minimum} or more"
            raise argparse.ArgumentTypeError(f"{value} is out of range: give {bound}")
        return value

    return parse
