"""Docker launch-unit primitives: the rank container, its privilege, its lifecycle, state ownership.

Privilege is policy, kept as data: a rank container (CRIU, PID-tree inspection,
CUDA checkpoint, namespace construction) gets full ``--privileged`` where the
host allows it. Some hosts do not: a VM whose capability bounding set lacks a
capability makes ``--privileged`` fail with "unable to apply caps". There the
rank container gets every capability the host has (``cap_add ALL`` minus the
missing ones) with seccomp, AppArmor and the masked /proc paths unconfined,
which is what CRIU needs. The answer is probed once per daemon and boot, with a
trivial container, and cached. Only the rank container is privileged; helpers
(the ownership sidecar) run with the few capabilities they need and no network.

After a run, every state path ColdSnap wrote is given back to the invoking
user's uid/gid (never left to root), without changing mode bits: in-process
when this process is root, else by a short-lived, network-isolated helper
container that binds exactly those paths and nothing else.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import dockerapi
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError, UnitError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import atomic_write_json
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import identifiers as ids
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.capsule_labels import (
    LABEL_CAPTURE,
    LABEL_UNIT,
)

ACTIVATION_TARGET = "/opt/coldsnap/activation"
LABEL_ROLE = "org.coldsnap.role"
LABEL_OPERATION = "org.coldsnap.operation-id"
LABEL_RECIPE = "org.coldsnap.recipe"
LABEL_LOG_PATH = "org.coldsnap.log-path"
LABEL_RUNTIME_KIND = "org.coldsnap.kind"
MOUNT_KINDS = ("model", "activation", "state", "cache", "other")
READ_ONLY_KINDS = ("model", "activation")
UNCONFINED = ("seccomp=unconfined", "apparmor=unconfined", "systempaths=unconfined")
OWNERSHIP_HELPER_CAPS = ("CHOWN", "FOWNER", "FSETID", "DAC_OVERRIDE", "DAC_READ_SEARCH")

# Linux capability numbers (include/uapi/linux/capability.h), as Docker names them.
CAP_NAMES = (
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "SETPCAP",
    "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW", "IPC_LOCK", "IPC_OWNER",
    "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE",
    "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP",
    "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG", "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF",
    "CHECKPOINT_RESTORE",
)

_POLICY_MEMO: dict[str, dict[str, Any]] = {}


# ----------------------------------------------------------------------------- privilege policy

def bounding_capabilities(status_path: str = "/proc/self/status") -> set[str]:
    """The capabilities in this host's bounding set (the most any container here can get)."""
    with open(status_path) as fh:
        for line in fh:
            if line.startswith("CapBnd:"):
                mask = int(line.split()[1], 16)
                return {name for bit, name in enumerate(CAP_NAMES) if mask >> bit & 1}
    raise ColdSnapError(f"{status_path} has no CapBnd line", fix="run on Linux with /proc mounted")


def capability_policy(status_path: str = "/proc/self/status") -> dict[str, Any]:
    """The rank container's privilege where ``--privileged`` cannot be applied: every capability the host has."""
    missing = sorted(set(CAP_NAMES) - bounding_capabilities(status_path))
    return {"mode": "capabilities", "privileged": False, "cap_add": ["ALL"], "cap_drop": missing,
            "security_opt": list(UNCONFINED)}


def privileged_policy() -> dict[str, Any]:
    return {"mode": "privileged", "privileged": True, "cap_add": [], "cap_drop": [], "security_opt": []}


def docker_kwargs(policy: dict[str, Any]) -> dict[str, Any]:
    """The host-config keyword arguments a policy stands for.

    ``systempaths=unconfined`` is a docker CLI option, not an API one: the CLI
    turns it into empty MaskedPaths/ReadonlyPaths, and so does
    :func:`create_container` when it sees ``unmask_system_paths``.
    """
    out: dict[str, Any] = {"privileged": bool(policy.get("privileged"))}
    for key in ("cap_add", "cap_drop"):
        if policy.get(key):
            out[key] = list(policy[key])
    opts = [o for o in policy.get("security_opt") or [] if o != "systempaths=unconfined"]
    if opts:
        out["security_opt"] = opts
    if "systempaths=unconfined" in (policy.get("security_opt") or []):
        out["unmask_system_paths"] = True
    return out


