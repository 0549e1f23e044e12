"""Strict JSON decoding: duplicate keys, trailing data and non-finite numbers are errors.

The decoder keeps going after a duplicate key so the schema walk can report it
at its JSON path together with every other problem in the document.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import FormatError, FormatIssue


class ObjectWithDuplicates(dict):
    """A decoded JSON object that remembers which keys appeared more than once."""

    duplicates: list[str]


def _pairs_hook(pairs: list[tuple[str, Any]]) -> dict:
    seen: dict[str, Any] = {}
    dups: list[str] = []
    for key, value in pairs:
        if key in seen and key not in dups:
            dups.append(key)
        seen[key] = value
    if not dups:
        return seen
    obj = ObjectWithDuplicates(seen)
    obj.duplicates = dups
    return obj


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:24]}{'...' if len(text) > 24 else ''} is beyond the range of a JSON "
                         "number (an IEEE double)")
    return value


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    # 309 digits reach past the largest double (1.8e308); checked before int() (Python refuses 4300+ digits)
    if digits > 309 or abs(value := int(text)) > sys.float_info.max:
        raise ValueError(f"an integer of {digits} digits is beyond the range of a JSON number (an IEEE double)")
    return value


_DECODER = json.JSONDecoder(object_pairs_hook=_pairs_hook, parse_constant=_reject_constant,
                            parse_float=_finite_float, parse_int=_bounded_int)
# No ColdSnap document nests deeper than a dozen levels; a bound keeps hostile input (100,000
# nested arrays) from exhausting the recursion of the decoder and of the schema walk.
MAX_DEPTH = 64


def _too_deep(text: str, limit: int = MAX_DEPTH) -> bool:
    """Whether brackets outside strings nest deeper than ``limit`` (a linear scan, no recursion)."""
    depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def strict_loads(text: str | bytes, *, document: str = "document") -> Any:
    """Decode exactly one JSON value; anything after it (but whitespace) is an error."""
    if isinstance(text, bytes | bytearray):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FormatError(
                [FormatIssue("$", f"not UTF-8 ({exc.reason} at byte {exc.start})", "save the file as UTF-8")],
                document=document,
            ) from None
    if text.startswith("\ufeff"):
        text = text[1:]
    if _too_deep(text):
        raise FormatError([FormatIssue("$", f"nests arrays or objects more than {MAX_DEPTH} levels deep",
                                       "no ColdSnap document is nested that deeply; check what produced it")],
                          document=document)
    if _skip_ws(text, 0) == len(text):
        raise FormatError([FormatIssue("$", "is empty (no JSON value at all)",
                                       "give the document's JSON; an empty file is often the output of a command "
                                       "that failed")], document=document)
    try:
        value, end = _DECODER.raw_decode(text, _skip_ws(text, 0))
    except json.JSONDecodeError as exc:
        raise FormatError(
            [FormatIssue("$", f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
                         "fix the JSON syntax")],
            document=document,
        ) from None
    except RecursionError:
        raise FormatError([FormatIssue("$", "nests too deeply to decode", "check what produced the document")],
                          document=document) from None
    except ValueError as exc:
        raise FormatError([FormatIssue("$", str(exc), "use finite numbers a double can hold")],
                          document=document) from None
    where = _lone_surrogate(value, "$")
    if where is not None:
        raise FormatError([FormatIssue(where, "holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair), "
                                              "which is not Unicode text",
                                       "escape characters outside the BMP as a surrogate pair, or write them as UTF-8")],
                          document=document)
    rest = _skip_ws(text, end)
    if rest != len(text):
        line = text.count("\n", 0, rest) + 1
        raise FormatError(
            [FormatIssue("$", f"trailing data after the JSON value at line {line}",
                         "remove everything after the closing brace (one JSON value per document)")],
            document=document,
        )
    return value


def is_text(value: str) -> bool:
    """Whether ``value`` can be written as UTF-8 (holds no lone surrogate): the one test of Unicode text, for a
    decoded document here and for a decoded value in :mod:`.schema`."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The JSON path of the first string (or key) holding an unpaired surrogate; None when there is none.
    Bounded by MAX_DEPTH like the decoder."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if not is_text(item):
                return where
        elif isinstance(item, dict):
            for key, sub in item.items():
                if not is_text(key):
                    return where
                stack.append((sub, f"{where}.{key}"))
        elif isinstance(item, list):
            stack.extend((sub, f"{where}[{i}]") for i, sub in enumerate(item))
    return None


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def duplicates_of(value: Any) -> list[str]:
    """Keys that appeared twice in this decoded object (empty for ordinary dicts)."""
    return list(getattr(value, "duplicates", ()))
