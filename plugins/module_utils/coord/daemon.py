"""Start, inspect and stop one activation's coordinator as a detached background process.

Files beside the endpoint file ``F`` (all private to the invoking user):

* ``F``             the 0600 endpoint descriptor, written by the server once it listens;
* ``F.pid``         the server's pid (0600), written by the server;
* ``F.log``         the server's stderr (never contains the token), kept after stop;
* ``F.lock``        serialises start/stop of the same endpoint file;
* ``.F.code/``      only when this library runs from a zip (AnsiballZ): the few
                    stdlib-only module files the server needs, copied out so
                    the daemon can import them after the module's zip is gone.

The token is generated inside the server process: it never appears on a command
line, in the environment, in a log or in what these functions return.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import file_lock, make_private_dirs
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord import serve as _server
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.client import (
    CoordinatorClient,
    CoordinatorError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.endpoint import (
    EndpointDescriptor,
    check_address,
    check_scope,
    read_endpoint,
    refuse_planted_endpoint,
)

# Imported so that Ansible's module packer ships the server's modules with any
# module that manages the daemon (the packer follows imports).
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.secrets import without_credentials

SERVER_MODULE = _server.__name__
_PACKAGE_PREFIX = "ansible_collections.coldsnap.fleet.plugins.module_utils"
# The server's whole import closure (all stdlib-only); checked by tests/unit/coord/test_daemon.py.
SERVER_CODE_MODULES = (
    "common.errors",
    "common.fsutil",
    "formats.versions",
    "formats.strictjson",
    "coord.protocol",
    "coord.endpoint",
    "coord.client",
    "coord.kv",
    "coord.server",
    "coord.serve",
)
_LOG_TAIL_LINES = 20


@dataclass(frozen=True)
class CoordinatorState:
    """What is known about the coordinator of one endpoint file (never the token)."""

    endpoint_file: str
    running: bool
    healthy: bool = False
    pid: int | None = None
    address: str | None = None
    port: int | None = None
    scope: str | None = None
    changed: bool = False
    message: str = ""
    removed: list[str] = field(default_factory=list)

    def endpoint(self) -> dict[str, Any] | None:
        """``{address, port, scope, endpoint_file}`` when a descriptor is known, else None."""
        if self.port is None:
            return None
        return {"address": self.address, "port": self.port, "scope": self.scope,
                "endpoint_file": self.endpoint_file}

    def as_dict(self) -> dict[str, Any]:
        """The module's return values."""
        return {
            "changed": self.changed,
            "running": self.running,
            "healthy": self.healthy,
            "pid": self.pid,
            "endpoint": self.endpoint(),
            "msg": self.message,
        }


def pid_file_for(endpoint_file: Path | str) -> Path:
    """The pid file beside an endpoint file."""
    p = Path(endpoint_file)
    return p.with_name(p.name + ".pid")


def log_file_for(endpoint_file: Path | str) -> Path:
    """The server log beside an endpoint file."""
    p = Path(endpoint_file)
    return p.with_name(p.name + ".log")


def code_dir_for(endpoint_file: Path | str) -> Path:
    """The private copy of the server's code (zip-packaged library only)."""
    p = Path(endpoint_file)
    return p.with_name(f".{p.name}.code")


def _lock_file_for(endpoint_file: Path) -> Path:
    return endpoint_file.with_name(endpoint_file.name + ".lock")


def endpoint_path(endpoint_file: Path | str) -> Path:
    """The one spelling of an endpoint file: its directory resolved (``..``, symbolic links), so that
    ``/run/x/ep.json`` and ``/var/run/x/ep.json`` name the same coordinator, its pid file and its lock.
    A path that names a directory is refused (the coordinator writes a file there)."""
    path = Path(endpoint_file)
    if path.name in ("", ".", "..") or os.path.isdir(path):
        raise ColdSnapError(f"coordinator endpoint_file {str(endpoint_file)!r} names a directory",
                            fix=f"give a file path in it, e.g. {os.path.join(str(endpoint_file), 'coordinator.json')}")
    refuse_planted_endpoint(path)
    return Path(os.path.realpath(path.parent)) / path.name


