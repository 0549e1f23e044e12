"""One operation at a time per workload on each host, whichever controller started it.

The controller lets one operation of a workload run at a time per state root (its workload lock), but
two controllers — two AWX job templates, two operators' ``coldsnap`` or ``ansible-playbook`` runs —
share no lock there. Without one on the host, a second restore could evict the engines the first one
was restoring, or CRIU-restore a second copy onto the same pids and ports.

So every step that changes a workload's engines on a host (a restore's prepare, evict and activate; a
capture; sleep, wake, stop) holds this host's *claim* on the workload for as long as it runs: an
exclusive ``flock`` on ``<state_root>/locks/host-workload-<recipe>@<machine id>.claim`` (the machine's
``/etc/machine-id``: one claim per machine, whatever name an inventory gives it; two machines that share
a state root over a network file system each have their own), which the kernel drops when the step's
process ends, however it ends. A step that finds it held waits up to
:data:`ACQUIRE_S` (a rival's refused attempt or a check-mode probe holds it for a moment) and is then
refused, naming the holder from the file's record (operation, id, step, pid, since), before it changes
anything. A step never runs without holding it.

An operation is its request id *and* its run id (the playbooks draw one per run, the controller passes
its own; ``coldsnap_run_id``): two runs of one request — an AWX job launched twice, one request file
in two templates — are two operations. A module run without a run id is known by its request id alone.

One gap remains between two steps of one restore: the eviction has stopped the workload and the
activation has not started yet (a few seconds, the coordinator's start in between). The evict step
leaves a *hand-over* in the record — the workload is this operation's until ``pending_until``
(:data:`HANDOVER_S` later) — which every other operation honours and the same operation's activate step
takes over (or the controller's rollback of it, ``<id>-rollback`` with the same run id). A restore that
stops between the two steps (another host failed) hands the workload back in its playbook's ``always``
(:func:`release_handover`); a controller that died in the gap holds it no longer than :data:`HANDOVER_S`.

Check mode only looks (nothing is written); ``status`` never claims.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import file_lock, lock_held
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import StateLayout
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.eviction import succeeds
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.ownership_walk import give_tree

HANDOVER_S = 120.0  # how long an evicted workload waits for its own restore's activate step
ACQUIRE_S = 2.0  # how long a step waits for a claim held for a moment (a refused rival, a probe)
_RECORD_MAX = 4096


class WorkloadBusy(ColdSnapError):
    """Another operation holds (or was handed) this host's claim on the workload."""


class Claim:
    """A held claim: :meth:`hand_over` keeps the workload this operation's after the step ends."""

    def __init__(self, fd: int | None, record: dict) -> None:
        self._fd = fd
        self.record = record

    def hand_over(self, seconds: float = HANDOVER_S) -> None:
        """The workload stays this operation's for ``seconds`` after this step (its next step takes it)."""
        if self._fd is None:
            return
        self.record = {**self.record, "pending_until": time.time() + seconds}
        _write(self._fd, self.record)


@contextlib.contextmanager
def claimed(state_root: Path, request: dict, *, host: str, step: str, check_mode: bool = False,
            run: str | None = None) -> Iterator[Claim]:
    """Hold this host's claim on ``request``'s workload for a step that changes it (module doc); ``run``:
    the run id.

    Refused with :class:`WorkloadBusy`, naming the holder, while a step of another operation holds it or
    was handed it. Check mode checks the same and writes nothing."""
    recipe = request["workload"]["recipe"]
    mine = {"operation": request.get("operation"), "id": str(request.get("id")), "run": run or None, "step": step}
    layout = StateLayout(state_root)
    path = layout.host_claim(recipe, machine_id())
    if check_mode:
        layout.refuse_planted()
        if path.is_file() and _held_a_while(path):
            raise _busy(_peek(path), recipe=recipe, host=host, mine=mine, held=True)
        _refuse_handover(_peek(path), recipe=recipe, host=host, mine=mine)
        yield Claim(None, mine)
        return
    layout.ensure_private_root()  # 0700, and never one another user planted in /tmp
    lock = file_lock(path, timeout=ACQUIRE_S)
    try:
        fd = lock.__enter__()
    except TimeoutError:
        raise _busy(_peek(path), recipe=recipe, host=host, mine=mine, held=True) from None
    try:
        if os.geteuid() == 0:  # root in a user's state root (become): the locks stay that user's, as the root is
            owner = os.stat(state_root)
            give_tree(str(path.parent), owner.st_uid, owner.st_gid)
        _refuse_handover(_read(fd), recipe=recipe, host=host, mine=mine)
        claim = Claim(fd, {**mine, "pid": os.getpid(), "since": time.time(), "pending_until": None})
        _write(fd, claim.record)
        yield claim
    finally:
        lock.__exit__(None, None, None)


