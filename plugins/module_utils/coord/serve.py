"""The coordinator as a process: serve one activation until SIGTERM/SIGINT.

``python -m ansible_collections.coldsnap.fleet.plugins.module_utils.coord.serve
--endpoint-file F --scope S [--address A] [--port P]`` is what :mod:`.daemon` starts;
``coldsnap coordinator serve`` runs the same code in the foreground
(:func:`add_serve_arguments` and :func:`run_server_process` are shared).
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import atomic_write_bytes
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.client import (
    CoordinatorClient,
    CoordinatorError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.endpoint import (
    EndpointDescriptor,
    new_token,
    read_endpoint,
    write_endpoint,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.server import (
    DEFAULT_ADDRESS,
    CoordinatorServer,
    ServerLimits,
)


def _stderr_log(msg: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    sys.stderr.write(f"{stamp} [{os.getpid()}] {msg}\n")
    sys.stderr.flush()


def run_server_process(
    endpoint_file: Path,
    *,
    scope: str,
    address: str = DEFAULT_ADDRESS,
    port: int = 0,
    pid_file: Path | None = None,
    limits: ServerLimits | None = None,
    on_ready: Callable[[EndpointDescriptor], None] | None = None,
    log: Callable[[str], None] = _stderr_log,
) -> int:
    """Serve one activation in this process until SIGTERM/SIGINT; returns an exit code.

    Binds, writes the 0600 endpoint descriptor with a fresh token (and the pid
    file), calls ``on_ready`` with the descriptor, serves, and on a graceful stop
    removes both files when they still describe this process.
    """
    endpoint_file = Path(endpoint_file).absolute()
    _refuse_live_endpoint(endpoint_file)
    token = new_token()
    server = CoordinatorServer(token, address=address, port=port, limits=limits, log=log)
    descriptor = EndpointDescriptor(address=server.address, port=server.port, scope=scope, token=token)
    write_endpoint(endpoint_file, descriptor)
    if pid_file is not None:
        atomic_write_bytes(Path(pid_file), f"{os.getpid()}\n".encode(), mode=0o600)

    def _stop(signum: int, _frame: object) -> None:
        server.shutdown(wait=False)

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    # The C-level handler also writes a byte to the loop's wake-up socket, so a signal that reaches
    # the process while the loop sleeps in epoll_wait wakes it even before the Python handler runs.
    old_wakeup = signal.set_wakeup_fd(server.wakeup_fileno(), warn_on_full_buffer=False)
    log(f"coordinator listening on {server.address}:{server.port} for scope {scope} "
        f"(slots {server.max_connections}, endpoint {endpoint_file})")
    try:
        if on_ready is not None:
            on_ready(descriptor)
        server.serve_forever()
    finally:
        signal.set_wakeup_fd(old_wakeup)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _remove_own_files(endpoint_file, token, pid_file)
        log("coordinator stopped")
    return 0


def _refuse_live_endpoint(endpoint_file: Path) -> None:
    """A descriptor whose coordinator answers is another activation's: replacing it (and removing it on
    exit) would cut that activation off its coordinator. A stale one (nobody answers) is replaced."""
    try:
        live = read_endpoint(endpoint_file)
    except (OSError, ColdSnapError):
        return
    try:
        CoordinatorClient(live, connect_timeout=2.0, io_timeout=2.0, connect_retry_s=0).health()
    except CoordinatorError:
        return
    raise ColdSnapError(f"a coordinator already serves {endpoint_file} (scope {live.scope!r} on "
                        f"{live.address}:{live.port})",
                        fix="stop it first (coldsnap coordinator stop, or the coordinator module with "
                            "state=stopped), or give another --endpoint-file")


def _remove_own_files(endpoint_file: Path, token: str, pid_file: Path | None) -> None:
    """Remove the descriptor and pid file only if they are still ours (not a successor's)."""
    with contextlib.suppress(OSError, ColdSnapError):
        if hmac.compare_digest(read_endpoint(endpoint_file).token, token):
            endpoint_file.unlink()
    if pid_file is not None:
        with contextlib.suppress(OSError, ValueError):
            if int(Path(pid_file).read_text().strip()) == os.getpid():
                Path(pid_file).unlink()


def _daemonize() -> None:
    """Fork once more so the server is not the starter's child (it cannot turn zombie there)."""
    if os.fork() > 0:
        os._exit(0)
    os.chdir("/")


def _ready_writer(fd: int | None) -> Callable[[dict], None]:
    def write(message: dict) -> None:
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.write(fd, (json.dumps(message) + "\n").encode())
            os.close(fd)

    return write


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a serving coordinator (the daemon's and ``coldsnap coordinator serve``'s)."""
    parser.add_argument("--endpoint-file", required=True, type=Path, help="where to write the 0600 descriptor")
    parser.add_argument("--scope", required=True, help="operation id of the activation")
    parser.add_argument("--address", default=DEFAULT_ADDRESS,
                        help="IP address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=0, help="TCP port (default 0: an ephemeral port)")
    parser.add_argument("--pid-file", type=Path, help="write this process's pid here (0600)")
    parser.add_argument("--max-connections", type=int, default=ServerLimits.max_connections)
    parser.add_argument("--read-timeout", type=float, default=ServerLimits.read_timeout,
                        help="seconds a client has to send its whole request")
    parser.add_argument("--max-store-bytes", type=int, default=ServerLimits.max_store_bytes)
    parser.add_argument("--idle-timeout", type=float, default=ServerLimits.idle_timeout,
                        help="exit after this many seconds without any client (0: never)")


def limits_from(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(max_connections=args.max_connections, read_timeout=args.read_timeout,
                        max_store_bytes=args.max_store_bytes, idle_timeout=args.idle_timeout)


def main(argv: list[str] | None = None) -> int:
    """``python -m ...coord.serve``: serve one activation (the daemon the module starts)."""
    parser = argparse.ArgumentParser(prog="coldsnap-coordinator", description=__doc__.splitlines()[0])
    add_serve_arguments(parser)
    parser.add_argument("--ready-fd", type=int, help="write one JSON status line here once listening")
    parser.add_argument("--daemonize", action="store_true", help="fork into the background first")
    args = parser.parse_args(argv)
    os.umask(0o077)
    if args.daemonize:
        _daemonize()
    ready = _ready_writer(args.ready_fd)
    try:
        limits = limits_from(args)
        return run_server_process(
            args.endpoint_file,
            scope=args.scope,
            address=args.address,
            port=args.port,
            pid_file=args.pid_file,
            limits=limits,
            on_ready=lambda d: ready({"ok": True, "pid": os.getpid(), **d.public()}),
        )
    except ColdSnapError as exc:
        ready({"ok": False, "error": str(exc)})
        _stderr_log(f"coordinator failed to start: {exc}")
        return 2
    except OSError as exc:
        ready({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        _stderr_log(f"coordinator failed: {exc}")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