# -- status ------------------------------------------------------------------------------------


def coordinator_status(endpoint_file: Path | str, *, health_timeout: float = 2.0) -> CoordinatorState:
    """Is the coordinator of ``endpoint_file`` running (our process, pid alive) and answering health?"""
    endpoint_file = endpoint_path(endpoint_file)
    pid = _read_pid(pid_file_for(endpoint_file))
    alive = pid is not None and _is_our_server(pid, endpoint_file)
    descriptor = _try_read_endpoint(endpoint_file) if alive else None
    healthy = False
    message = "not running"
    if alive and descriptor is None:
        message = f"server pid {pid} runs but its endpoint file is missing or unreadable"
    elif alive and descriptor is not None:
        try:
            CoordinatorClient(descriptor, connect_timeout=health_timeout, io_timeout=health_timeout,
                              connect_retry_s=0).health()
            healthy = True
            message = f"running, pid {pid}, {descriptor}"
        except CoordinatorError as exc:
            message = f"server pid {pid} runs but health failed: {exc.problem}"
    return CoordinatorState(
        endpoint_file=str(endpoint_file),
        running=alive,
        healthy=healthy,
        pid=pid if alive else None,
        address=descriptor.address if descriptor else None,
        port=descriptor.port if descriptor else None,
        scope=descriptor.scope if descriptor else None,
        message=message,
    )


# -- start -------------------------------------------------------------------------------------


def start_coordinator(
    endpoint_file: Path | str,
    *,
    scope: str,
    address: str = _server.DEFAULT_ADDRESS,
    port: int = 0,
    python: str | None = None,
    check_mode: bool = False,
    startup_timeout: float = 15.0,
) -> CoordinatorState:
    """Ensure a coordinator for ``scope`` serves ``endpoint_file``; idempotent.

    Already running for the same scope (and address, and port unless 0) ->
    ``changed`` False. Running for another scope/address/port -> ColdSnapError
    (stop it first). A stale pid/endpoint file (dead or foreign pid) is cleaned
    up. ``python`` (default: this interpreter) runs the server; it must be
    Python >= 3.11.
    """
    endpoint_file = endpoint_path(endpoint_file)
    address = check_address(address)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ColdSnapError(f"coordinator port {port!r} is not 0..65535", fix="give 0 for an ephemeral port")
    check_scope(scope)
    _check_timeout(startup_timeout)
    _check_python(python or sys.executable)  # in check mode too: a real run would fail there
    if check_mode and not endpoint_file.parent.is_dir():
        return CoordinatorState(str(endpoint_file), running=False, changed=True,
                                message=f"would start a coordinator for scope {scope}")
    if not check_mode:
        try:
            make_private_dirs(endpoint_file.parent)
        except OSError as exc:
            raise ColdSnapError(f"cannot create the directory of coordinator endpoint file {endpoint_file}: "
                                f"{exc.strerror or exc}",
                                fix="choose an endpoint_file in a writable directory") from None
    with _lock_unless_check(endpoint_file, check_mode, startup_timeout + 15):
        state = coordinator_status(endpoint_file)
        if state.running:
            return _already_running(state, scope=scope, address=address, port=port)
        _refuse_foreign(endpoint_file)
        stale = _leftovers(endpoint_file)
        if check_mode:
            return CoordinatorState(str(endpoint_file), running=False, changed=True,
                                    message=f"would start a coordinator for scope {scope}", removed=stale)
        _remove(stale)
        _spawn(endpoint_file, scope=scope, address=address, port=port, python=python or sys.executable,
               timeout=startup_timeout)
        state = coordinator_status(endpoint_file)
        if not state.healthy:
            raise ColdSnapError(
                f"coordinator for {endpoint_file} started but is not healthy: {state.message}",
                fix=f"read {log_file_for(endpoint_file)}",
            )
        return dataclasses.replace(state, changed=True, removed=stale, message=f"started, {state.message}")


