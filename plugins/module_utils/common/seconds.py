"""Durations given as options: a number of seconds, finite (``nan`` would wait for ever, ``inf`` never end)."""

from __future__ import annotations

from typing import Any


def is_seconds(value: Any, *, zero: bool) -> bool:
    """Whether ``value`` is a finite number of seconds, > 0 (``zero`` false) or >= 0; a bool is not one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return (0 <= value if zero else 0 < value) and value < float("inf")
