"""Runtime ``docker``, running units: status, sleep, wake and stop of rank containers.

:class:`DockerUnits` is what the lifecycle needs; :class:`~.docker_runtime.DockerRuntime`
adds capture, prepare and restore. ``status`` (and check mode) asks each worker's control API from
the host, as runtime ``host`` does, and writes nothing; sleep, wake and finish-warm run the activation
runtime inside the unit's running container (``docker exec``), as PID 1's sibling. It runs as root there: what it
wrote under the state root is given back to the invoking user (``owner``) afterwards, also when
the step failed, as a capture's or a restore's is (:mod:`.ownership`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import dockerapi
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    AdmissionError,
    ColdSnapError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import atomic_write_json
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.capsule_labels import (
    LABEL_STATE_TARGET,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import units_on_host
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import UnitSpec
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import containers as docker_unit
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.host_units import unit_status
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.ownership import (
    chown_state_paths,
    normalize_ownership,
    parse_owner,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.runtime import (
    RunningUnits,
    raise_failures,
    read_evidence,
    run_concurrently,
)

DOCKER_PYTHON = "/usr/bin/python3"


def canonical_name(request: dict, unit_id: str) -> str:
    return docker_unit.canonical_container_name(request["workload"]["recipe"], unit_id)


def docker_spec(spec: UnitSpec, *, unit_dir: str | None = None, supervise: bool = False) -> UnitSpec:
    """A host-built unit spec made valid inside the rank container.

    The container's Python and CRIU are the image's; GPUs handed to the
    container by ordinal appear inside it as 0..n-1.
    """
    unit = {**spec.unit, "devices": list(range(len(spec.unit.get("devices", []))))}
    launcher = dict(spec.launcher)
    if launcher.get("private_shm"):
        # The container is the unit's own mount namespace and /dev/shm: no namespace of the engine's
        # own (CRIU could not take the container's bind mounts into it); /dev/shm is archived instead.
        launcher.update(private_shm=False, shm_archive=True)
    return spec.replace(python=DOCKER_PYTHON, criu_binary=None, supervise=supervise, unit=unit, launcher=launcher,
                        unit_dir=unit_dir if unit_dir is not None else spec.unit_dir)


def write_spec(run_dir: Path, spec: UnitSpec) -> tuple[Path, Path]:
    spec = spec.replace(t0_ns=time.monotonic_ns())
    spec_path = run_dir / f"spec-{spec.operation}-{spec.unit_id}.json"
    ev_path = run_dir / f"evidence-{spec.operation}-{spec.unit_id}.json"
    ev_path.unlink(missing_ok=True)
    atomic_write_json(spec_path, spec.to_json(), mode=0o600)
    return spec_path, ev_path


def container_evidence(ev_path: Path, uid: str, log_text: str, code: int | None, *,
                       oom_killed: bool = False) -> dict:
    """What a rank container's controller reported, or how the container ended without a report: a PID 1
    ended by a signal is exit 128+N (``docker kill``, ``docker stop`` past its grace, the OOM killer)."""
    ended = None
    if oom_killed:
        ended = f"was killed by the OOM killer (exit {code}: the container ran out of memory)"
    elif code is not None and 128 < code < 128 + signal.NSIG:
        try:
            name = signal.Signals(code - 128).name
        except ValueError:
            name = f"signal {code - 128}"
        ended = (f"was killed by {name} (exit {code}: docker kill, docker stop past its grace period, or "
                 "the OOM killer of the host)")
    return read_evidence(ev_path, uid, log_text, code, who="rank container", ended=ended)


def oom_killed(container: Any) -> bool:
    """Whether Docker records the (exited) container as ended by the OOM killer."""
    try:
        container.reload()
        return bool(container.attrs.get("State", {}).get("OOMKilled"))
    except Exception:  # a removed container records nothing
        return False


def canonical_container(request: dict, unit_id: str, *, client: Any) -> Any | None:
    docker = dockerapi.docker_module()
    name = canonical_name(request, unit_id)
    try:
        c = client.containers.get(name)
    except docker.errors.NotFound:
        return None
    foreign = docker_unit.foreign_container(c, recipe=request["workload"]["recipe"], unit=unit_id)
    if foreign:
        raise AdmissionError(foreign, fix=docker_unit.FOREIGN_FIX)
    return c


def container_exists(client: Any, cid: str) -> bool:
    docker = dockerapi.docker_module()
    try:
        client.containers.get(cid)
        return True
    except docker.errors.NotFound:
        return False


class DockerUnits(RunningUnits):
    """This request's units on this host as rank containers, while they run."""

    name = "docker"

    def __init__(self, request: dict, *, client: Any = None, **kwargs: Any) -> None:
        super().__init__(request, **kwargs)
        self._client = client
        self.owner = parse_owner(self.owner)

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = dockerapi.docker_client()
        return self._client

    @property
    def run_dir(self) -> Path:
        """Spec, evidence and log files of this operation's rank containers (bound into them)."""
        return self.layout.unit_runs(self.request["id"])

    def lifecycle(self, specs: list[UnitSpec]) -> list[dict]:
        """Run a lifecycle operation (sleep, wake, finish-warm) inside each unit's running container; status
        asks the running containers' workers from the host and changes nothing.

        Each unit's workload directory (the spec and evidence files, and whatever the root activation
        runtime wrote there) is given to ``owner`` afterwards, also when the operation failed."""
        client, request = self.client, self.request
        results: list[dict] = [{} for _spec in specs]
        owned: list[Path] = []
        # Looked up (and a foreign container of the same name refused) before any unit is acted on.
        containers = [canonical_container(request, spec.unit_id, client=client) for spec in specs]
        if specs and all(spec.operation == "status" for spec in specs):
            # Status (and every check mode) only reads: the workers' control APIs are asked from here (the
            # container shares the host's network, its workload directory is bound at its own path). No
            # spec or evidence file is written, nothing runs inside the container, nothing is chowned.
            return [unit_status(spec, host_pids=False) if c is not None and c.status == "running" else
                    {"ok": True, "unit": spec.unit_id, "workers": [], "state": "absent", "changed": False}
                    for spec, c in zip(specs, containers, strict=True)]

        def one(i: int, spec: UnitSpec) -> None:
            uid = spec.unit_id
            container = containers[i]
            if container is None or container.status != "running":
                results[i] = {"ok": True, "unit": uid, "workers": [], "state": "absent", "changed": False}
                return
            target = container.labels.get(LABEL_STATE_TARGET) or \
                (container.image.labels or {}).get(LABEL_STATE_TARGET)
            s = docker_spec(spec, unit_dir=target or spec.unit_dir)
            # The workload directory is the one state path the running container has bound read-write.
            owned.append(Path(s.workload_dir))
            where = Path(s.workload_dir) / ".coldsnap"
            where.mkdir(mode=0o700, exist_ok=True)
            spec_path, ev_path = write_spec(where, s)
            argv = [DOCKER_PYTHON, "-m", "coldsnap_activation", s.operation, "--spec", str(spec_path),
                    "--evidence", str(ev_path)]
            env = {"PYTHONPATH": docker_unit.ACTIVATION_TARGET, "PYTHONDONTWRITEBYTECODE": "1"}
            code, out = container.exec_run(argv, environment=env, user="0", stdout=True, stderr=True)
            results[i] = container_evidence(ev_path, uid, (out or b"").decode("utf-8", "replace"), code)

        try:
            run_concurrently(one, list(enumerate(specs)))
        finally:
            self._hand_back(owned, client)
        raise_failures(results)
        return results

    @contextlib.contextmanager
    def giving_back(self) -> Iterator[None]:
        """Around a lifecycle step: what the module itself wrote in the node payload cache (validation
        records and locks, while the weights were planned), when it runs as another user than ``owner``
        (root, for an unprivileged invoking user), is given to ``owner`` afterwards, also on failure."""
        try:
            yield
        finally:
            if self.owner is not None and os.geteuid() != self.owner.uid and self.layout.payloads.is_dir():
                self._hand_back([self.layout.payloads], self.client, payloads=True)

    def _hand_back(self, paths: list[Path], client: Any, *, payloads: bool = False) -> None:
        """Give ``paths`` to ``owner`` (the node payload cache's with its packs' validation records kept
        valid). When the operation itself failed, a failure here must not replace its error (the
        engine's last log lines are in it): it is added to it."""
        if self.owner is None or not paths:
            return
        failing = sys.exc_info()[1]
        try:
            if payloads:
                normalize_ownership(paths, state_root=self.state_root, owner=self.owner, client=client)
            else:
                chown_state_paths(paths, self.owner.uid, self.owner.gid, client=client)
        except Exception as exc:
            if failing is None:
                raise
            if isinstance(failing, ColdSnapError):
                failing.problem += f" (then giving the state back to the invoking user failed too: {exc})"
                failing.args = (failing.problem if not failing.fix else f"{failing.problem}; {failing.fix}",)

    def presence(self, unit_id: str) -> str:
        c = canonical_container(self.request, unit_id, client=self.client)
        if c is None:
            return "stopped"
        with contextlib.suppress(Exception):
            c.reload()
        return "running" if c.status == "running" else "crashed"

    def units_here(self) -> list[str]:
        """The units whose containers a restore (or a stop) of this workload ends on this host: those the request
        places here, then any other unit of the workload whose canonical container is here (a unit an earlier
        restore placed on this host and this one places elsewhere: ranks swapped between hosts; left running,
        it would serve the replaced generation beside the restored one, out of reach of status and stop)."""
        ids = [u["id"] for u in units_on_host(self.request, self.host)]
        for u in self.request["launch"]["units"]:
            if u["id"] in ids:
                continue
            try:
                if canonical_container(self.request, u["id"], client=self.client) is not None:
                    ids.append(u["id"])
            except AdmissionError:
                # Another workload's container under the same name (canonical names can collide): it is not
                # this workload's, and a unit this request places elsewhere never fails this host's step.
                continue
        return ids

    def evict(self, *, check_mode: bool) -> list[dict]:
        """Remove this workload's canonical unit containers on this host (the engines die with them)."""
        client = self.client
        stopped = []
        for unit_id in self.units_here():
            c = canonical_container(self.request, unit_id, client=client)
            if c is not None:
                stopped.append({"unit": unit_id, "container": c.name, "status": c.status,
                                "image": c.attrs.get("Image")})
            if check_mode:
                continue
            if c is not None:
                c.remove(force=True)
                # Wait until it is gone: its listening ports must be free for the restore.
                deadline = time.monotonic() + 60
                while container_exists(client, c.id):
                    if time.monotonic() > deadline:
                        raise ColdSnapError(f"container {c.name} was removed but is still listed after 60 s",
                                            fix="check dockerd's health")
                    time.sleep(0.05)
            # The engines went with their container (or before, by hand): so do their control files (a pid
            # of the container's namespace, a port and a token of an engine that is gone).
            self.forget_control_files(unit_id)
        return stopped
