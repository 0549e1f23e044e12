"""Where timing events go while an operation runs: NDJSON, one event a line, flushed live.

A target is ``None`` (nowhere), ``'-'`` (stdout), a path (truncated and
written), a writable text stream, or a callable taking the event dict. Every
run also mirrors the stream into its artifact directory. A target that fails
(closed pipe, full disk) is dropped and the run goes on: a broken stream
degrades live reporting only, never the result.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import require_not_planted_output
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.timing import ndjson_line

TimingTarget = str | Path | IO[str] | Callable[[dict], None] | None


class TimingStream:
    """Fans each timing event out to the live target and the run's mirror file."""

    def __init__(self, target: TimingTarget, *, mirror: Path | None = None) -> None:
        self._writers: list[tuple[str, Callable[[dict], None]]] = []
        self._owned: list[IO[str]] = []
        self.problems: list[str] = []
        if target is not None:
            self._add_target(target)
        if mirror is not None:
            fh = open(os.open(mirror, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8")
            self._owned.append(fh)
            self._writers.append((str(mirror), self._line_writer(fh)))

    @staticmethod
    def _line_writer(fh: IO[str]) -> Callable[[dict], None]:
        def write(event: dict) -> None:
            fh.write(ndjson_line(event))
            fh.flush()
        return write

    def _add_target(self, target: Any) -> None:
        if callable(target) and not hasattr(target, "write"):
            self._writers.append(("callback", target))
        elif hasattr(target, "write"):
            self._writers.append(("stream", self._line_writer(target)))
        elif str(target) == "-":
            self._writers.append(("stdout", self._line_writer(sys.stdout)))
        else:
            path = Path(target)
            # written in place: a file or pipe another user made in /tmp would read the stream
            require_not_planted_output(path)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                # Never through a link (one planted in /tmp would aim the write at another file); a FIFO
                # that a live reader holds is fine. Private: spans name hosts, units and paths.
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                try:  # what was opened is checked before anything is cut or written
                    require_not_planted_output(path, fd=fd)
                    if stat.S_ISREG(os.fstat(fd).st_mode):
                        os.ftruncate(fd, 0)
                except BaseException:
                    os.close(fd)
                    raise
            except OSError as exc:
                from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
                    ColdSnapError,
                )

                why = "it is a symbolic link" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
                raise ColdSnapError(f"the timing stream {path} cannot be written: {why}",
                                    fix="give --timing-ndjson a new file path (or '-' for stdout)") from None
            fh = os.fdopen(fd, "w", encoding="utf-8")
            self._owned.append(fh)
            self._writers.append((str(path), self._line_writer(fh)))

    def __call__(self, event: dict) -> None:
        for entry in list(self._writers):
            name, write = entry
            try:
                write(event)
            except Exception as exc:  # a broken live stream must not change the result
                self.problems.append(f"timing stream {name}: {type(exc).__name__}: {exc}")
                self._writers.remove(entry)

    def close(self) -> None:
        """Close the files this stream opened (never the caller's stream)."""
        for fh in self._owned:
            try:
                fh.close()
            except OSError as exc:
                self.problems.append(f"closing {fh.name}: {exc}")
        self._owned.clear()
        self._writers.clear()
