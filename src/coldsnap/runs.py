"""The runs a state root remembers: ``<state_root>/runs/<operation_id>/receipt.json``.

Every run directory is listed, also one without a receipt (a run that stopped
before its playbook started) or with one that does not validate. A receipt that
still says ``running`` is checked against the run's ``.lock``: the controller
holds it for as long as the run lasts, so a free lock means the controller died.
"""

from __future__ import annotations

import datetime as dt
import errno
import heapq
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common import fsutil
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import StateLayout
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.receipt import load_receipt

from coldsnap.commands._io import MAX_INPUT_BYTES

NO_RECEIPT = "no receipt"
INVALID_RECEIPT = "invalid receipt"
UNREADABLE_RECEIPT = "unreadable receipt"
STALE_RUNNING = "running (no controller)"


@dataclass(frozen=True)
class RunEntry:
    """One run directory as listed."""

    operation_id: str
    run_dir: Path
    receipt_path: Path
    state: str
    operation: str | None = None
    prepare_only: bool = False
    started_at: str | None = None
    duration_seconds: float | None = None
    receipt: dict | None = None
    problem: str | None = None
    raw: bytes | None = field(default=None, repr=False)  # the receipt file's bytes, with ``receipt``
    stated_start: float | None = field(default=None, repr=False)  # of an invalid receipt: the start it states

    def sort_key(self) -> tuple[float, str]:
        """Newest first: the receipt's start time (an invalid receipt's: the one its head states, see
        _head_started_at), else the directory's modification time."""
        moment = _parse_time(self.started_at)
        if moment is None:
            moment = self.stated_start
        if moment is None:
            try:
                moment = self.run_dir.stat().st_mtime
            except OSError:
                moment = 0.0
        return (moment, self.operation_id)

    def as_json(self) -> dict:
        return {"operation_id": self.operation_id, "operation": self.operation, "prepare_only": self.prepare_only,
                "state": self.state, "started_at": self.started_at, "duration_seconds": self.duration_seconds,
                "receipt": str(self.receipt_path) if self.operation is not None else None,
                "run_dir": str(self.run_dir), "problem": self.problem}


