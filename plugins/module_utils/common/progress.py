"""Live progress of a long module step, shared through a small directory on the host.

A long task runs with ``async: <limit>`` and ``poll: 0``; its module is given a
progress directory (option ``progress_dir``) and writes one JSON file per
operation in it (a worker's export, a payload's copy, a capsule's push) with
:class:`ProgressWriter`: throttled (about two writes a second), atomic (temp
name, then rename) and mode 0600. The follow-up ``coldsnap.fleet.job_wait`` task
reads them back with :func:`read_progress` on every retry and returns them as
``coldsnap_progress``, which the controller shows while the step runs.

The directory also holds a *lease*: every wait retry refreshes it, and a job
whose lease runs out (the run was cancelled, the controller died) stops itself
(:class:`LeaseWatchdog`) instead of running on unattended.

Progress is never part of an operation's result: every write error is swallowed
and turns the writer off.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.proctree import process_tree

#: The module result key the controller renders as progress lines (live on every wait retry).
RESULT_PROGRESS_KEY = "coldsnap_progress"
#: File name suffix of one progress record in a progress directory.
PROGRESS_SUFFIX = ".progress.json"
#: The lease file a waiter refreshes (its mtime is the last sign of life).
LEASE_FILE = "lease"
#: Set by Ansible for a module that runs under ``async`` (and only then).
ASYNC_DIR_ENV = "ANSIBLE_ASYNC_DIR"
#: Default seconds between two writes of one writer.
MIN_INTERVAL_S = 0.5
#: Default seconds a job runs on without any waiter refreshing its lease.
DEFAULT_LEASE_S = 120.0
#: Records read back at most (a host with many workers still returns a small result).
MAX_RECORDS = 32

PROGRESS_DIR_ARG = {"type": "path"}
LEASE_ARG = {"type": "float", "default": DEFAULT_LEASE_S}


def _safe_name(name: str) -> str:
    out = "".join(c if c.isalnum() or c in "._-" else "-" for c in str(name)).strip(".-")
    return out[:120] or "step"


def _write_atomic(path: Path, record: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, json.dumps(record, sort_keys=True).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)  # progress is ephemeral: no fsync


def private_dir(path: Path | str) -> Path:
    """Create ``path`` and each missing parent with mode 0700; existing directories keep their mode."""
    path = Path(path)
    missing = []
    probe = path
    while not probe.is_dir():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:
            continue  # made meanwhile by another writer of the run
        os.chmod(directory, 0o700)  # mkdir's mode is subject to the umask
    return path


class ProgressWriter:
    """One progress record: call it as a ``Progress`` callback ``(done, total)``.

    ``directory`` None gives a writer that does nothing, so callers never test for it.
    """

    def __init__(self, directory: Path | str | None, name: str, *, phase: str, unit: str = "bytes",
                 message: str | None = None, min_interval: float = MIN_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(directory) / (_safe_name(name) + PROGRESS_SUFFIX) if directory else None
        self.record: dict[str, Any] = {"phase": phase, "unit": unit}
        if message:
            self.record["message"] = message
        self.min_interval = min_interval
        self.clock = clock
        self.last_write: float | None = None
        self.started = clock()
        self.writes = 0

    @property
    def enabled(self) -> bool:
        """Whether this writer still writes (an error turns it off for good)."""
        return self.path is not None

    def __call__(self, done: int | float, total: int | float | None = None) -> None:
        self.update(done=done, total=total)

    def update(self, *, force: bool = False, **fields: Any) -> None:
        """Merge ``fields`` into the record and write it, at most every ``min_interval`` seconds."""
        if self.path is None:
            return
        self.record.update({k: v for k, v in fields.items() if v is not None})
        now = self.clock()
        if not force and self.last_write is not None and now - self.last_write < self.min_interval:
            return
        self.last_write = now
        self.record["elapsed_s"] = round(now - self.started, 1)
        self.record["updated_unix"] = round(time.time(), 3)
        try:
            _write_atomic(self.path, self.record)
            self.writes += 1
        except OSError:
            self.path = None  # a full or vanished directory never fails the operation

    def note(self, message: str) -> None:
        """Change the message and write at once."""
        self.update(message=message, force=True)

    def done(self, message: str | None = None) -> None:
        """Write the final state (done = total when a total is known)."""
        if self.record.get("total"):
            self.record["done"] = self.record["total"]
        self.update(message=message, state="done", force=True)


def mapping_progress(writer: ProgressWriter) -> Callable[[dict], None]:
    """Adapt a writer to the ``Progress`` callbacks that report dicts (capsule push and pull)."""

    blobs = {"count": 0, "bytes": 0}

    def report(event: dict) -> None:
        status = event.get("status")
        if status in ("pushed", "pulled", "exists"):
            blobs["count"] += 1
            blobs["bytes"] += int(event.get("bytes") or 0)
            writer.update(done=blobs["count"], message=f"{event.get('unit') or ''} {status} "
                                                       f"{event.get('digest') or ''}".strip())
        else:
            what = " ".join(str(x) for x in (event.get("unit"), status, event.get("id")) if x)
            writer.update(message=what or None)

    return report


def read_progress(directory: Path | str | None) -> list[dict]:
    """Every progress record in ``directory`` (by file name); unreadable or half-written ones are skipped."""
    if not directory:
        return []
    try:
        names = sorted(p for p in Path(directory).iterdir() if p.name.endswith(PROGRESS_SUFFIX))
    except OSError:
        return []
    out = []
    for path in names[:MAX_RECORDS]:
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def refresh_lease(directory: Path | str, *, create: bool = True) -> None:
    """A sign of life: touch the lease. ``create=False`` (a waiter) touches it only where the step made
    its lease, so a wait never creates anything (check mode, a step without progress, a wrong path)."""
    if not create and not (Path(directory) / LEASE_FILE).is_file():
        return  # only where the step itself made its lease (never into a directory it does not own)
    path = private_dir(directory) / LEASE_FILE
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.close(fd)
        os.utime(path)


def lease_age(directory: Path | str, *, now: float | None = None) -> float | None:
    """Seconds since the lease was last refreshed; None when there is no lease (or no directory)."""
    try:
        mtime = (Path(directory) / LEASE_FILE).stat().st_mtime
    except OSError:
        return None
    return max(0.0, (time.time() if now is None else now) - mtime)


def running_async() -> bool:
    """Whether this module runs as an Ansible async job (Ansible sets ``ANSIBLE_ASYNC_DIR`` only then)."""
    return bool(os.environ.get(ASYNC_DIR_ENV))


def tighten_async_dir() -> None:
    """Make the async job directory private (0700) when it is ours: the job's result file lands there
    with the process umask, and only this user's waiter needs to read it."""
    raw = os.environ.get(ASYNC_DIR_ENV)
    if not raw:
        return
    path = Path(os.path.expanduser(raw))
    with contextlib.suppress(OSError):
        if path.is_dir() and path.stat().st_uid == os.geteuid():
            os.chmod(path, 0o700)