def _check_timeout(timeout: float) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ColdSnapError(f"coordinator timeout {timeout!r} must be a number of seconds > 0",
                            fix="give timeout in seconds, e.g. 15")


def _lock_unless_check(endpoint_file: Path, check_mode: bool, timeout: float) -> contextlib.AbstractContextManager:
    """The endpoint's lock; check mode only reads, so it takes none (taking one creates its file)."""
    return contextlib.nullcontext() if check_mode else file_lock(_lock_file_for(endpoint_file), timeout=timeout)


def _already_running(state: CoordinatorState, *, scope: str, address: str, port: int) -> CoordinatorState:
    if not state.healthy or state.address is None:
        raise ColdSnapError(
            f"coordinator pid {state.pid} for {state.endpoint_file} is running but unusable: {state.message}",
            fix="stop it (state=stopped) and start it again",
        )
    wanted = (scope, address, port or state.port)
    actual = (state.scope, check_address(state.address), state.port)
    if wanted != actual:
        raise ColdSnapError(
            f"a coordinator already serves {state.endpoint_file} for scope {state.scope!r} on "
            f"{state.address}:{state.port} (pid {state.pid}); asked for scope {scope!r} on {address}:{port}",
            fix="stop the running coordinator first (state=stopped), or use another endpoint_file",
        )
    return dataclasses.replace(state, changed=False, message=f"already {state.message}")


def _check_python(python: str) -> None:
    if not (shutil.which(python) or os.access(python, os.X_OK)):
        raise ColdSnapError(f"python interpreter {python!r} not found or not executable",
                            fix="give the path of a Python >= 3.11 as 'python'")


def _spawn(endpoint_file: Path, *, scope: str, address: str, port: int, python: str, timeout: float) -> None:
    _check_python(python)
    env = without_credentials(os.environ)  # the server needs none of the controller's credentials
    root = _collection_root()
    if root is None:
        root = _materialize_code(code_dir_for(endpoint_file))
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(root), env.get("PYTHONPATH", "")) if x)
    env.pop("PYTHONSTARTUP", None)
    read_fd, write_fd = os.pipe()
    cmd = [
        python, "-m", SERVER_MODULE,
        "--endpoint-file", str(endpoint_file), "--scope", scope,
        "--address", address, "--port", str(port),
        "--pid-file", str(pid_file_for(endpoint_file)),
        "--ready-fd", str(write_fd), "--daemonize",
    ]
    log_path = log_file_for(endpoint_file)
    try:
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        os.close(read_fd)
        os.close(write_fd)
        raise ColdSnapError(f"cannot open the coordinator log {log_path}: {exc.strerror or exc}",
                            fix="move away what is there (a symbolic link or a directory is refused), "
                                "or choose another endpoint_file") from None
    try:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd, pass_fds=(write_fd,),
            start_new_session=True, cwd="/", env=env, close_fds=True,
        )
    except OSError as exc:
        os.close(read_fd)
        raise ColdSnapError(f"cannot run {python}: {exc}", fix="check the 'python' option") from None
    finally:
        os.close(write_fd)
        os.close(log_fd)
    try:
        # The launched process forks the server and exits at once; reap it so it never lingers.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)
        message = _read_ready(read_fd, time.monotonic() + timeout)
    finally:
        os.close(read_fd)
    if message is None or not message.get("ok"):
        # A server that is still starting (a slow host, a short timeout) must not outlive this failure:
        # it is in the session the launcher led, whose id is the launcher's pid.
        late = message is None and _end_session(proc.pid)
        _remove(_leftovers(endpoint_file))
        reason = (message or {}).get("error") or (
            f"it was not ready within {timeout:g}s and was stopped" if late
            else "the server exited before it was ready")
        raise ColdSnapError(
            f"coordinator for {endpoint_file} did not start: {reason}\n{_log_tail(log_path)}",
            fix=f"fix the cause above (see {log_path}) and start it again",
        )