def _parse_time(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def lock_held(run_dir: Path) -> bool:
    """True while a controller holds the run's ``.lock`` (never creates the lock file)."""
    return fsutil.lock_held(run_dir / ".lock")


class _Unreadable(Exception):
    """receipt.json is there but is no file a receipt can be read from (the message says why)."""


def read_receipt_bytes(path: Path, *, head: int | None = None) -> bytes:
    """The bytes of a run's receipt: FileNotFoundError when there is none, _Unreadable for anything that is
    not a regular file of at most MAX_INPUT_BYTES (a FIFO, a device, a link, a sparse giant), OSError else.
    ``head``: only its first ``head`` bytes.

    The controller writes a receipt as a regular file; nothing else named receipt.json is opened for more
    than a look: never followed (a link to /dev/zero), never waited on (a FIFO), never read past the cap."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _Unreadable(f"{path}: is a symbolic link, not the receipt file the controller writes") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Unreadable(f"{path}: is not a regular file ({_file_kind(st.st_mode)})")
        if st.st_size > MAX_INPUT_BYTES:
            raise _Unreadable(f"{path}: {st.st_size} bytes, more than {MAX_INPUT_BYTES >> 20} MiB, larger than "
                              "any receipt")
        if head is not None:
            return os.read(fd, head)
        data = fsutil.read_at_most(fd, MAX_INPUT_BYTES)
        if data is None:  # it grew while being read
            raise _Unreadable(f"{path}: more than {MAX_INPUT_BYTES >> 20} MiB, larger than any receipt")
        return data
    finally:
        os.close(fd)


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a file"


def read_run(run_dir: Path, *, keep_receipt: bool = True) -> RunEntry:
    """The entry of one run directory (``keep_receipt=False``: without the parsed receipt, for a listing)."""
    path = run_dir / "receipt.json"
    base = {"operation_id": run_dir.name, "run_dir": run_dir, "receipt_path": path}
    try:
        text = read_receipt_bytes(path)
    except FileNotFoundError:
        return RunEntry(state=NO_RECEIPT, **base)
    except _Unreadable as exc:
        return RunEntry(state=UNREADABLE_RECEIPT, problem=str(exc), **base)
    except OSError as exc:
        return RunEntry(state=UNREADABLE_RECEIPT, problem=f"{path}: {exc.strerror or exc}", **base)
    try:
        receipt = load_receipt(text)
    except ColdSnapError as exc:
        # every problem on one line (the first line alone only says how many there are)
        return RunEntry(state=INVALID_RECEIPT, problem=" ".join(x.strip() for x in str(exc).splitlines()),
                        stated_start=_head_started_at(text[:_HEAD_BYTES]), **base)
    state = receipt["state"]
    if state == "running" and not lock_held(run_dir):
        state = STALE_RUNNING
    duration = None if receipt["state"] == "running" else receipt["duration_seconds"]
    return RunEntry(state=state, operation=receipt["operation"], prepare_only=bool(receipt.get("prepare_only")),
                    started_at=receipt["started_at"], duration_seconds=duration,
                    receipt=receipt if keep_receipt else None, raw=text if keep_receipt else None, **base)


# The controller writes receipts as indented JSON (receipts.receipt_bytes) with started_at among the first
# fields: a line indented by two spaces is a key of the top-level object (a JSON string holds no raw newline).
_STARTED_AT_LINE = re.compile(rb'\n  "started_at": "([^"\\]{1,64})",?\n')
_HEAD_BYTES = 4096


def _head_started_at(head: bytes) -> float | None:
    """The start time a receipt's first bytes state, when they are written as the controller writes them."""
    found = _STARTED_AT_LINE.search(head)
    return _parse_time(found.group(1).decode("ascii", "replace")) if found else None


def _newest_possible(run_dir: Path) -> tuple[float, str]:
    """The run's sort key or more, from a stat and the first bytes of its receipt (no parsing, no validation).

    A receipt written as the controller writes it states its start in its head: that is the key, valid or
    not. Without a readable receipt the key is the directory's modification time. Another receipt is bounded
    by its file's modification time (a receipt is written when its run starts and rewritten when it ends,
    never before the run started), or by the directory's should it prove invalid."""
    try:
        dir_mtime = run_dir.stat().st_mtime  # as sort_key has it
    except OSError:
        dir_mtime = 0.0
    path = run_dir / "receipt.json"
    try:
        head = read_receipt_bytes(path, head=_HEAD_BYTES)
        receipt_mtime = path.stat(follow_symlinks=False).st_mtime
    except (OSError, _Unreadable):  # no receipt to read: the directory's time is its key
        return (dir_mtime, run_dir.name)
    started = _head_started_at(head)
    return (started if started is not None else max(dir_mtime, receipt_mtime), run_dir.name)


def list_runs(state_root: Path | str, *, limit: int | None = None) -> list[RunEntry]:
    """The runs under ``<state_root>/runs/``, newest first (``limit``: at most that many).

    With a limit only the receipts that can be among the newest are read and validated: runs are visited
    newest-possible first (see _newest_possible: a look at each receipt's head) until none left can beat the
    ``limit``-th found. Listed entries keep no parsed receipt."""
    runs_dir = StateLayout(state_root).runs
    try:
        dirs = [p for p in runs_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except FileNotFoundError:
        return []
    except PermissionError:
        raise ColdSnapError(f"{runs_dir} is not readable by this user",
                            fix="run as the user ColdSnap runs as, or pass --state-root") from None
    except OSError as exc:  # the state root (or its runs/) is a file, a dangling link...
        raise ColdSnapError(f"{runs_dir} cannot be listed: {exc.strerror or exc}",
                            fix="pass --state-root the state directory (the one holding runs/)") from None
    if limit is None:
        entries = (read_run(d, keep_receipt=False) for d in dirs)
        return sorted(entries, key=RunEntry.sort_key, reverse=True)
    best: list[tuple[tuple[float, str], int, RunEntry]] = []  # a min-heap of the newest `limit` found
    for n, (bound, run_dir) in enumerate(sorted(((_newest_possible(d), d) for d in dirs), reverse=True)):
        if len(best) >= limit and (limit == 0 or bound < best[0][0]):
            break  # neither this run nor any after it can be newer than those kept
        entry = read_run(run_dir, keep_receipt=False)
        item = (entry.sort_key(), n, entry)
        if len(best) < limit:
            heapq.heappush(best, item)
        elif item[0] > best[0][0]:
            heapq.heapreplace(best, item)
    return [entry for _key, _n, entry in sorted(best, key=lambda item: item[0], reverse=True)]


def find_run(state_root: Path | str, operation_id: str) -> RunEntry:
    """The run ``operation_id``, or a ColdSnapError naming what is there."""
    runs_dir = StateLayout(state_root).runs
    shown = repr(operation_id[:200]) + (f"... ({len(operation_id)} characters)" if len(operation_id) > 200 else "")
    if not operation_id or "/" in operation_id or "\0" in operation_id or operation_id in (".", ".."):
        raise ColdSnapError(f"{shown} is not an operation id", fix="use an id from 'coldsnap runs list'")
    run_dir = runs_dir / operation_id
    try:
        found = stat.S_ISDIR(run_dir.stat().st_mode)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG):  # no such run: said below
            # runs/ not searchable by this user, a loop of links...
            raise ColdSnapError(f"run directory {run_dir} cannot be read ({exc.strerror or exc})",
                                fix="run as the user ColdSnap runs as (or root), or pass --state-root the state "
                                    "directory of this user") from None
        found = False
    if not found:
        raise ColdSnapError(f"no run {shown} under {runs_dir}",
                            fix="list the runs with 'coldsnap runs list' (and check --state-root)")
    entry = read_run(run_dir)
    if entry.receipt is None:
        detail = f": {entry.problem}" if entry.problem else ""
        if entry.state == NO_RECEIPT:
            fix = f"look at the run directory {run_dir} (the run stopped before it wrote a receipt)"
        elif entry.state == UNREADABLE_RECEIPT:
            fix = ("the controller writes a regular file there: run as the user ColdSnap runs as, or run the "
                   "operation again for a new receipt")
        else:
            fix = f"look at {entry.receipt_path}"
        raise ColdSnapError(f"run {operation_id} has {entry.state}{detail}", fix=fix)
    return entry
