"""How this host's launch units run: one interface, two runtimes, chosen once per request.

* :class:`~.host_runtime.HostRuntime` (``launch.runtime: host``): the activation
  runtime is a process with the host's Python; restored engines are kept by a
  subreaper (the unit keeper);
* :class:`~.docker_runtime.DockerRuntime` (``launch.runtime: docker``): it runs
  as PID 1 of the unit's rank container, from the unit's image at capture and
  from its capsule image at restore.

:func:`.runtimes.runtime_for` picks one; the per-operation steps (:mod:`.capture`,
:mod:`.restore`, :mod:`.lifecycle`) build unit specs and call it, never asking
which runtime it is.

Each runtime has two halves. :class:`RunningUnits` is what the lifecycle of running units
needs (status, sleep, wake, stop: :class:`~.host_units.HostUnits`,
:class:`~.docker_units.DockerUnits`); :class:`UnitRuntime` adds capture, prepare and restore.
The halves live in separate files because a module ships every file its imports reach: the
lifecycle module carries the small half only, and starts in a fraction of the time.
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import UnitError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import StateLayout
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import engine_control as ec
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import EVIDENCE_FILE, UnitSpec
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import placement


def run_concurrently(target, arg_tuples: list[tuple]) -> None:
    """Call ``target(*args)`` for every tuple at once (one thread each) and wait for all of them.

    The units of one activation meet at coordinator phases, so they must run side by side;
    ``target`` records its own result or failure.
    """
    threads = [threading.Thread(target=target, args=args) for args in arg_tuples]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def read_evidence(ev_path: Path, uid: str, output: str, code: int | None, *, who: str,
                  ended: str | None = None) -> dict:
    """The evidence a unit's activation runtime wrote, or a failure naming how it ended (``ended``, else its
    exit status) and its last output."""
    try:
        return json.loads(Path(ev_path).read_text())
    except (OSError, ValueError):
        status = ended or (f"exited {code}" if code is not None else "stopped")
        said = f"its output:\n{output[-2000:]}" if output.strip() else "it wrote no output"
        return {"ok": False, "unit": uid, "error": f"{who} {status} without evidence; {said}"}


def listeners_served(artifact: dict, request: dict, unit_id: str):
    """``(served, what)``: ``served(worker_evidence)`` lists where a captured worker's listeners come
    back on this restore (moved when the request names another serving port or address); ``what``
    names them in errors."""
    moved = placement.for_unit(artifact["launch"], request["launch"], unit_id)

    def served(worker: dict) -> list[tuple[str, int]]:
        return moved.listeners([(str(a), int(p)) for a, p in worker["listeners"]], unit=unit_id)

    what = (f"listening port (captured ones moved by {moved.port_shift:+d})" if moved.port_shift
            else "captured listening port")
    return served, what


def raise_failures(results: list[dict]) -> None:
    """Raise one UnitError naming every failed unit, the root cause first."""
    failed = [r for r in results if not r.get("ok")]
    if failed:
        # Prefer the root cause over "stopped because another unit failed".
        failed.sort(key=lambda r: "another unit failed" in r.get("error", ""))
        msg = "; ".join(_named(r.get("unit"), str(r.get("error"))) for r in failed)
        raise UnitError(msg, details={"evidence": results})


def _named(unit: Any, error: str) -> str:
    """``error`` led by its unit's name, once (a unit's own errors mostly name it already)."""
    prefix = f"unit {unit}:"
    return error if error.startswith(prefix) else f"{prefix} {error}"


class RunningUnits(ABC):
    """One request's running units on one host: their state, lifecycle steps and eviction."""

    name: str = ""

    def __init__(self, request: dict, *, host: str, state_root: Path | str, activation_digest: str | None = None,
                 python: str | None = None, owner: Any = None) -> None:
        self.request = request
        self.host = host
        self.layout = StateLayout(state_root)
        self.state_root = self.layout.root
        self.activation_digest = activation_digest
        self.python = python
        self.owner = owner

    # --------------------------------------------------------- running units
    @abstractmethod
    def lifecycle(self, specs: list[UnitSpec]) -> list[dict]:
        """status / sleep / wake / finish-warm / stop inside each running unit."""

    @abstractmethod
    def presence(self, unit_id: str) -> str:
        """``running`` (an engine of this workload answers here), ``crashed`` (one was started and is
        gone without being stopped) or ``stopped`` (none runs, or it was stopped)."""

    def unit_dir(self, artifact: dict, unit_id: str) -> Path:
        """Where the unit's captured state is on this host: the capture host still has its capture
        directory; elsewhere the capsule's state is extracted into a directory keyed by its digest
        (a docker unit's container sees it at the state target its capsule image records)."""
        cap = next(c for c in artifact["capsule"]["units"] if c["unit"] == unit_id)
        local = self.layout.capture_unit(artifact["capture_id"], unit_id)
        if (local / EVIDENCE_FILE).exists():
            return local
        return self.layout.extracted_capsule(cap["image_id"])

    @abstractmethod
    def evict(self, *, check_mode: bool) -> list[dict]:
        """Stop this workload's running units on this host; what was stopped."""

    def forget_control_files(self, unit_id: str, *, keep: Callable[[Path], bool] = lambda _f: False) -> None:
        """Remove the unit's control files (pid, port and token of engines that are gone: one left behind
        reads as a crash to ``status``), but those ``keep`` says still belong to a live engine."""
        wdir = self.layout.workload(self.request["workload"]["recipe"], unit_id)
        for f in wdir.glob(ec.CONTROL_FILE_NAME.format(worker="*")):
            if not keep(f):
                f.unlink(missing_ok=True)


class UnitRuntime(RunningUnits):
    """The runtime of one request's units on one host: capture, prepare and restore too."""

    #: Whether a running unit can be captured in place (target-local overlays).
    captures_in_place: bool = False

    @abstractmethod
    def capture(self, specs: list[UnitSpec]) -> list[dict]:
        """Start and capture every spec's unit; evidence in order."""

    @abstractmethod
    def restore(self, artifact: dict, specs: list[UnitSpec]) -> list[dict]:
        """Restore every spec's unit from its captured state; evidence in order."""

    def capture_running(self, specs: list[UnitSpec]) -> list[dict]:
        """Capture running units in place (target-local overlay)."""
        raise NotImplementedError

    def check_capture_free(self, units: list[dict]) -> None:
        """A capture may start on this host: nothing of the workload that it would disturb runs here
        (by default nothing can be: a container capture runs in a container of its own)."""
        del units

    # --------------------------------------------------------------- restore
    @abstractmethod
    def check_environment(self, units: list[dict]) -> None:
        """The units' userspace is the pinned one (runtime host: the environment digest)."""

    @abstractmethod
    def prepare(self, artifact: dict, *, facts: dict, check_mode: bool) -> tuple[list[dict], bool]:
        """Admission, capture state, pids and ports of every unit on this host, with the running
        workload untouched; (per-unit plans, whether anything was changed on disk)."""
