"""Human progress on a terminal: one line per task start and finish.

Written to stderr so stdout stays machine-readable (receipt JSON or timing
NDJSON). Playbooks may report finer progress through the module result key
``coldsnap_progress``; :func:`format_progress` renders it: at a task's end, and
live while a long step runs as an async job (every ``coldsnap.fleet.job_wait``
retry carries it in its ``runner_retry`` event).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import IO, Any

STATUS_WORDS = {"ok": "ok", "changed": "changed", "failed": "FAILED", "unreachable": "UNREACHABLE",
                "skipped": "skipped", "ignored": "failed (ignored)", "cancelled": "CANCELLED"}


def _number(value: Any) -> str:
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.1f}"
    return str(int(value)) if isinstance(value, int | float) else str(value)


def format_progress(payload: Any) -> list[str]:
    """Render a ``coldsnap_progress`` value as display lines.

    Accepted shapes: a string; a mapping ``{"message", "phase", "done", "total",
    "unit", "elapsed_s"}`` (every key optional; what ``ProgressWriter`` records);
    or a list of those.
    """
    if payload is None:
        return []
    if isinstance(payload, list):
        return [line for item in payload for line in format_progress(item)]
    if isinstance(payload, str):
        return [payload]
    if not isinstance(payload, Mapping):
        return [str(payload)]
    parts = []
    if payload.get("phase"):
        parts.append(f"{payload['phase']}:")
    if payload.get("message"):
        parts.append(str(payload["message"]))
    done, total = payload.get("done"), payload.get("total")
    unit = f" {payload['unit']}" if payload.get("unit") else ""
    if isinstance(done, int | float) and not isinstance(done, bool):
        if isinstance(total, int | float) and not isinstance(total, bool) and total > 0:
            parts.append(f"{_number(done)}/{_number(total)}{unit} ({100.0 * done / total:.0f}%)")
        else:
            parts.append(f"{_number(done)}{unit}")
    elapsed = payload.get("elapsed_s")
    if parts and isinstance(elapsed, int | float) and not isinstance(elapsed, bool):
        parts.append(f"[{elapsed:.0f}s]")
    return [" ".join(parts)] if parts else []


class ProgressReporter:
    """Prints task progress lines; a disabled reporter prints nothing."""

    def __init__(self, enabled: bool, *, stream: IO[str] | None = None) -> None:
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.monotonic()

    def _line(self, text: str) -> None:
        if not self.enabled:
            return
        try:
            self.stream.write(f"[{time.monotonic() - self.t0:7.1f}s] {text}\n")
            self.stream.flush()
        except (OSError, ValueError):
            self.enabled = False  # a closed terminal never changes the operation's result

    def header(self, text: str) -> None:
        """An unindented line (operation start/end)."""
        self._line(text)

    def play(self, name: str) -> None:
        """A play starts."""
        self._line(f"PLAY {name}")

    def task_started(self, host: str, task: str) -> None:
        """A task starts on a host."""
        self._line(f"  {host:<20} {'...':<16} {task}")

    def task_finished(self, host: str, task: str, status: str, elapsed_s: float, msg: str | None = None) -> None:
        """A task finished on a host."""
        word = STATUS_WORDS.get(status, status)
        tail = f": {msg}" if msg and status in ("failed", "unreachable", "ignored", "cancelled") else ""
        self._line(f"  {host:<20} {word:<16} {task} ({elapsed_s:.1f}s){tail}")

    def progress(self, host: str, task: str, payload: Any) -> None:
        """Fine-grained progress a module reported (``coldsnap_progress``)."""
        for line in format_progress(payload):
            self._line(f"  {host:<20} {'progress':<16} {task}: {line}")

    def note(self, text: str) -> None:
        """Any other line (retries, status changes)."""
        self._line(f"  {text}")
