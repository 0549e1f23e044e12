"""Runtime ``host``: the activation runtime runs as a process with the host's Python.

A restored engine keeps its captured pids (CRIU restores them in the host's pid
namespace) and is kept by a subreaper, the unit keeper. The unit's userspace is
pinned by ``environment_digest`` (the installed Python environment).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import archive
from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.build import (
    CapsuleRef,
    extract_capsule,
    place_caches,
    restore_caches,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    AdmissionError,
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import engine_control as ec
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import units_on_host
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import (
    CONTROL_DIR,
    EVIDENCE_FILE,
    UnitSpec,
    load_evidence,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import files, ports
from ansible_collections.coldsnap.fleet.plugins.module_utils.process.gpu_memory import gpu_memory
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import (
    capture_state,
    environment,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.admission import (
    GpuMoves,
    GpuRoom,
    admit_unit,
    with_criu_check,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.host_units import HostUnits
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.runtime import (
    UnitRuntime,
    listeners_served,
)


class HostRuntime(HostUnits, UnitRuntime):
    """Units as host processes: capture, prepare and restore (running units' steps are in
    :class:`~.host_units.HostUnits`)."""

    captures_in_place = True

    # ------------------------------------------------------------ running units
    def capture(self, specs: list[UnitSpec]) -> list[dict]:
        return self.run(specs)

    def capture_running(self, specs: list[UnitSpec]) -> list[dict]:
        return self.run(specs)

    def restore(self, artifact: dict, specs: list[UnitSpec]) -> list[dict]:
        return self.run(specs)

    def check_capture_free(self, units: list[dict]) -> None:
        """A capture runs the workload's engine where the running one keeps its control file and log:
        with the workload running here, it would take them over (the running server could then no longer
        be slept, stopped or replaced). Refused before anything starts."""
        recipe = self.request["workload"]["recipe"]
        for u in units:
            pids = self.running_pids(u["id"])
            if pids:
                raise ColdSnapError(
                    f"unit {u['id']}: workload {recipe!r} is running on {self.host} (engine pid "
                    f"{', '.join(map(str, pids))}); a capture "
                    "would start a second engine in its place",
                    fix="stop it first (coldsnap.fleet.unit_lifecycle state=stopped; a restore brings it back), "
                        "or capture under another workload.recipe")

    # ------------------------------------------------------------------ restore
    def check_environment(self, units: list[dict]) -> None:
        """Every unit's Python environment must be the pinned one."""
        for u in units:
            python = environment.unit_python(u["command"], self.python or sys.executable, u.get("environment"))
            environment.require(u["environment_digest"], python, unit=u["id"], host=self.host)

    def ensure_unit_state(self, artifact: dict, unit_id: str, *, check_mode: bool) -> tuple[Path, dict | None]:
        """Make the unit's captured state available (extract its capsule when needed). Returns the unit
        directory and, when it was just extracted, the SHA-256 of every file written (taken from the bytes
        as they were written, so the check against the seal need not read them again); else None."""
        path = self.unit_dir(artifact, unit_id)
        if (path / EVIDENCE_FILE).exists():
            return path, None
        cap = next(c for c in artifact["capsule"]["units"] if c["unit"] == unit_id)
        if check_mode:
            return path, {}
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        digests: dict[str, str] = {}
        # The derived caches come out in the same pass (placed by require_files where this host lacks them).
        caches = artifact["policy"]["cache"]["paths"]
        try:
            extract_capsule(CapsuleRef.from_dict(cap), tmp, replace=True, digests=digests,
                            caches_to=(caches, _cache_scratch(path)) if caches else None)
            if not (tmp / EVIDENCE_FILE).exists():
                raise ColdSnapError(f"capsule {cap['image_id']} of unit {unit_id} holds no captured state",
                                    fix="recapture; the capsule is not a ColdSnap unit capsule")
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.rename(tmp, path)
        except BaseException:
            archive.rmtree(tmp)  # nothing half-extracted stays under a name a later prepare would look at
            raise
        return path, digests

    def prepare(self, artifact: dict, *, facts: dict, check_mode: bool) -> tuple[list[dict], bool]:
        units = units_on_host(self.request, self.host)
        captured_units = {u["id"]: u for u in artifact["launch"]["units"]}
        self.check_environment([captured_units[u["id"]] for u in units])
        plans = []
        changed = False
        moves = GpuMoves(artifact, facts)
        room = GpuRoom(artifact, gpu_memory() if any(u["devices"] for u in units) else None)
        facts = with_criu_check(facts)
        claims: dict = {}  # pids and listeners the host's units need, by unit: no two may need the same
        # What the evict step ends (every engine of this workload here, with its process tree): the one set of
        # pids and ports a restored unit may find taken, as the evict step's own check counts them.
        replaced = self.evicted_ids()
        for u in units:
            adm = admit_unit(artifact=artifact, unit_id=u["id"], facts=facts, devices=u["devices"], host=self.host,
                             policy=self.request["policy"].get("compatibility"))
            path = self.unit_dir(artifact, u["id"])
            try:
                path, written = self.ensure_unit_state(artifact, u["id"], check_mode=check_mode)
                changed |= written is not None
                plan = {"unit": u["id"], "admission": adm, "unit_dir": str(path)}
                if not check_mode:
                    plan.update(self._prepare_unit(artifact, u, path, written=written, moves=moves, room=room,
                                                   captured_unit=captured_units[u["id"]], claims=claims,
                                                   replaced=replaced))
            finally:
                archive.rmtree(_cache_scratch(path))  # caches extracted with the state and not placed
            plans.append(plan)
        moves.admit(self.host)
        # GPU memory: what every engine the eviction ends (hung ones too) holds is freed
        gpu = room.admit(self.host, replaced=replaced)
        for plan in plans if gpu else []:
            plan["gpu_memory"] = gpu
        return plans, changed

    def _prepare_unit(self, artifact: dict, u: dict, path: Path, *, written: dict | None, moves: GpuMoves,
                      room: GpuRoom, captured_unit: dict, claims: dict, replaced: set[int]) -> dict:
        """Prepare's checks of one unit whose state is here: what its plan records."""
        plan = {"state": verify_unit_state(path, artifact, u["id"], written=written)}
        captured = load_evidence(path / EVIDENCE_FILE)
        moves.add(u, captured, captured_unit)
        # The workload being replaced is evicted only after prepare passed everywhere: its own pids and ports
        # (of every unit of it here: one unit may come back on the port another holds now) do not count,
        # anyone else's do.
        served, what = listeners_served(artifact, self.request, u["id"])
        ports.require_restorable(captured["workers"], unit=u["id"], served=served, replaced=replaced, what=what)
        ports.require_distinct_units(claims, u["id"], [i for w in captured["workers"] for i in [w["pid"], *w["tids"]]],
                                     what="captured pid")
        ports.require_distinct_units(claims, u["id"], [tuple(x) for w in captured["workers"] for x in served(w)],
                                     what="port")
        room.add(u, captured)
        self.require_same_control_files(path, captured, u["id"])
        plan["listeners"] = [list(x) for w in captured["workers"] for x in served(w)]
        plan["caches_added"] = self.require_files(artifact, u["id"], captured, path)
        return plan

    def require_same_control_files(self, unit_dir: Path, captured: dict, unit_id: str) -> None:
        """A restored engine reads its control token from the control file named in its (restored)
        environment: under another state root than at capture it would never see this restore's token
        (and the restore would fail after the eviction). Refused here, naming the capture's state root."""
        wdir = self.layout.workload(self.request["workload"]["recipe"], unit_id)
        for w in captured["workers"]:
            try:
                recorded = json.loads((unit_dir / CONTROL_DIR / f"{w['worker']}.json").read_text()).get("control_file")
            except (OSError, ValueError, AttributeError):
                continue  # a capture before the path was recorded: the activation's own checks apply
            mine = str(ec.control_file_path(wdir, w["worker"]))
            if isinstance(recorded, str) and os.path.realpath(recorded) != os.path.realpath(mine):
                root = Path(recorded).parents[3]  # <root>/workloads/<recipe>/<unit>/control-<worker>.json
                raise AdmissionError(
                    f"unit {unit_id} worker {w['worker']} was captured under state root {root}; this restore uses "
                    f"{self.layout.root} (the restored engine reads its control file at {recorded})",
                    fix=f"restore with the capture's state root (--state-root {root}, coldsnap_state_root); the "
                        "state root is the same path on every host of a workload")

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
        scratch = _cache_scratch(unit_dir)
        if caches and scratch.is_dir():  # this prepare has just extracted them with the state
            added = len(place_caches(unit_id, caches, scratch))
            problems = files.file_problems(recorded)
        elif caches:
            cap = next(c for c in artifact["capsule"]["units"] if c["unit"] == unit_id)
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


def _cache_scratch(unit_dir: Path) -> Path:
    """Where this prepare keeps the derived-cache files it extracted with a unit's state, until placed."""
    return unit_dir.with_name(f".{unit_dir.name}.caches-{os.getpid()}")


def verify_unit_state(path: Path, artifact: dict, unit_id: str, *, written: dict[str, str] | None = None) -> dict:
    """The unit's captured state is what the capture sealed, and its workers' payload files are the ones
    the artifact records (checked before anything is evicted). ``written``: digests of files this prepare
    has just extracted (:meth:`HostRuntime.ensure_unit_state`)."""
    cap = next(c for c in artifact["capsule"]["units"] if c["unit"] == unit_id)
    stats = capture_state.verify(path, cap.get("state"), unit=unit_id, written=written)
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
