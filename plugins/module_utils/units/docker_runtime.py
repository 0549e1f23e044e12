"""Runtime ``docker``: the same unit flow as runtime ``host``, with each unit inside a rank container.

The activation runtime (rank controller) runs as the container's command, PID 1
of a fresh PID namespace, from the unit's digest-pinned image:

* **capture** starts a rank container from the runtime image (``launch.units[].image``)
  that runs ``coldsnap_activation capture``; it exits after the CRIU dump and
  is removed. ``capsule_build`` then makes the capsule image (runtime image +
  the unit state at its path).
* **restore** starts a *fresh* container from the unit's capsule image under
  the canonical name (``coldsnap-<recipe>-<unit>``) with ColdSnap's labels and
  the workload log path; it runs ``coldsnap_activation restore`` with
  ``supervise``, so the rank controller stays PID 1, reaps the restored engine
  and the container lives exactly as long as the engine. Evict removes that
  container.

Paths are identical inside and outside: every state path is bind-mounted at
its own absolute path (CRIU restores open files by path, so the restored
process keeps its paths), model mounts are read-only at their targets, the
staged activation runtime is read-only at ``/opt/coldsnap/activation``, and the
container uses the host's network (the captured listening ports stay the
host's). Only the rank container is privileged (``docker_unit.privilege_policy``).

PIDs: a capture container raises its namespace's ``ns_last_pid`` before the
rank controller starts, so the engine's pid and thread ids lie above
:data:`PID_FLOOR`; a restore container's own processes (controller, CRIU) stay
far below it, so CRIU can give the restored tree its captured ids.

Ownership: afterwards every state path ColdSnap wrote (the capture directory,
the workload directory, the unit run files, the node payload cache) is given to
the invoking user's uid/gid (:mod:`.ownership`), also when the
run failed. Model packs keep their validation records valid across the chown
(see :func:`normalize_ownership`).

The running containers' steps (lifecycle, presence, evict) are :class:`~.docker_units.DockerUnits`;
this file adds capture, prepare and restore in rank containers behind :class:`~.runtime.UnitRuntime`.
The container primitives are :mod:`.containers` and ownership is :mod:`.ownership`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tarfile
import time
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import archive, dockerapi
from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.build import (
    CapsuleRef,
    inspect_capsule,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    AdmissionError,
    ColdSnapError,
    UnitError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import StateLayout
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import (
    host_tree_exposed,
    units_on_host,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import EVIDENCE_FILE, UnitSpec
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import ports
from ansible_collections.coldsnap.fleet.plugins.module_utils.process.gpu_memory import gpu_memory
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import capture_state
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import containers as docker_unit
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.admission import (
    GpuMoves,
    GpuRoom,
    admit_unit,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.docker_units import (
    DOCKER_PYTHON,
    DockerUnits,
    canonical_container,
    canonical_name,
    container_evidence,
    docker_spec,
    oom_killed,
    write_spec,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.runtime import (
    UnitRuntime,
    listeners_served,
    raise_failures,
    run_concurrently,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.weights import model_dir

# Captured engines get ids above this; a restore container's own processes stay below it.
PID_FLOOR = 10000
EVIDENCE = EVIDENCE_FILE
_CAPTURE_SUFFIX = "-capture"


def capture_container_name(recipe: str, unit_id: str) -> str:
    return docker_unit.canonical_container_name(recipe, unit_id) + _CAPTURE_SUFFIX


# ----------------------------------------------------------------------------- capsule helpers

def capsule_entry(artifact: dict, unit_id: str) -> dict:
    """The artifact's capsule record of ``unit_id`` (a docker capsule)."""
    cap = next(c for c in artifact["capsule"]["units"] if c["unit"] == unit_id)
    if cap["layout"] != "docker":
        raise ColdSnapError(f"unit {unit_id}: the capsule is an {cap['layout']} capsule, runtime docker needs a "
                            "docker image", fix="restore with launch.runtime 'host', or recapture with runtime docker")
    return cap


def capsule_image(artifact: dict, unit_id: str, *, client: Any = None) -> tuple[Any, str]:
    """The local capsule image of ``unit_id`` (verified id and labels) and its state target."""
    client = dockerapi.docker_client(client)
    cap = capsule_entry(artifact, unit_id)
    details = inspect_capsule(CapsuleRef.from_dict(cap), verify=True, client=client)
    target = details.get("state_target") or ""
    if not target.startswith("/"):
        raise ColdSnapError(f"capsule {cap['image_id']} of unit {unit_id} does not record its state path",
                            fix="recapture with this version of ColdSnap")
    return client.images.get(cap["image_id"]), target


