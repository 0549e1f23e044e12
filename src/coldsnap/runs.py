"""The runs a state root remembers: ``<state_root>/runs/<operation_id>/receipt.json``.

Every run directory is listed, also one without a receipt (a run that stopped
before its playbook started) or with one that does not validate. A receipt that
still says ``running`` is checked against the run's ``.lock``: the controller
holds it for as long as the run lasts, so a free lock means the controller died.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common import fsutil
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import StateLayout
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.receipt import load_receipt

NO_RECEIPT = "no receipt"
INVALID_RECEIPT = "invalid receipt"
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

    def sort_key(self) -> tuple[float, str]:
        """Newest first: the receipt's start time, else the directory's modification time."""
        moment = _parse_time(self.started_at)
        if moment is None:
            try:
                moment = self.run_dir.stat().st_mtime
            except OSError:
                moment = 0.0
        return (moment, self.operation_id)

    def as_json(self) -> dict:
        return {"operation_id": self.operation_id, "operation": self.operation, "prepare_only": self.prepare_only,
                "state": self.state, "started_at": self.started_at, "duration_seconds": self.duration_seconds,
                "receipt": str(self.receipt_path) if self.receipt is not None else None,
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


def read_run(run_dir: Path) -> RunEntry:
    """The entry of one run directory."""
    path = run_dir / "receipt.json"
    base = {"operation_id": run_dir.name, "run_dir": run_dir, "receipt_path": path}
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return RunEntry(state=NO_RECEIPT, **base)
    except OSError as exc:
        return RunEntry(state=INVALID_RECEIPT, problem=f"{path}: {exc.strerror or exc}", **base)
    try:
        receipt = load_receipt(text)
    except ColdSnapError as exc:
        # every problem on one line (the first line alone only says how many there are)
        return RunEntry(state=INVALID_RECEIPT, problem=" ".join(x.strip() for x in str(exc).splitlines()), **base)
    state = receipt["state"]
    if state == "running" and not lock_held(run_dir):
        state = STALE_RUNNING
    duration = None if receipt["state"] == "running" else receipt["duration_seconds"]
    return RunEntry(state=state, operation=receipt["operation"], prepare_only=bool(receipt.get("prepare_only")),
                    started_at=receipt["started_at"], duration_seconds=duration, receipt=receipt, **base)


def list_runs(state_root: Path | str, *, limit: int | None = None) -> list[RunEntry]:
    """The runs under ``<state_root>/runs/``, newest first (``limit``: at most that many)."""
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
    entries = sorted((read_run(d) for d in dirs), key=RunEntry.sort_key, reverse=True)
    return entries[:limit] if limit is not None else entries


def find_run(state_root: Path | str, operation_id: str) -> RunEntry:
    """The run ``operation_id``, or a ColdSnapError naming what is there."""
    runs_dir = StateLayout(state_root).runs
    if not operation_id or "/" in operation_id or operation_id in (".", ".."):
        raise ColdSnapError(f"{operation_id!r} is not an operation id", fix="use an id from 'coldsnap runs list'")
    run_dir = runs_dir / operation_id
    if not run_dir.is_dir():
        raise ColdSnapError(f"no run {operation_id!r} under {runs_dir}",
                            fix="list the runs with 'coldsnap runs list' (and check --state-root)")
    entry = read_run(run_dir)
    if entry.receipt is None:
        detail = f": {entry.problem}" if entry.problem else ""
        raise ColdSnapError(f"run {operation_id} has {entry.state}{detail}",
                            fix=f"look at the run directory {run_dir} (the run stopped before it wrote a receipt)"
                            if entry.state == NO_RECEIPT else f"look at {entry.receipt_path}")
    return entry
