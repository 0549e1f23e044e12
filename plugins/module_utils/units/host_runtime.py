"""Runtime ``host``: the activation runtime runs as a process with the host's Python.

A restored engine keeps its captured pids (CRIU restores them in the host's pid
namespace) and is kept by a subreaper, the unit keeper. The unit's userspace is
pinned by ``environment_digest`` (the installed Python environment).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.build import (
    CapsuleRef,
    extract_capsule,
    restore_caches,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    AdmissionError,
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import atomic_write_json
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import StateLayout
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import engine_control as ec
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import units_on_host
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import (
    EVIDENCE_FILE,
    UnitSpec,
    load_evidence,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import files, ports
from ansible_collections.coldsnap.fleet.plugins.module_utils.process.engine_client import engine_answers
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import (
    activation_stage,
    capture_state,
    environment,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.admission import GpuMoves, admit_unit
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.runtime import (
    UnitRuntime,
    listeners_served,
    raise_failures,
    read_evidence,
    run_concurrently,
)


class HostRuntime(UnitRuntime):
    """Units as host processes."""

    name = "host"
    captures_in_place = True

    # ------------------------------------------------------------ running units
    def run(self, specs: list[UnitSpec], *, timeout: float = 3600) -> list[dict]:
        return run_units(specs, state_root=self.state_root, activation_digest=self.activation_digest,
                         timeout=timeout)

    def capture(self, specs: list[UnitSpec]) -> list[dict]:
        return self.run(specs)

    def capture_running(self, specs: list[UnitSpec]) -> list[dict]:
        return self.run(specs)

    def restore(self, artifact: dict, specs: list[UnitSpec]) -> list[dict]:
        return self.run(specs)

    def lifecycle(self, specs: list[UnitSpec]) -> list[dict]:
        return self.run(specs)

    def check_capture_free(self, units: list[dict]) -> None:
        """A capture runs the workload's engine where the running one keeps its control file and log:
        with the workload running here, it would take them over (the running server could then no longer
        be slept, stopped or replaced). Refused before anything starts."""
        recipe = self.request["workload"]["recipe"]
        for u in units:
            pid = self.running_pid(u["id"])
            if pid is not None:
                raise ColdSnapError(
                    f"unit {u['id']}: workload {recipe!r} is running on {self.host} (engine pid {pid}); a capture "
                    "would start a second engine in its place",
                    fix="stop it first (coldsnap.fleet.unit_lifecycle state=stopped; a restore brings it back), "
                        "or capture under another workload.recipe")

    # ------------------------------------------------------------------ restore
    def check_environment(self, units: list[dict]) -> None:
        """Every unit's Python environment must be the pinned one."""
        for u in units:
            python = environment.unit_python(u["command"], self.python or sys.executable)
            environment.require(u["environment_digest"], python, unit=u["id"], host=self.host)

    def ensure_unit_state(self, artifact: dict, unit_id: str, *, check_mode: bool) -> tuple[Path, bool]:
        """Make the unit's captured state available (extract its capsule when needed)."""
        path = self.unit_dir(artifact, unit_id)
        if (path / EVIDENCE_FILE).exists():
            return path, False
        cap = next(c for c in artifact["capsule"]["units"] if c["unit"] == unit_id)
        if check_mode:
            return path, True
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        extract_capsule(CapsuleRef.from_dict(cap), tmp, replace=True)
        if not (tmp / EVIDENCE_FILE).exists():
            raise ColdSnapError(f"capsule {cap['image_id']} of unit {unit_id} holds no captured state",
                                fix="recapture; the capsule is not a ColdSnap unit capsule")
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.rename(tmp, path)
        return path, True

    def prepare(self, artifact: dict, *, facts: dict, check_mode: bool) -> tuple[list[dict], bool]:
        units = units_on_host(self.request, self.host)
        captured_units = {u["id"]: u for u in artifact["launch"]["units"]}
        self.check_environment([captured_units[u["id"]] for u in units])
        plans = []
        changed = False
        moves = GpuMoves(artifact, facts)
        for u in units:
            adm = admit_unit(artifact=artifact, unit_id=u["id"], facts=facts, devices=u["devices"], host=self.host,
                             policy=self.request["policy"].get("compatibility"))
            path, extracted = self.ensure_unit_state(artifact, u["id"], check_mode=check_mode)
            changed |= extracted
            plan = {"unit": u["id"], "admission": adm, "unit_dir": str(path)}
            if not check_mode:
                plan["state"] = verify_unit_state(path, artifact, u["id"])
                captured = load_evidence(path / EVIDENCE_FILE)
                moves.add(u, captured, captured_units[u["id"]])
                # The workload being replaced is evicted only after prepare passed everywhere: its own
                # pids and ports do not count, anyone else's do.
                replaced = self.replaced_pids(u["id"])
                served, what = listeners_served(artifact, self.request, u["id"])
                for w in captured["workers"]:
                    ports.require_pids_free([p for p in [w["pid"], *w["tids"]] if p not in replaced], unit=u["id"])
                    ports.require_ports_free(served(w), unit=u["id"], replaced=replaced, what=what)
                plan["listeners"] = [list(x) for w in captured["workers"] for x in served(w)]
                plan["caches_added"] = self.require_files(artifact, u["id"], captured, path)
            plans.append(plan)
        moves.admit(self.host)
        return plans, changed

    def require_files(self, artifact: dict, unit_id: str, captured: dict, unit_dir: Path) -> int:
        """Every file the captured tree maps or holds open must be here at its captured size (CRIU
        restores them by path). Derived caches the capsule carries are added where this host lacks
        them; anything else missing fails prepare, naming the file. Returns how many files were added."""
        # The workload directory's files (the engine log) are the activation runtime's: it creates them
        # before CRIU restores the tree, on whichever host the unit lands.
        wdir = str(self.layout.workload(self.request["workload"]["recipe"], unit_id))
        recorded = [f for w in captured["workers"] for f in w.get("files", []) if not files.under(f["path"], wdir)]
        problems = files.file_problems(recorded)
        added = 0
        caches = [c for c in artifact["policy"]["cache"]["paths"]
                  if any(files.under(path, c) for path, _why in problems)]
        if caches:
            cap = next(c for c in artifact["capsule"]["units"] if c["unit"] == unit_id)
            scratch = unit_dir.with_name(f".{unit_dir.name}.caches-{os.getpid()}")
            added = len(restore_caches(CapsuleRef.from_dict(cap), caches, scratch))
            problems = files.file_problems(recorded)
        if problems:
            shown = "; ".join(f"{p} ({why})" for p, why in problems[:5])
            more = f" and {len(problems) - 5} more" if len(problems) > 5 else ""
            raise AdmissionError(
                f"unit {unit_id} on {self.host}: the captured processes use files this host lacks or holds in "
                f"another version: {shown}{more}",
                fix="install the same engine environment and files here; for derived caches (compiled kernels), "
                    "declare their directory in policy.cache.paths at capture so the capsule carries them")
        return added

    def replaced_pids(self, unit_id: str) -> set[int]:
        """Every process and thread id of this workload's running unit (empty when none runs)."""
        pid = self.running_pid(unit_id)
        if pid is None:
            return set()
        out: set[int] = set()
        for p in ports.process_tree(pid):
            out.add(p)
            with contextlib.suppress(OSError):
                out.update(ports.tids_of(p))
        return out

    def running_pid(self, unit_id: str) -> int | None:
        """The pid of this workload's engine running on the host, if any (proven through its control API)."""
        wdir = self.layout.workload(self.request["workload"]["recipe"], unit_id)
        for f in sorted(wdir.glob(ec.CONTROL_FILE_NAME.format(worker="*"))):
            try:
                info = ec.ControlInfo.load(f)
            except (OSError, ValueError):
                continue
            if engine_answers(info):
                return info.pid
        return None

    def presence(self, unit_id: str) -> str:
        if self.running_pid(unit_id) is not None:
            return "running"
        wdir = self.layout.workload(self.request["workload"]["recipe"], unit_id)
        return "crashed" if any(wdir.glob(ec.CONTROL_FILE_NAME.format(worker="*"))) else "stopped"

    def evict(self, *, check_mode: bool) -> list[dict]:
        """SIGKILL this workload's engines (each whole process tree), wait until their pids are free, and
        remove their control files (the workload is stopped, not crashed)."""
        stopped = []
        for u in units_on_host(self.request, self.host):
            pid = self.running_pid(u["id"])
            if pid is None:
                continue
            tree = ports.process_tree(pid)
            stopped.append({"unit": u["id"], "pid": pid, "processes": len(tree)})
            if check_mode:
                continue
            for p in sorted(tree):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            # Wait until the pids are gone, not just dead: the restore needs them free again.
            deadline = time.monotonic() + 30
            while any(Path(f"/proc/{p}").exists() for p in tree):
                if time.monotonic() > deadline:
                    raise ColdSnapError(f"unit {u['id']}: engine pid {pid} was killed but not reaped within 30 s",
                                        fix="its parent does not reap children; restart the unit's keeper or host init")
                time.sleep(0.02)
        if not check_mode:
            for u in units_on_host(self.request, self.host):
                wdir = self.layout.workload(self.request["workload"]["recipe"], u["id"])
                for f in wdir.glob(ec.CONTROL_FILE_NAME.format(worker="*")):
                    f.unlink(missing_ok=True)
        return stopped


