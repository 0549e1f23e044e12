"""Runtime ``host``, running units: status, sleep, wake and stop of engines that run as host processes.

:class:`HostUnits` is what the lifecycle needs; :class:`~.host_runtime.HostRuntime` adds
capture, prepare and restore. ``status`` asks each worker's control API directly (it only
reads); sleep, wake and finish-warm run the activation runtime (:func:`run_units`), which
owns hydration and validation.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import stat
import subprocess
import time
from pathlib import Path
from typing import BinaryIO

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    AdmissionError,
    ColdSnapError,
    UnitError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import atomic_write_json
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.proctree import (
    marked_root,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import StateLayout
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import engine_control as ec
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import units_on_host
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.secrets import without_credentials
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import (
    EVIDENCE_FILE,
    UnitSpec,
    load_evidence,
    new_evidence,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import ports
from ansible_collections.coldsnap.fleet.plugins.module_utils.process.engine_client import (
    ControlCallError,
    EngineClient,
    engine_answers,
    pid_alive,
    started_for,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import activation_stage
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.runtime import (
    RunningUnits,
    listeners_served,
    raise_failures,
    read_evidence,
    run_concurrently,
)


def tree_ids(pids: list[int]) -> set[int]:
    """The process and thread ids of every process in the trees rooted at ``pids``."""
    out: set[int] = set()
    for pid in pids:
        for p in ports.process_tree(pid):
            out.add(p)
            with contextlib.suppress(OSError):
                out.update(ports.tids_of(p))
    return out


class HostUnits(RunningUnits):
    """This request's units on this host as host processes, while they run."""

    name = "host"

    def run(self, specs: list[UnitSpec], *, timeout: float = 3600) -> list[dict]:
        return run_units(specs, state_root=self.state_root, activation_digest=self.activation_digest,
                         timeout=timeout)

    def lifecycle(self, specs: list[UnitSpec]) -> list[dict]:
        if specs and all(s.operation == "status" for s in specs):
            return [unit_status(s) for s in specs]
        return self.run(specs)

    def giving_back(self) -> contextlib.AbstractContextManager[None]:
        """Nothing to give back: the engines run as host processes of the module's own user, so what a
        lifecycle step writes already belongs to the user who ran it (``owner`` is for runtime docker)."""
        return contextlib.nullcontext()

    def running_pids(self, unit_id: str) -> list[int]:
        """The root pids of this workload's engines running on the host, one per worker of the unit that
        answers (proven through its control API); empty when none runs. An engine whose control API
        lives in a child (an engine-core process) is counted from the process the activation started,
        its ancestor with the same control file in its environment."""
        return self._engines(unit_id, answering_only=True)

    def presence(self, unit_id: str) -> str:
        if self.running_pids(unit_id):
            return "running"
        wdir = self.layout.workload(self.request["workload"]["recipe"], unit_id)
        return "crashed" if any(wdir.glob(ec.CONTROL_FILE_NAME.format(worker="*"))) else "stopped"

    def engine_pids(self, unit_id: str) -> list[int]:
        """Every engine of this workload's unit that is alive, answering or not: the ones that answer
        (:meth:`running_pids`) and the ones that are busy or hung but still carry their control file in
        their environment (a recycled pid does not). Eviction ends them all before any control file goes."""
        return self._engines(unit_id, answering_only=False)

    def _engines(self, unit_id: str, *, answering_only: bool) -> list[int]:
        wdir = self.layout.workload(self.request["workload"]["recipe"], unit_id)
        pids = []
        for f in sorted(wdir.glob(ec.CONTROL_FILE_NAME.format(worker="*"))):
            try:
                info = ec.ControlInfo.load(f)
            except (OSError, ValueError):
                continue
            if engine_answers(info) or (not answering_only and started_for(info.pid, f)):
                pids.append(marked_root(info.pid, ec.ENV_CONTROL_FILE))
        return pids

    def units_here(self) -> list[str]:
        """The units whose engines a restore (or a stop) of this workload ends on this host: those the request
        places here, then any other unit of the workload that left a control file here (a unit an earlier
        restore placed on this host and this one places elsewhere: ranks swapped between hosts). Its engine
        is this workload's too; left running, it would keep serving the replaced generation beside the
        restored one, out of reach of ``status`` and ``stop``."""
        ids = [u["id"] for u in units_on_host(self.request, self.host)]
        recipe_dir = self.layout.workloads / self.request["workload"]["recipe"]
        with contextlib.suppress(OSError):
            for d in sorted(recipe_dir.iterdir()):
                if d.name not in ids and not d.is_symlink() and d.is_dir() and \
                        any(d.glob(ec.CONTROL_FILE_NAME.format(worker="*"))):
                    ids.append(d.name)
        return ids

    def evicted_ids(self) -> set[int]:
        """Every process and thread id the evict step ends on this host: each engine of this workload's units
        here (answering or not; :meth:`units_here`) with its whole process tree."""
        return tree_ids([pid for unit_id in self.units_here() for pid in self.engine_pids(unit_id)])

    def require_restorable(self, artifact: dict, *, check_mode: bool) -> None:
        """The restore's evict step, right before its kill: prepare's check of the captured pids and of the
        ports the units' listeners come back on (:func:`~..process.ports.require_restorable`), again. Prepare
        may have passed minutes ago; a stranger that took one since would make the restore fail after the
        workload was killed. Only what the eviction ends (:meth:`evicted_ids`) may hold them; refused,
        naming the holder and the fix, with nothing evicted. Read-only: check mode runs it too, but for a
        unit whose captured state a check-mode prepare did not make available (not extracted)."""
        replaced = self.evicted_ids()
        for u in units_on_host(self.request, self.host):
            path = self.unit_dir(artifact, u["id"]) / EVIDENCE_FILE
            try:
                captured = load_evidence(path)
            except (OSError, ValueError) as exc:
                if check_mode:
                    continue
                raise AdmissionError(f"unit {u['id']}: its captured state cannot be read at {path} ({exc}), so its "
                                     "pids and ports cannot be checked before eviction; nothing was evicted",
                                     fix="run the whole restore again (its prepare step makes the captured state "
                                         "available on this host)") from None
            served, what = listeners_served(artifact, self.request, u["id"])
            ports.require_restorable(captured["workers"], unit=u["id"], served=served, replaced=replaced, what=what,
                                     at_evict=True)

    def evict(self, *, check_mode: bool) -> list[dict]:
        """SIGKILL this workload's engines (each whole process tree; one that stopped answering too), wait
        until their pids are free, and remove their control files (the workload is stopped, not crashed)."""
        stopped = []
        units = self.units_here()
        for unit_id in units:
            pids = self.engine_pids(unit_id)
            if not pids:
                continue
            # Every worker's engine of the unit, each with its whole process tree.
            tree = set().union(*(ports.process_tree(pid) for pid in pids))
            stopped.append({"unit": unit_id, "pid": pids[0], "pids": pids, "processes": len(tree)})
            if check_mode:
                continue
            for p in sorted(tree):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            # Wait until the pids are gone, not just dead: the restore needs them free again.
            deadline = time.monotonic() + 30
            while any(Path(f"/proc/{p}").exists() for p in tree):
                if time.monotonic() > deadline:
                    raise ColdSnapError(f"unit {unit_id}: engine pids {pids} were killed but not reaped within 30 s",
                                        fix="its parent does not reap children; restart the unit's keeper or host init")
                time.sleep(0.02)
        if not check_mode:
            for unit_id in units:
                # an engine still alive keeps its file: ColdSnap can still reach and stop it
                self.forget_control_files(unit_id, keep=_engine_alive)
        return stopped