def _end_session(sid: int) -> bool:
    """Kill what is left of the server's session (True when something was there)."""
    try:
        os.killpg(sid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            os.killpg(sid, 0)
        except (ProcessLookupError, PermissionError):
            break
        time.sleep(0.02)
    return True


def _read_ready(fd: int, deadline: float) -> dict | None:
    data = b""
    while b"\n" not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        ready, _writable, _errored = select.select([fd], [], [], remaining)
        if not ready:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    try:
        message = json.loads(data.split(b"\n", 1)[0] or b"null")
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


def _log_tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
    except OSError:
        return ""
    return "last server log lines:\n" + "\n".join(lines) if lines else ""


# -- stop --------------------------------------------------------------------------------------


def stop_coordinator(endpoint_file: Path | str, *, check_mode: bool = False, timeout: float = 10.0) -> CoordinatorState:
    """Stop the coordinator of ``endpoint_file`` (SIGTERM, wait, SIGKILL after ``timeout``) and clean up.

    Idempotent: nothing running and nothing left -> ``changed`` False.
    """
    endpoint_file = endpoint_path(endpoint_file)
    _check_timeout(timeout)
    if not os.path.lexists(pid_file_for(endpoint_file)) and not _leftovers(endpoint_file):
        # Nothing was started there (or all is gone): nothing to stop, and no lock file is made.
        return CoordinatorState(str(endpoint_file), running=False, changed=False, message="not running")
    with _lock_unless_check(endpoint_file, check_mode, timeout + 30):
        state = coordinator_status(endpoint_file)
        leftovers = _leftovers(endpoint_file)
        if not state.running and not leftovers:
            return CoordinatorState(str(endpoint_file), running=False, changed=False, message="not running")
        if check_mode:
            what = f"stop pid {state.pid}" if state.running else "remove stale files"
            return CoordinatorState(str(endpoint_file), running=state.running, pid=state.pid, changed=True,
                                    message=f"would {what}", removed=leftovers)
        message = "removed stale files"
        if state.running and state.pid is not None:
            message = _terminate(state.pid, endpoint_file, timeout)
        leftovers = _leftovers(endpoint_file)
        _remove(leftovers)
        return CoordinatorState(str(endpoint_file), running=False, changed=True, message=message,
                                removed=leftovers)


def _terminate(pid: int, endpoint_file: Path, timeout: float) -> str:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    if _wait_gone(pid, endpoint_file, timeout):
        return f"stopped pid {pid}"
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if _wait_gone(pid, endpoint_file, 5.0):
        return f"killed pid {pid} (it did not stop within {timeout:g}s of SIGTERM)"
    raise ColdSnapError(f"coordinator pid {pid} for {endpoint_file} survived SIGKILL",
                        fix="inspect the process (uninterruptible I/O?) and stop it by hand")


def _wait_gone(pid: int, endpoint_file: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _is_our_server(pid, endpoint_file):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


# -- helpers -----------------------------------------------------------------------------------


def _read_pid(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 1 else None


def _is_our_server(pid: int, endpoint_file: Path) -> bool:
    """True when ``pid`` is alive (not a zombie) and is the server of ``endpoint_file``.

    A stale pid file may name a reused pid of an unrelated process; the command
    line (module name and endpoint path) tells them apart.
    """
    proc = Path("/proc") / str(pid)
    try:
        stat = (proc / "stat").read_text()
        args = (proc / "cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):
        return False
    except PermissionError:
        return False
    state = stat.rsplit(")", 1)[-1].split()[0] if ")" in stat else "?"
    if state in ("Z", "X"):
        return False
    if str(endpoint_file).encode() not in args:
        return False
    # The module's daemon, or `coldsnap coordinator serve` run by hand with --pid-file.
    return SERVER_MODULE.encode() in args or (b"coordinator" in args and b"serve" in args)


def _try_read_endpoint(endpoint_file: Path) -> EndpointDescriptor | None:
    try:
        return read_endpoint(endpoint_file)
    except (ColdSnapError, OSError):
        return None


def _leftovers(endpoint_file: Path) -> list[str]:
    """The files a coordinator of ``endpoint_file`` left behind, each only where it is what a coordinator
    writes there: anything else under those names belongs to someone else and is never removed."""
    return [str(path) for path, ours in _written_files(endpoint_file) if ours(path)]


def _refuse_foreign(endpoint_file: Path) -> None:
    """ColdSnapError when a path a start would write holds something a coordinator did not write."""
    foreign = [str(path) for path, ours in _written_files(endpoint_file) if os.path.lexists(path) and not ours(path)]
    if foreign:
        raise ColdSnapError(
            f"coordinator endpoint {endpoint_file}: {', '.join(foreign)} already exist"
            f"{'s' if len(foreign) == 1 else ''} and {'is' if len(foreign) == 1 else 'are'} not what a "
            "coordinator writes there (its endpoint file, pid file or code directory); nothing was changed",
            fix="choose an endpoint_file of its own (e.g. <dir>/coordinator.json), or move those paths away",
        )


def _written_files(endpoint_file: Path) -> list[tuple[Path, Any]]:
    return [(endpoint_file, _is_endpoint_file), (pid_file_for(endpoint_file), _is_pid_file),
            (code_dir_for(endpoint_file), _is_code_dir)]


def _is_endpoint_file(path: Path) -> bool:
    return _is_regular(path) and _try_read_endpoint(path) is not None


def _is_pid_file(path: Path) -> bool:
    """A pid file, stale or not: a small regular file (a server killed as it wrote it may leave it torn)."""
    return _is_regular(path) and os.lstat(path).st_size <= 32


def _is_code_dir(path: Path) -> bool:
    """The server's private code copy: a real directory holding nothing but ``ansible_collections``."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode) and set(os.listdir(path)) <= {"ansible_collections"}
    except OSError:
        return False


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _remove(paths: list[str]) -> None:
    for path in map(Path, paths):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _collection_root() -> Path | None:
    """The directory holding ``ansible_collections/`` when this library is plain files, else None."""
    here = Path(_server.__file__)
    root = here.parents[6] if len(here.parents) > 6 else None
    if root is None:
        return None
    expected = root / "ansible_collections" / "coldsnap" / "fleet" / "plugins" / "module_utils" / "coord"
    if (expected / "serve.py").is_file() and (expected / "protocol.py").is_file():
        return root
    return None


def _materialize_code(target: Path) -> Path:
    """Copy the server's modules out of a zip (AnsiballZ) into a private directory; return its root."""
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(mode=0o700)
    package_dir = target / Path(*_PACKAGE_PREFIX.split("."))
    for sub in ("", "common", "formats", "coord"):
        (package_dir / sub).mkdir(parents=True, exist_ok=True, mode=0o700)
    # Empty package markers: a regular package here shadows any other
    # ansible_collections on the daemon's path, and imports nothing extra.
    parts = _PACKAGE_PREFIX.split(".")
    for depth in range(1, len(parts) + 1):
        (target / Path(*parts[:depth]) / "__init__.py").write_text("")
    for sub in ("common", "formats", "coord"):
        (package_dir / sub / "__init__.py").write_text("")
    for name in SERVER_CODE_MODULES:
        fullname = f"{_PACKAGE_PREFIX}.{name}"
        spec = importlib.util.find_spec(fullname)
        source = spec.loader.get_source(fullname) if spec and spec.loader else None  # type: ignore[union-attr]
        if source is None:
            raise ColdSnapError(f"cannot read the source of {fullname} to start the coordinator",
                                fix="install the collection as files (ansible-galaxy collection install)")
        (package_dir / Path(*name.split("."))).with_suffix(".py").write_text(source)
    return target