def verify_unit_state(path: Path, artifact: dict, unit_id: str) -> dict:
    """The unit's captured state is what the capture sealed, and its workers' payload files are the ones
    the artifact records (checked before anything is evicted)."""
    cap = next(c for c in artifact["capsule"]["units"] if c["unit"] == unit_id)
    stats = capture_state.verify(path, cap.get("state"), unit=unit_id)
    listed = capture_state.listed_files(path)
    for w in artifact["weights"]["workers"]:
        if w["unit"] != unit_id:
            continue
        for key in ("residual", "manifest", "replay"):
            rel = w[key]["path"]  # relative to the unit directory (workers/<worker>/<file>)
            got = listed.get(rel)
            if got is None or got["sha256"] != w[key]["sha256"] or got["size"] != w[key]["size"]:
                raise IntegrityError(f"unit {unit_id}: worker {w['worker']}'s {w[key]['path']} is not the file the "
                                     "artifact records", fix=capture_state.RECOVER)
    return stats


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
    procs = []
    for base in specs:
        spec = base.replace(t0_ns=time.monotonic_ns())
        uid = spec.unit_id
        spec_path = run_dir / f"spec-{spec.operation}-{uid}.json"
        ev_path = run_dir / f"evidence-{spec.operation}-{uid}.json"
        log_path = run_dir / f"activation-{spec.operation}-{uid}.log"
        ev_path.unlink(missing_ok=True)
        atomic_write_json(spec_path, spec.to_json(), mode=0o600)
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": os.pathsep.join(
            [str(adir)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
        log = open(log_path, "ab")
        os.fchmod(log.fileno(), 0o600)
        p = subprocess.Popen([spec.python, "-m", "coldsnap_activation", spec.operation, "--spec", str(spec_path),
                              "--evidence", str(ev_path)], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                             env=env, cwd="/")
        procs.append((uid, p, ev_path, log, log_path))
    results: list[dict] = [{} for _proc in procs]

    def wait(i: int, proc: tuple) -> None:
        uid, p, ev_path, log, log_path = proc
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()
        results[i] = read_evidence(ev_path, uid, log_path.read_text(errors="replace"), p.returncode,
                                   who="activation runtime")

    run_concurrently(wait, list(enumerate(procs)))
    raise_failures(results)
    return results