def unit_status(spec: UnitSpec, *, host_pids: bool = True) -> dict:
    """A running unit's state from its workers' control APIs (what the activation runtime's ``status``
    answers, without starting it): ``absent`` when a worker has no control file, the workers' common
    state, or ``mixed``. A worker whose engine does not answer as itself fails the unit.

    ``host_pids`` false: the control files' pids are those of a container's own pid namespace (runtime
    docker), which mean nothing here; the engine's answer (its token, its own pid) alone tells it."""
    t0 = time.monotonic_ns()
    workers = []
    state = "absent"
    for w in spec.workers:
        try:
            info = ec.ControlInfo.load(ec.control_file_path(spec.workload_dir, w["id"]))
        except FileNotFoundError:
            workers = []
            break
        except (OSError, ValueError) as exc:
            raise UnitError(f"unit {spec.unit_id}: worker {w['id']}'s control file cannot be read: {exc}",
                            fix="restore the workload (its engine is not one ColdSnap can reach)") from None
        reply = None
        if not host_pids or pid_alive(info.pid):
            with contextlib.suppress(OSError, ControlCallError, http.client.HTTPException):
                reply = EngineClient(info).status(timeout=30)
        if reply is None or int(reply.get("pid", -1)) != info.pid:
            raise UnitError(f"unit {spec.unit_id}: worker {w['id']} (pid {info.pid}) is not running",
                            fix="restore the workload first")
        if not isinstance(reply.get("state"), str):
            raise UnitError(f"unit {spec.unit_id}: worker {w['id']} (pid {info.pid}) answered {ec.STATUS} without "
                            "a state",
                            fix="the engine's integration does not speak ColdSnap's control API; restore "
                                "the workload with this collection's engines")
        workers.append({"worker": w["id"], "pid": info.pid, "state": reply["state"]})
    if workers:
        states = {w["state"] for w in workers}
        state = states.pop() if len(states) == 1 else "mixed"
    return new_evidence(operation=spec.operation, operation_id=spec.operation_id, capture_id=spec.capture_id,
                        unit=spec.unit_id, host=spec.host, workers=workers, readiness=None, reply=None,
                        reply_sha256=None, logprobs=None, logprobs_check=None,
                        timing={"spans": [], "marks": [], "t0_ns": t0}, state=state, changed=False, ok=True)