def _stop_job() -> None:
    """End this async job the way the controller's cancel ends a step that runs in the foreground:
    SIGTERM every process under this module (helpers, activation runtimes), then the module itself.
    Daemons the step launched on purpose (a restored unit's keeper) are no longer below it and stay."""
    me = os.getpid()
    for pid in sorted(process_tree(me) - {me}, reverse=True):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    os.kill(me, signal.SIGTERM)


class LeaseWatchdog:
    """Stop the async job when nobody has refreshed its lease for ``lease_s`` seconds.

    A cancelled run stops its wait task; without this, the job it launched would
    carry on (a capture, a restore) with nobody to see the result.
    """

    def __init__(self, directory: Path | str, lease_s: float, *, poll_s: float = 1.0,
                 on_expiry: Callable[[], None] = _stop_job) -> None:
        self.directory = Path(directory)
        self.lease_s = lease_s
        self.poll_s = poll_s
        self.on_expiry = on_expiry
        self.expired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="coldsnap-lease", daemon=True)

    def start(self) -> LeaseWatchdog:
        """Refresh the lease once (the waiter's first retry follows) and start watching."""
        refresh_lease(self.directory)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (the step ended on its own)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            age = lease_age(self.directory)
            if age is None or age > self.lease_s:
                self.expired = True
                ProgressWriter(self.directory, "zz-lease", phase="cancelled").note(
                    f"no waiter for {self.lease_s:.0f}s (the run was cancelled or lost): stopping")
                self.on_expiry()
                return


class ProgressSession:
    """The progress directory of one module run: writers, and the lease watchdog under ``async``.

    ``directory`` None (no ``progress_dir`` given) gives writers that do nothing.
    """

    def __init__(self, directory: Path | str | None, *, lease_s: float = DEFAULT_LEASE_S,
                 watch: bool | None = None) -> None:
        self.directory = Path(directory) if directory else None
        self.lease_s = lease_s
        self.watch = running_async() if watch is None else watch
        self.watchdog: LeaseWatchdog | None = None

    def __enter__(self) -> ProgressSession:
        if self.directory is not None:
            try:
                private_dir(self.directory)
            except OSError:
                self.directory = None
                return self
            if self.watch:
                tighten_async_dir()
                if self.lease_s > 0:
                    self.watchdog = LeaseWatchdog(self.directory, self.lease_s).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()

    def writer(self, name: str, *, phase: str, unit: str = "bytes", message: str | None = None) -> ProgressWriter:
        """A writer for one record of this session."""
        return ProgressWriter(self.directory, name, phase=phase, unit=unit, message=message)