def captured_evidence(image_id: str, state_target: str, *, client: Any = None) -> dict:
    """The capture evidence inside a capsule image (read from a created, never started, container)."""
    client = dockerapi.docker_client(client)
    container = docker_unit.create_container(client, image_id, ["true"], network_mode="none",
                                             labels={docker_unit.LABEL_ROLE: "capsule-read"})
    try:
        stream, _stat = container.get_archive(f"{state_target.rstrip('/')}/{EVIDENCE}")
        data = b"".join(stream)
    finally:
        with contextlib.suppress(Exception):
            container.remove(force=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        member = next((m for m in tar.getmembers() if m.isreg()), None)
        if member is None:
            raise ColdSnapError(f"capsule {image_id} holds no capture evidence at {state_target}",
                                fix="recapture; this is not a ColdSnap unit capsule")
        return json.loads(tar.extractfile(member).read())


def verify_image_state(image_id: str, state_target: str, recorded: dict | None, *, unit: str,
                       client: Any = None) -> dict:
    """Hash the capsule image's captured state (streamed out of a created, never started, container)
    against what the capture sealed: every file, before anything is evicted."""
    import hashlib

    client = dockerapi.docker_client(client)
    container = docker_unit.create_container(client, image_id, ["true"], network_mode="none",
                                             labels={docker_unit.LABEL_ROLE: "capsule-verify"})
    members: dict[str, tuple[str, int, str]] = {}
    contents: dict[str, bytes] = {}
    try:
        stream, _stat = container.get_archive(state_target.rstrip("/"))
        top = state_target.rstrip("/").rsplit("/", 1)[-1]
        with tarfile.open(fileobj=archive.ChunkReader(stream), mode="r|") as tar:
            for m in tar:
                if m.name == top or not m.name.startswith(top + "/"):
                    continue
                rel = m.name[len(top) + 1:]
                if m.isdir():
                    continue
                if not m.isreg():
                    members[rel] = ("link" if m.issym() or m.islnk() else "other", 0, "")
                    continue
                h = hashlib.sha256()
                fh = tar.extractfile(m)
                keep = rel in (capture_state.DIGESTS_FILE, EVIDENCE_FILE)
                buf = bytearray()
                while chunk := fh.read(1 << 20):
                    h.update(chunk)
                    if keep:
                        buf += chunk
                members[rel] = ("file", m.size, "sha256:" + h.hexdigest())
                if keep:
                    contents[rel] = bytes(buf)
    finally:
        with contextlib.suppress(Exception):
            container.remove(force=True)
    where = f"capsule image {image_id[:19]}:{state_target}"
    stats = capture_state.verify_members(members, recorded, unit=unit, where=where)
    listed = json.loads(contents[capture_state.DIGESTS_FILE])["files"]
    capture_state.check_listing(members, listed, unit=unit, where=where)
    return stats


def capsule_criu_check(image_id: str, *, client: Any = None) -> dict:
    """Run the capsule's own CRIU (``criu check``) on this host, inside a rank-privileged container."""
    client = dockerapi.docker_client(client)
    policy = docker_unit.privilege_policy(client, probe_image=image_id)
    container = docker_unit.create_container(
        client, image_id, ["sh", "-c", "criu --version; criu check"], network_mode="none",
        labels={docker_unit.LABEL_ROLE: "criu-check"}, **docker_unit.docker_kwargs(policy))
    try:
        container.start()
        code = int(container.wait(timeout=300).get("StatusCode", -1))
        out = container.logs(stdout=True, stderr=True).decode("utf-8", "replace")
    finally:
        with contextlib.suppress(Exception):
            container.remove(force=True)
    version = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Version:")), None)
    return {"installed": version is not None, "version": version, "check": code == 0 and "Looks good" in out,
            "check_output": out[-1000:]}


# ----------------------------------------------------------------------------- mounts

def unit_shm_size(spec: UnitSpec) -> int | None:
    """The /dev/shm of a container whose engine shares memory between its processes (the registry's
    ``private_shm``, archived with the dump there): half the host's memory, as the host launcher's
    tmpfs; Docker's 64 MiB default otherwise."""
    if not spec.launcher.get("shm_archive"):
        return None
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def _covered(path: str, targets: list[str]) -> bool:
    return any(path == t or path.startswith(t.rstrip("/") + "/") for t in targets)


def model_mounts(request: dict, unit: dict) -> list[dict]:
    """The unit's request mounts (model mounts read-only), plus the recovery source when no mount covers it.
    Each source is bound as what it resolves to on this host, which must pass the request's host-tree rule
    too (a link to ``/`` in a model directory would otherwise bind the host's root into the container)."""
    src = model_dir(request)
    out = []
    for m in unit.get("mounts", []):
        holds_model = src is not None and (_covered(src, [m["target"]]) or _covered(m["target"], [src]))
        if holds_model and not m.get("read_only", True):
            raise ColdSnapError(f"unit {unit['id']}: model mount {m['source']} -> {m['target']} is writable",
                                fix="mount model inputs read-only (read_only: true)")
        kind = "model" if m.get("read_only", True) else "other"
        out.append({"source": _resolved_source(m["source"], unit["id"]), "target": m["target"],
                    "read_only": bool(m.get("read_only", True)), "kind": kind})
    if src is not None and not _covered(src, [m["target"] for m in out]) and os.path.isdir(src):
        out.append({"source": _resolved_source(src, unit["id"]), "target": src, "read_only": True, "kind": "model"})
    return out


def _resolved_source(source: str, unit_id: str) -> str:
    real = os.path.realpath(source)
    exposed = host_tree_exposed(real)
    if exposed:
        raise ColdSnapError(f"unit {unit_id}: mount source {source} resolves to {real} on this host, which would "
                            f"give the unit {exposed}",
                            fix="mount the model's own directory (no symbolic link out of it to a system tree)")
    return real


def _state_mount(path: Path, *, read_only: bool = False) -> dict:
    return {"source": str(path), "target": str(path), "read_only": read_only,
            "kind": "other" if read_only else "state"}


def _unit_mounts(request: dict, spec: UnitSpec, *, state_root: Path, activation_digest: str, run_dir: Path,
                 bind_unit_dir: bool) -> list[dict]:
    mounts = [docker_unit.activation_mount(state_root, activation_digest), *model_mounts(request, spec.unit)]
    paths = [Path(spec.workload_dir), StateLayout(state_root).payloads, run_dir]
    if bind_unit_dir:
        paths.insert(0, Path(spec.unit_dir))
    for p in paths:
        p.mkdir(parents=True, exist_ok=True, mode=0o700)
        mounts.append(_state_mount(p))
    endpoint = (spec.coordinator or {}).get("endpoint_file")
    if endpoint:
        if not os.path.exists(endpoint):
            raise ColdSnapError(f"coordinator endpoint {endpoint} is missing", fix="start the coordinator first")
        mounts.append(_state_mount(Path(endpoint), read_only=True))
    return mounts


# ----------------------------------------------------------------------------- running rank containers

def _controller_argv(operation: str, spec_path: Path, ev_path: Path, *, raise_pids: bool) -> list[str]:
    argv = [DOCKER_PYTHON, "-m", "coldsnap_activation", operation, "--spec", str(spec_path),
            "--evidence", str(ev_path)]
    if not raise_pids:
        return argv
    # The controller stays PID 1 (exec); everything it starts, the engine included, gets an id above the floor.
    return ["/bin/sh", "-c", f'echo {PID_FLOOR - 1} > /proc/sys/kernel/ns_last_pid && exec "$@"',
            "coldsnap-rank", *argv]


def _logs(container: Any) -> str:
    try:
        return container.logs(stdout=True, stderr=True).decode("utf-8", "replace")
    except Exception as exc:  # a removed container has no logs; say so instead of failing the report
        return f"(no logs: {exc})"


def _watched(results: list[dict]):
    """A rank container's waiter (``wait(i, spec, container, ev_path)``, run in a thread of its own) whose
    failure is recorded as unit ``i``'s, naming it, instead of ending the thread with nothing recorded (a
    container removed by hand while it ran, dockerd restarted)."""
    def wrap(wait):
        def watched(i: int, spec: UnitSpec, container: Any, ev_path: Path) -> None:
            try:
                wait(i, spec, container, ev_path)
            except Exception as exc:
                name = getattr(container, "name", "?")
                what = ("was removed while it ran" if dockerapi.is_not_found(exc)
                        else f"could not be followed ({type(exc).__name__}: {exc})")
                results[i] = {"ok": False, "unit": spec.unit_id,
                              "error": f"unit {spec.unit_id}: its rank container {name!r} {what}, before it "
                                       f"reported; its output:\n{_logs(container)[-2000:]}"}
        return watched
    return wrap


def _container_pids(container: Any) -> set[int]:
    """Host pids of every process in a running container (its init and all descendants)."""
    try:
        container.reload()
        init = int(container.attrs.get("State", {}).get("Pid") or 0)
    except Exception:  # the container went away: it holds nothing
        return set()
    return ports.process_tree(init) if init > 0 else set()


class DockerRuntime(DockerUnits, UnitRuntime):
    """Units as rank containers (one per unit, PID 1 = the activation runtime): capture, prepare and
    restore (running units' steps are in :class:`~.docker_units.DockerUnits`)."""

    # ------------------------------------------------------------ running units
    def capture(self, specs: list[UnitSpec], *, timeout: float = 3600) -> list[dict]:
        """Capture every spec's unit in its own rank container; return the evidence in order."""
        client, request, run_dir = self.client, self.request, self.run_dir
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        units = {u["id"]: u for u in request["launch"]["units"]}
        started: list[tuple[UnitSpec, Any, Path]] = []
        owned = _owned_paths(request, specs, state_root=self.state_root, run_dir=run_dir, capture=True)
        try:
            for host_spec in specs:
                uid = host_spec.unit_id
                spec = docker_spec(host_spec)
                spec_path, ev_path = write_spec(run_dir, spec)
                mounts = _unit_mounts(request, spec, state_root=self.state_root,
                                      activation_digest=self.activation_digest, run_dir=run_dir, bind_unit_dir=True)
                labels = docker_unit.unit_labels(capture_id=spec.capture_id, unit=uid, operation_id=request["id"],
                                                 recipe=request["workload"]["recipe"],
                                                 log_path=Path(spec.workload_dir) / "target.log",
                                                 extra={"org.coldsnap.phase": "capture"})
                container = docker_unit.run_unit_container(
                    image=units[uid]["image"], name=capture_container_name(request["workload"]["recipe"], uid),
                    command=_controller_argv("capture", spec_path, ev_path, raise_pids=True),
                    mounts=mounts, environment={"PYTHONPATH": docker_unit.ACTIVATION_TARGET, "PYTHONDONTWRITEBYTECODE": "1"}, labels=labels,
                    client=client, replace=True, gpus=[str(d) for d in units[uid].get("devices", [])] or None,
                    shm_size=unit_shm_size(spec))
                started.append((spec, container, ev_path))
            results: list[dict] = [{} for _unit in started]

            @_watched(results)
            def wait(i: int, spec: UnitSpec, container: Any, ev_path: Path) -> None:
                code = None
                try:
                    code = docker_unit.wait_unit(container, timeout=timeout)
                except UnitError:
                    docker_unit.stop_unit(container, timeout=5)
                text = _logs(container)
                (run_dir / f"activation-capture-{spec.unit_id}.log").write_text(text)
                results[i] = container_evidence(ev_path, spec.unit_id, text, code,
                                                oom_killed=code is not None and oom_killed(container))

            run_concurrently(wait, [(i, *x) for i, x in enumerate(started)])
            raise_failures(results)
            return results
        finally:
            for _spec, container, _ev in started:
                docker_unit.remove_unit(container)
            self._hand_back(owned, client, payloads=True)

    def restore(self, artifact: dict, specs: list[UnitSpec], *, timeout: float = 3600) -> list[dict]:
        """Restore every spec's unit in a fresh container from its capsule image, under the canonical name.

        Returns once every unit's rank controller reported (the containers keep
        running their restored engines). A unit that failed leaves no container.
        """
        client, request, run_dir = self.client, self.request, self.run_dir
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        units = {u["id"]: u for u in request["launch"]["units"]}
        started: list[tuple[UnitSpec, Any, Path]] = []
        owned = _owned_paths(request, specs, state_root=self.state_root, run_dir=run_dir, capture=False)
        try:
            for host_spec in specs:
                uid = host_spec.unit_id
                running = canonical_container(request, uid, client=client)
                if running is not None and running.status == "running":
                    # Only the evict step ends what serves (and records it, so a failure can roll back to it).
                    raise UnitError(f"unit {uid}: its container {running.name!r} is running; a restore's activate "
                                    "step does not replace a running unit", fix="run the restore's evict step first "
                                    "(coldsnap.fleet.unit_restore phase=evict), or restore the whole workload")
                image, target = capsule_image(artifact, uid, client=client)
                spec = docker_spec(host_spec, unit_dir=target, supervise=True)
                spec_path, ev_path = write_spec(run_dir, spec)
                mounts = _unit_mounts(request, spec, state_root=self.state_root,
                                      activation_digest=self.activation_digest, run_dir=run_dir, bind_unit_dir=False)
                labels = docker_unit.unit_labels(capture_id=artifact["capture_id"], unit=uid,
                                                 operation_id=request["id"], recipe=request["workload"]["recipe"],
                                                 log_path=Path(spec.workload_dir) / "target.log")
                container = docker_unit.run_unit_container(
                    image=image.id, name=canonical_name(request, uid),
                    command=_controller_argv(spec.operation, spec_path, ev_path, raise_pids=False),
                    mounts=mounts, environment={"PYTHONPATH": docker_unit.ACTIVATION_TARGET, "PYTHONDONTWRITEBYTECODE": "1"}, labels=labels,
                    client=client, replace=True, gpus=[str(d) for d in units[uid].get("devices", [])] or None,
                    shm_size=unit_shm_size(spec))
                started.append((spec, container, ev_path))
            results: list[dict] = [{} for _unit in started]

            @_watched(results)
            def wait(i: int, spec: UnitSpec, container: Any, ev_path: Path) -> None:
                deadline = time.monotonic() + timeout
                code = None
                while not ev_path.exists():
                    container.reload()
                    if container.status in ("exited", "dead"):
                        code = int(container.attrs.get("State", {}).get("ExitCode", -1))
                        # The controller writes evidence before it exits; give a late write a moment.
                        time.sleep(0.2)
                        break
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.02)
                text = _logs(container)
                (run_dir / f"activation-{spec.operation}-{spec.unit_id}.log").write_text(text)
                results[i] = container_evidence(ev_path, spec.unit_id, text, code,
                                                oom_killed=code is not None and oom_killed(container))

            run_concurrently(wait, [(i, *x) for i, x in enumerate(started)])
            raise_failures(results)
            return results
        except BaseException:
            # Never leave a half-restored unit under the canonical name.
            for _spec, container, _ev in started:
                docker_unit.remove_unit(container)
            raise
        finally:
            self._hand_back(owned, client, payloads=True)

    def capture_running(self, specs: list[UnitSpec]) -> list[dict]:
        raise ColdSnapError("target-local overlays are captured from runtime 'host' units only: a docker unit's "
                            "running rank container has no writable capture directory for an in-place dump",
                            fix="restore without -e coldsnap_capture_overlay (the portable artifact is used)")

    # ------------------------------------------------------------------ restore
    def check_environment(self, units: list[dict]) -> None:
        """The unit's userspace is its image (digest-pinned in the request): it must be in the local image
        store, as the one the request pins, before any unit starts (check mode refuses what the run would)."""
        index = {u["id"]: i for i, u in enumerate(self.request["launch"]["units"])}
        for u in units:
            dockerapi.resolve_image(self.client, u["image"],
                                    what=f"launch.units[{index.get(u['id'], '?')}].image (unit {u['id']})")

    def prepare(self, artifact: dict, *, facts: dict, check_mode: bool) -> tuple[list[dict], bool]:
        """Everything a docker restore needs on this host, checked before anything is evicted.

        Per unit: the assigned capsule image is here and is the recorded one; its
        own CRIU passes ``criu check`` on this kernel (admission uses that CRIU,
        not the host's); the captured listening ports are free unless this
        workload's canonical container holds them (it is evicted later); a
        container of that name that ColdSnap does not own stops the restore.
        """
        client = self.client
        plans = []
        moves = GpuMoves(artifact, facts)
        units = units_on_host(self.request, self.host)
        room = GpuRoom(artifact, gpu_memory() if any(u["devices"] for u in units) else None)
        captured_units = {u["id"]: u for u in artifact["launch"]["units"]}
        running_units = {uid: canonical_container(self.request, uid, client=client) for uid in self.units_here()}
        # What the evict step ends: the canonical containers of every unit of this workload here (one unit may be
        # restored onto the port another of them holds now; units_here), as its own check right before the kill
        # counts them.
        evicted: set[int] = set()
        claims: dict = {}
        for running in running_units.values():
            if running is not None and running.status == "running":
                evicted |= _container_pids(running)
        for u in units:
            image, target = capsule_image(artifact, u["id"], client=client)
            captured_root = target.split("/captures/", 1)[0]
            if captured_root != str(self.state_root):
                # The process reopens its files (the workload log among them) at their captured paths.
                raise AdmissionError(f"unit {u['id']} was captured with state root {captured_root}, this host uses "
                                     f"{self.state_root}", fix=f"restore with coldsnap_state_root {captured_root} (the "
                                                               "state root is the same path on every host of a workload)")
            criu = capsule_criu_check(image.id, client=client)
            adm = admit_unit(artifact=artifact, unit_id=u["id"], facts={**facts, "criu": criu}, devices=u["devices"],
                             host=self.host, policy=self.request["policy"].get("compatibility"))
            cap = capsule_entry(artifact, u["id"])
            state = (verify_image_state(image.id, target, cap.get("state"), unit=u["id"], client=client)
                     if not check_mode else None)
            captured = captured_evidence(image.id, target, client=client)
            moves.add(u, captured, captured_units[u["id"]])
            running = running_units.get(u["id"])
            served, what = listeners_served(artifact, self.request, u["id"])
            # Only the canonical containers this restore replaces may hold a captured port. The unit's pid
            # namespace is its container's own: only its ports can be taken.
            ports.require_restorable(captured["workers"], unit=u["id"], served=served, replaced=evicted, what=what,
                                     pids=False)
            # The units share the host's network: no two may come back on one port.
            ports.require_distinct_units(claims, u["id"], [tuple(x) for w in captured["workers"] for x in served(w)],
                                         what="port")
            room.add(u, captured)
            plans.append({"unit": u["id"], "admission": {**adm, "criu": criu["version"]}, "image": image.id,
                          "state_target": target, "container": running.name if running is not None else None,
                          "state": state, "listeners": [list(x) for w in captured["workers"] for x in served(w)]})
        moves.admit(self.host)
        gpu = room.admit(self.host, replaced=evicted)  # nvidia-smi names host pids: the evicted free theirs
        for plan in plans if gpu else []:
            plan["gpu_memory"] = gpu
        return plans, False

    def require_restorable(self, artifact: dict, *, check_mode: bool) -> None:
        """The restore's evict step, right before it removes the canonical containers: prepare's check of the
        ports the units' listeners come back on, again (prepare may have passed minutes ago, and a stranger
        that took one since would make the restore fail after the running containers were removed). Only
        the processes of this workload's running canonical containers on this host may hold them; refused,
        naming the holder and the fix, with nothing evicted. Read-only (a created, never started, container
        reads the capture evidence, as prepare does), check mode included."""
        del check_mode  # the capsule image prepare checked is here in check mode too
        client = self.client
        units = units_on_host(self.request, self.host)
        replaced: set[int] = set()
        for unit_id in self.units_here():
            running = canonical_container(self.request, unit_id, client=client)
            if running is not None and running.status == "running":
                replaced |= _container_pids(running)
        for u in units:
            image, target = capsule_image(artifact, u["id"], client=client)
            captured = captured_evidence(image.id, target, client=client)
            served, what = listeners_served(artifact, self.request, u["id"])
            ports.require_restorable(captured["workers"], unit=u["id"], served=served, replaced=replaced, what=what,
                                     pids=False, at_evict=True)


def _owned_paths(request: dict, specs: list[UnitSpec], *, state_root: Path, run_dir: Path,
                 capture: bool) -> list[Path]:
    """The exact state paths a rank container writes (created now, so they exist with the module's owner)."""
    layout = StateLayout(state_root)
    paths: list[Path] = [run_dir]
    for s in specs:
        wdir = Path(s.workload_dir)
        wdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        paths.append(wdir.parent)  # workloads/<recipe>: the unit directories and the recipe directory itself
        if capture:
            Path(s.unit_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
            paths.append(layout.capture(s.capture_id))
    root = layout.payloads
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    paths.append(root)
    out: list[Path] = []
    for p in paths:
        if p not in out:
            out.append(p)
    return out