def bytecode_dir(layout: StateLayout) -> Path:
    """The activation runtime's bytecode directory (``PYTHONPYCACHEPREFIX``), created private; anything
    else under that name is refused, naming it, rather than written through."""
    path = layout.activation_bytecode
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise UnitError(f"{path} is not a directory: it holds the activation runtime's compiled modules",
                        fix=f"remove {path}; the next operation creates it again")
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def run_units(specs: list[UnitSpec], *, state_root: Path | str, activation_digest: str,
              timeout: float = 3600) -> list[dict]:
    """Run the activation runtime for every spec at once as host processes; their evidence in order.

    All units are started before any is awaited (units of one activation meet at
    coordinator phases). The first failure's message is raised with every unit's.
    Files go to the operation's run directory (``runs/<operation id>/``).
    """
    layout = StateLayout(state_root)
    adir = activation_stage.require_staged(layout.root, activation_digest)
    run_dir = layout.run(specs[0].operation_id) if specs else layout.runs
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    bytecode = bytecode_dir(layout)
    procs = []
    prepared = []
    try:
        for base in specs:  # every log opened before any unit starts: a refused one leaves nothing running
            spec = base.replace(t0_ns=time.monotonic_ns())
            uid = spec.unit_id
            spec_path = run_dir / f"spec-{spec.operation}-{uid}.json"
            ev_path = run_dir / f"evidence-{spec.operation}-{uid}.json"
            log_path = run_dir / f"activation-{spec.operation}-{uid}.log"
            ev_path.unlink(missing_ok=True)
            atomic_write_json(spec_path, spec.to_json(), mode=0o600)
            prepared.append((spec, spec_path, ev_path, _open_log(log_path), log_path))
    except BaseException:
        for entry in prepared:
            entry[3].close()
        raise
    for spec, spec_path, ev_path, log, log_path in prepared:
        env = {**without_credentials(os.environ), "PYTHONPYCACHEPREFIX": str(bytecode), "PYTHONPATH": os.pathsep.join(
            [str(adir)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        p = subprocess.Popen([spec.python, "-m", "coldsnap_activation", spec.operation, "--spec", str(spec_path),
                              "--evidence", str(ev_path)], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                             env=env, cwd="/")
        procs.append((spec.unit_id, p, ev_path, log, log_path))
    results: list[dict] = [{} for _proc in procs]

    def wait(i: int, proc: tuple) -> None:
        uid, p, ev_path, log, log_path = proc
        timed_out = False
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM first: the runtime fails like on any error (kills what it restored, writes evidence).
            timed_out = True
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        log.close()
        results[i] = read_evidence(ev_path, uid, log_path.read_text(errors="replace"), p.returncode,
                                   who="activation runtime")
        if timed_out and not results[i].get("ok"):
            results[i]["error"] = (f"unit {uid}: timed out after {timeout:.0f} s; " + str(results[i].get("error")))

    run_concurrently(wait, list(enumerate(procs)))
    raise_failures(results)
    return results


def _open_log(log_path: Path) -> BinaryIO:
    """The activation's log, for appending: never through a link (one planted in the run directory of a state
    root its user owns would have root append to, and chmod, any file), and a FIFO or directory planted there
    is refused at once instead of blocking (O_NONBLOCK does nothing to a regular file)."""
    try:
        log = os.fdopen(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
                                | os.O_NONBLOCK, 0o600), "ab")
    except OSError as exc:
        raise UnitError(f"cannot open the activation log {log_path}: {exc.strerror or exc}",
                        fix=f"remove {log_path} (a symbolic link, a FIFO or a directory there is refused); the next "
                            "run makes it") from None
    if not stat.S_ISREG(os.fstat(log.fileno()).st_mode):
        log.close()
        raise UnitError(f"the activation log {log_path} is not a regular file",
                        fix=f"remove {log_path}; the next run makes it")
    os.fchmod(log.fileno(), 0o600)
    return log


def _engine_alive(control_file: Path) -> bool:
    try:
        return started_for(ec.ControlInfo.load(control_file).pid, control_file)
    except (OSError, ValueError):
        return False
