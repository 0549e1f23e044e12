"""RFC 8785 (JCS) canonical JSON and the digests ColdSnap derives from it."""

from __future__ import annotations

import hashlib
import math
from typing import Any


def canonical_json(value: Any) -> bytes:
    """Serialize ``value`` as RFC 8785 canonical JSON (UTF-8 bytes)."""
    out: list[str] = []
    _emit(value, out)
    return "".join(out).encode("utf-8")


def sha256_hex(data: bytes) -> str:
    """Lower-case hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def canonical_sha256(value: Any) -> str:
    """``sha256:<hex>`` of the canonical form of a JSON value."""
    return "sha256:" + sha256_hex(canonical_json(value))


def _emit(value: Any, out: list[str]) -> None:
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, int):
        out.append(str(value) if abs(value) <= _EXACT else _number(_as_double(value)))
    elif isinstance(value, float):
        out.append(_number(value))
    elif isinstance(value, str):
        out.append(_string(value))
    elif isinstance(value, list | tuple):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _emit(item, out)
        out.append("]")
    elif isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise TypeError(f"canonical JSON object keys must be strings, got {type(key).__name__}")
        # JCS orders members by the UTF-16 code units of their names.
        keys = sorted(value, key=lambda k: k.encode("utf-16-be"))
        out.append("{")
        for i, key in enumerate(keys):
            if i:
                out.append(",")
            out.append(_string(key))
            out.append(":")
            _emit(value[key], out)
        out.append("}")
    else:
        raise TypeError(f"type {type(value).__name__} is not JSON")


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _string(s: str) -> str:
    parts = ['"']
    for ch in s:
        if ch in _ESCAPES:
            parts.append(_ESCAPES[ch])
        elif ord(ch) < 0x20:
            parts.append(f"\\u{ord(ch):04x}")
        else:
            parts.append(ch)
    parts.append('"')
    return "".join(parts)


# JCS numbers are IEEE doubles: integers up to 2**53 print exactly; larger ones print as the double
# they round to, in ECMAScript's shortest form (9007199254740993 -> 9007199254740992, 10**21 -> 1e+21).
_EXACT = 2**53


def _as_double(value: int) -> float:
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"integer of {len(str(abs(value)))} digits is beyond JSON's double range") from None


def _number(x: float) -> str:
    """ECMAScript Number.prototype.toString, as JCS requires."""
    if math.isnan(x) or math.isinf(x):
        raise ValueError("NaN and Infinity are not JSON")
    if x == 0:
        return "0"
    if x.is_integer() and abs(x) <= _EXACT:
        return str(int(x))
    sign = "-" if x < 0 else ""
    digits, exp = _shortest_digits(abs(x))
    k = len(digits)
    n = exp + k  # position of the decimal point relative to the digit string
    if k <= n <= 21:
        return sign + digits + "0" * (n - k)
    if 0 < n <= 21:
        return sign + digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return sign + "0." + "0" * (-n) + digits
    e = n - 1
    mant = digits[0] + ("." + digits[1:] if k > 1 else "")
    return f"{sign}{mant}e{'+' if e >= 0 else '-'}{abs(e)}"


def _shortest_digits(x: float) -> tuple[str, int]:
    """Shortest round-tripping decimal digits and exponent: x == int(digits) * 10**exp."""
    r = repr(x)
    if "e" in r or "E" in r:
        mant, _sep, e = r.lower().partition("e")
        exp = int(e)
    else:
        mant, exp = r, 0
    if "." in mant:
        whole, frac = mant.split(".")
        if frac == "0":
            frac = ""
    else:
        whole, frac = mant, ""
    digits = (whole + frac).lstrip("0") or "0"
    exp -= len(frac)
    stripped = digits.rstrip("0")
    exp += len(digits) - len(stripped)
    return stripped or "0", exp