def create_container(client: Any, image_id: str, command: list[str] | None, *, name: str | None = None,
                     environment: dict[str, str] | None = None, labels: dict[str, str] | None = None,
                     entrypoint: list[str] | None = None, working_dir: str | None = None, user: str | None = None,
                     unmask_system_paths: bool = False, **host: Any) -> Any:
    """Create (not start) a container through the low-level API; ``host`` are HostConfig keyword arguments."""
    api = client.api
    host_config = api.create_host_config(**host)
    if unmask_system_paths:
        # What `--security-opt systempaths=unconfined` does: no masked or read-only /proc and /sys paths.
        host_config["MaskedPaths"] = []
        host_config["ReadonlyPaths"] = []
    resp = api.create_container(image=image_id, command=command, name=name, environment=environment or None,
                                labels=labels or None, entrypoint=entrypoint, working_dir=working_dir, user=user,
                                host_config=host_config, detach=True)
    return client.containers.get(resp["Id"])


def cache_dir() -> Path:
    """Where ColdSnap caches host facts (COLDSNAP_CACHE_DIR, else /var/cache/coldsnap or ~/.cache/coldsnap)."""
    env = os.environ.get("COLDSNAP_CACHE_DIR")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/cache/coldsnap")
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "coldsnap"


def _policy_key(client: Any) -> str:
    info = client.info()
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown"
    return f"{info.get('ID')}|{info.get('ServerVersion')}|{os.uname().release}|{boot}"


def runtime_images(client: Any) -> list[Any]:
    """Local ColdSnap runtime images, newest first."""
    images = client.images.list(filters={"label": f"{LABEL_RUNTIME_KIND}=runtime"})
    return sorted(images, key=lambda i: i.attrs.get("Created", ""), reverse=True)


def _default_probe_image(client: Any) -> str:
    images = runtime_images(client)
    if not images:
        raise ColdSnapError("no ColdSnap runtime image is present to probe container privilege with",
                            fix="build it with runtime_image/build.py or pass probe_image=")
    return images[0].id


def _probe(client: Any, image: str, kwargs: dict[str, Any]) -> str | None:
    """Run ``true`` in a throw-away container with ``kwargs``; None when it worked, else the error."""
    docker = dockerapi.docker_module()
    container = None
    try:
        container = create_container(client, image, ["true"], labels={LABEL_ROLE: "privilege-probe"},
                                     network_mode="none", **kwargs)
        container.start()
        code = container.wait(timeout=60).get("StatusCode", 1)
        return None if code == 0 else f"probe exited {code}"
    except docker.errors.APIError as exc:
        return str(exc.explanation or exc)
    finally:
        if container is not None:
            try:
                container.remove(force=True)
            except docker.errors.APIError:
                pass