def release_handover(state_root: Path, request: dict, *, host: str, run: str | None = None,
                     check_mode: bool = False) -> bool:
    """Give back a hand-over this operation's evict step left on ``host`` and its activate step never took
    (the restore stopped in between: another host failed). True when one was given back (check mode: would
    be, and nothing is written)."""
    recipe = request["workload"]["recipe"]
    mine = {"id": str(request.get("id")), "run": run or None}
    path = StateLayout(state_root).host_claim(recipe, machine_id())
    if not path.is_file():
        return False
    if check_mode:
        record = _peek(path)
        return bool(record and _same(record, mine) and record.get("pending_until"))
    try:
        with file_lock(path, timeout=ACQUIRE_S) as fd:
            record = _read(fd)
            if not record or not _same(record, mine) or not record.get("pending_until"):
                return False
            _write(fd, {**record, "pending_until": None})
            return True
    except TimeoutError:
        return False  # a step holds it: whatever it is, the hand-over is not this restore's to give back


def machine_id() -> str:
    """This machine's identity: ``/etc/machine-id`` (or D-Bus's copy), else its host name."""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        with contextlib.suppress(OSError):
            text = Path(path).read_text().strip()
            if text:
                return text
    return socket.gethostname()


def _same(record: dict, mine: dict) -> bool:
    """``record`` (a claim's holder) is the operation ``mine``: its id, and its run id where both have one."""
    return str(record.get("id")) == mine["id"] and _same_run(record, mine)


def _same_run(record: dict, mine: dict) -> bool:
    return not (record.get("run") and mine.get("run")) or record.get("run") == mine.get("run")


def _held_a_while(path: Path) -> bool:
    """Check mode's look at the lock: held now and still after a moment (a probe like this one holds it
    for an instant)."""
    deadline = time.monotonic() + ACQUIRE_S
    while lock_held(path, exclusive=True):
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.05)
    return False


def _refuse_handover(record: dict | None, *, recipe: str, host: str, mine: dict) -> None:
    """Refuse while another operation's eviction waits for its own activation (module doc)."""
    if not record or (succeeds(str(record.get("id")), mine["id"]) and _same_run(record, mine)):
        return  # its own hand-over, or its rollback's (the controller's, after its activation failed)
    until = record.get("pending_until")
    if isinstance(until, (int, float)) and not isinstance(until, bool) and time.time() < until:
        raise _busy(record, recipe=recipe, host=host, mine=mine, held=False)


def _busy(record: dict | None, *, recipe: str, host: str, mine: dict, held: bool) -> WorkloadBusy:
    rec = record or {}
    who = f"{rec.get('operation') or 'an operation'} {rec.get('id') or '(id unknown)'}" + \
        (f" (run {rec['run']})" if rec.get("run") else "")
    if held:
        what = f"its {rec.get('step') or 'step'} step is running (pid {rec.get('pid', '?')}, since {_clock(rec.get('since'))})"
        fix = (f"wait for {rec.get('id') or 'it'} to end (`coldsnap runs show {rec.get('id')}` on the controller "
               "that started it), then run again; operations on one workload run one at a time on each host")
    else:
        what = (f"it evicted the workload at {_clock(rec.get('since'))} and its activation comes next (the "
                f"workload is its own until {_clock(rec.get('pending_until'))})")
        fix = (f"wait for {rec.get('id') or 'it'} to end, then run again; if its controller is gone, run again "
               f"after {_clock(rec.get('pending_until'))}")
    # an activate step comes after its own eviction: what that changed, the restore's failure says
    outcome = "did not start" if mine["step"] == "activate" else "changed nothing"
    return WorkloadBusy(f"workload {recipe!r} on {host} is being changed by another operation: {who}: {what}; this "
                        f"{mine.get('operation') or 'operation'} ({mine['id']}, step {mine['step']}) {outcome}",
                        fix=fix, details={"holder": {k: rec.get(k) for k in ("operation", "id", "step", "pid")}})


def _clock(t) -> str:
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        return "?"
    return time.strftime("%H:%M:%S", time.localtime(t))


def _read(fd: int) -> dict | None:
    try:
        doc = json.loads(os.pread(fd, _RECORD_MAX, 0) or b"null")
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _peek(path: Path) -> dict | None:
    """The record without the lock (its holder may be rewriting it: then read again, once)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP):
            return None
        raise
    try:
        record = _read(fd)
        if record is None:
            time.sleep(0.05)
            record = _read(fd)
        return record
    finally:
        os.close(fd)


def _write(fd: int, record: dict) -> None:
    data = json.dumps(record, sort_keys=True).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