def privilege_policy(client: Any = None, *, probe_image: str | None = None, refresh: bool = False) -> dict[str, Any]:
    """The rank container's privilege on this daemon: full ``--privileged`` if the host allows it, else the
    capability set (see module doc). Probed once per daemon and boot; cached in memory and on disk.

    Returns ``{mode, privileged, cap_add, cap_drop, security_opt, reason}``.
    """
    client = dockerapi.docker_client(client)
    key = _policy_key(client)
    if not refresh and key in _POLICY_MEMO:
        return dict(_POLICY_MEMO[key])
    cache_file = cache_dir() / "docker-privilege.json"
    if not refresh:
        try:
            cached = json.loads(cache_file.read_text())
            if cached.get("key") == key and isinstance(cached.get("policy"), dict):
                _POLICY_MEMO[key] = cached["policy"]
                return dict(cached["policy"])
        except (OSError, ValueError):
            pass
    image = probe_image or _default_probe_image(client)
    if probe_image:
        image = dockerapi.resolve_image(client, probe_image, what="privilege probe image").id
    error = _probe(client, image, {"privileged": True})
    if error is None:
        policy = {**privileged_policy(), "reason": "a privileged probe container ran on this host"}
    else:
        policy = {**capability_policy(), "reason": f"--privileged is refused here ({error.strip()[:200]})"}
        second = _probe(client, image, docker_kwargs(policy))
        if second is not None:
            raise ColdSnapError(f"this Docker host runs neither privileged containers ({error.strip()[:200]}) nor "
                                f"the capability set {policy['cap_drop']} dropped ({second.strip()[:200]})",
                                fix="CRIU needs a privileged container; check dockerd's security settings")
    _POLICY_MEMO[key] = policy
    try:
        atomic_write_json(cache_file, {"key": key, "policy": policy, "probed_at": int(time.time())}, mode=0o644)
    except OSError:
        pass  # an unwritable cache only costs a probe next time
    return dict(policy)


# ----------------------------------------------------------------------------- names, labels, mounts

def canonical_container_name(recipe: str, unit: str) -> str:
    """``coldsnap-<recipe>-<unit>``, in Docker's container-name alphabet."""
    raw = f"coldsnap-{recipe}-{unit}"
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", raw).strip(".-")
    return name[:200]


def unit_labels(*, capture_id: str, unit: str, operation_id: str, recipe: str, role: str = "rank",
                log_path: str | Path | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The labels every ColdSnap unit container carries."""
    labels = {LABEL_CAPTURE: capture_id, LABEL_UNIT: unit, LABEL_OPERATION: operation_id, LABEL_RECIPE: recipe,
              LABEL_ROLE: role}
    if log_path is not None:
        labels[LABEL_LOG_PATH] = str(log_path)
    labels.update(extra or {})
    return labels


def activation_mount(state_root: str | Path, digest: str) -> dict[str, Any]:
    """The read-only bind of the staged, content-addressed activation runtime."""
    hexpart = ids.parse_digest(digest, what="activation runtime digest")
    return {"source": str(Path(state_root) / "activation-runtime" / "sha256" / hexpart), "target": ACTIVATION_TARGET,
            "read_only": True, "kind": "activation"}


def docker_mounts(mounts: Iterable[dict[str, Any]]) -> list[Any]:
    """Validate mount dicts (``source``, ``target``, ``read_only``, ``kind``) into Docker bind mounts."""
    docker = dockerapi.docker_module()
    out = []
    targets: set[str] = set()
    for i, m in enumerate(mounts):
        source, target = m.get("source"), m.get("target")
        kind = m.get("kind", "other")
        if kind not in MOUNT_KINDS:
            raise ColdSnapError(f"mount {i} has unknown kind {kind!r}", fix=f"use one of {', '.join(MOUNT_KINDS)}")
        if not (isinstance(source, str) and source.startswith("/") and isinstance(target, str)
                and target.startswith("/")):
            raise ColdSnapError(f"mount {i} ({source!r} -> {target!r}) needs absolute source and target paths",
                                fix="give absolute host and container paths")
        read_only = m.get("read_only", kind in READ_ONLY_KINDS)
        if kind in READ_ONLY_KINDS and not read_only:
            raise ColdSnapError(f"{kind} mount {source} -> {target} must be read-only",
                                fix="model mounts and the activation runtime are always mounted read-only")
        if target in targets:
            raise ColdSnapError(f"mount target {target} appears twice", fix="mount each target once")
        targets.add(target)
        if not os.path.exists(source):
            raise ColdSnapError(f"mount source {source} (for {target}) does not exist on this host",
                                fix="stage it first (model snapshot, activation runtime or state directory)")
        out.append(docker.types.Mount(target=target, source=source, type="bind", read_only=bool(read_only)))
    return out


# ----------------------------------------------------------------------------- lifecycle

def run_unit_container(*, image: str, name: str, command: list[str], mounts: list[dict[str, Any]],
                       environment: dict[str, str], labels: dict[str, str], privileged_rank: bool = True,
                       network: str = "host", detach: bool = True, log_path: Path | None = None,
                       client: Any = None, replace: bool = False, gpus: list[str] | str | None = None,
                       init: bool | None = None, shm_size: str | None = None, ipc_mode: str | None = None,
                       working_dir: str | None = None, entrypoint: list[str] | None = None,
                       privilege: dict[str, Any] | None = None) -> Any:
    """Start a launch unit's container from an immutable image reference; return the container.

    ``privileged_rank`` gives it the host's rank privilege policy
    (:func:`privilege_policy`); ``gpus`` ('all' or device ids) requests NVIDIA
    devices. With ``detach=False`` the call waits for the exit and, when
    ``log_path`` is given, saves the logs there. A container of the same name
    is an error unless ``replace`` (it must then be a ColdSnap container).
    """
    docker = dockerapi.docker_module()
    client = dockerapi.docker_client(client)
    img = dockerapi.resolve_image(client, image, what=f"image of unit container {name!r}")
    if not isinstance(command, list) or not all(isinstance(c, str) for c in command):
        raise ColdSnapError(f"command of unit container {name!r} must be a list of strings", fix="pass argv")
    env = {str(k): str(v) for k, v in (environment or {}).items()}
    all_labels = dict(labels)
    all_labels.setdefault(LABEL_ROLE, "rank" if privileged_rank else "unit")
    if log_path is not None:
        all_labels[LABEL_LOG_PATH] = str(log_path)
    kwargs: dict[str, Any] = {"network_mode": network, "environment": env, "labels": all_labels,
                              "mounts": docker_mounts(mounts), "name": name}
    if privileged_rank:
        policy = privilege or privilege_policy(client, probe_image=img.id)
        kwargs.update(docker_kwargs(policy))
    if gpus:
        if gpus == "all":
            request = docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])
        else:
            request = docker.types.DeviceRequest(device_ids=[str(g) for g in gpus], capabilities=[["gpu"]])
        kwargs["device_requests"] = [request]
    for key, value in (("init", init), ("shm_size", shm_size), ("ipc_mode", ipc_mode),
                       ("working_dir", working_dir), ("entrypoint", entrypoint)):
        if value is not None:
            kwargs[key] = value
    _clear_name(client, name, replace, all_labels)
    container = None
    try:
        container = create_container(client, img.id, command, **kwargs)
        container.start()
    except docker.errors.APIError as exc:
        # A container that was created but could not start must not linger under the canonical name. Only
        # that one goes: a container that took the name meanwhile (the create's conflict) is not ColdSnap's.
        if container is not None:
            try:
                container.remove(force=True)
            except docker.errors.APIError:
                pass
        raise UnitError(f"unit container {name!r} did not start: {exc.explanation or exc}",
                        fix="check the image, mounts and the privilege policy") from exc
    if not detach:
        wait_unit(container)
        if log_path is not None:
            save_unit_logs(container, Path(log_path))
    return container


def _clear_name(client: Any, name: str, replace: bool, labels: dict[str, str]) -> None:
    docker = dockerapi.docker_module()
    try:
        old = client.containers.get(name)
    except docker.errors.NotFound:
        return
    if not replace:
        raise UnitError(f"a container named {name!r} already exists ({old.status})",
                        fix="stop and remove it first, or pass replace=True")
    foreign = foreign_container(old, recipe=labels.get(LABEL_RECIPE), unit=labels.get(LABEL_UNIT))
    if foreign:
        raise UnitError(foreign, fix=FOREIGN_FIX)
    old.remove(force=True)


FOREIGN_FIX = ("rename or remove it by hand; ColdSnap only replaces its own containers (two workloads whose "
               "coldsnap-<recipe>-<unit> names collide need a different recipe or unit id)")


def foreign_container(container: Any, *, recipe: str | None, unit: str | None) -> str | None:
    """Why ``container`` is not the ColdSnap container of ``recipe``/``unit`` (None when it is).

    Its labels must say so: an image's labels alone (a capsule's) do not make a
    container ColdSnap's, and canonical names are not injective ("a-b"/"c" and
    "a"/"b-c" share one), so the recipe and unit labels must both match.
    """
    labels = container.labels or {}
    name = getattr(container, "name", "?")
    if LABEL_UNIT not in labels or LABEL_RECIPE not in labels:
        return f"a container named {name!r} exists and is not a ColdSnap unit container"
    # A container's labels include its image's: one run by hand from a capsule image carries the capsule's
    # recipe, unit and capture operation. ColdSnap sets a role on every container it starts; no image has one.
    inherited = _image_labels(container)
    if LABEL_ROLE not in labels or inherited.get(LABEL_ROLE) == labels[LABEL_ROLE]:
        return (f"a container named {name!r} exists and was not started by ColdSnap (its recipe and unit labels "
                "come from its image)")
    for key, want, what in ((LABEL_RECIPE, recipe, "recipe"), (LABEL_UNIT, unit, "unit")):
        if want is not None and labels.get(key) != want:
            return (f"container {name!r} belongs to recipe {labels.get(LABEL_RECIPE)!r} unit "
                    f"{labels.get(LABEL_UNIT)!r}, not to this workload's {what} {want!r}")
    return None


def _image_labels(container: Any) -> dict[str, str]:
    try:
        return dict(container.image.labels or {})
    except Exception:  # the image is gone (removed under a running container): nothing is inherited
        return {}


def wait_unit(container: Any, timeout: float | None = None) -> int:
    """Wait for the container to exit; return its exit code (UnitError on timeout)."""
    try:
        result = container.wait(timeout=timeout) if timeout is not None else container.wait()
    except Exception as exc:
        if "timed out" in str(exc).lower() or exc.__class__.__name__ in ("ReadTimeout", "ConnectionError"):
            raise UnitError(f"unit container {container.name!r} did not exit within {timeout}s",
                            fix="stop it (stop_unit) or raise the timeout") from exc
        raise
    return int(result.get("StatusCode", -1))


def stop_unit(container: Any, timeout: int = 10) -> None:
    """Stop (SIGTERM, then SIGKILL after ``timeout`` s); a gone container is fine."""
    docker = dockerapi.docker_module()
    try:
        container.stop(timeout=timeout)
    except docker.errors.NotFound:
        pass


def remove_unit(container: Any, *, force: bool = True) -> None:
    """Remove the container; a gone container is fine."""
    docker = dockerapi.docker_module()
    try:
        container.remove(force=force)
    except docker.errors.NotFound:
        pass


def unit_logs(container: Any, tail: int | None = None) -> str:
    """stdout+stderr of the container (the last ``tail`` lines when given)."""
    data = container.logs(stdout=True, stderr=True, tail=tail if tail is not None else "all")
    return data.decode("utf-8", "replace")


def save_unit_logs(container: Any, log_path: Path) -> Path:
    """Write the container's logs to ``log_path`` (atomically) and return it."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import atomic_write_bytes

    atomic_write_bytes(Path(log_path), container.logs(stdout=True, stderr=True), mode=0o644)
    return Path(log_path)


def find_units(client: Any = None, **labels: str) -> list[Any]:
    """ColdSnap containers (running or not) whose labels match, e.g. ``find_units(**{LABEL_UNIT: 'unit-0'})``."""
    client = dockerapi.docker_client(client)
    filters = [f"{k}={v}" for k, v in labels.items()] or [LABEL_UNIT]
    return client.containers.list(all=True, filters={"label": filters})


def exec_in(container: Any, argv: list[str], *, user: str = "0") -> tuple[int, str]:
    """Run a command inside a running unit container; (exit code, combined output)."""
    code, out = container.exec_run(argv, user=user, stdout=True, stderr=True, demux=False)
    return int(code), (out or b"").decode("utf-8", "replace")
