"""The peer transfer server: the host that has a payload or a capsule serves exactly those files,
for one transfer, to the host that needs them — so multi-GB files never pass through the
control node (no fetch, no slurp).

* It serves a fixed table of regular files under one root, built when it starts (symlinks
  and anything added later are not served); ``GET /v1/files`` lists names, sizes and (for
  files that are not named by their digest) SHA-256; ``GET /v1/files/<name>`` sends one,
  honouring ``Range: bytes=N-`` so an interrupted transfer resumes.
* Every request is authenticated (:mod:`.auth`); the server binds one address, never all.
* It stops on SIGTERM (:func:`stop_server`), after ``idle_timeout`` seconds without a request
  and after ``lifetime`` seconds in all, so a failed play never leaves it serving.

:func:`start_server` binds in the caller (a taken port or a foreign address fails there,
named), then detaches the server (double fork, new session) and records it in a 0600 run
file; the code it runs is already imported, so it outlives the module that started it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import json
import os
import re
import select
import signal
import socket
import stat
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import (
    atomic_write_bytes,
    file_sha256,
    first_link_below,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.proctree import start_time
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.progress import private_dir
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import StateLayout
from ansible_collections.coldsnap.fleet.plugins.module_utils.transfer import auth

LIST_PATH = "/v1/files"
FILE_PREFIX = "/v1/files/"
DIGEST_NAME = re.compile(r"(?:^|/)(?:sha256/)?([0-9a-f]{64})(?:\.pack)?$")
_RANGE = re.compile(r"bytes=(\d{1,20})-$")  # a resume point: never more digits than a size has
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")


def run_file_for(state_root: Path | str, name: str) -> Path:
    """``<state_root>/runs/transfers/<name>.json``: where the server of transfer ``name`` is recorded."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ColdSnapError(f"transfer name {name!r} is not letters, digits, '.', '_' and '-' (at most 201)",
                            fix="name the transfer after the operation, worker and destination")
    return StateLayout(state_root).runs / "transfers" / f"{name}.json"


def digest_in_name(name: str) -> str | None:
    """The SHA-256 a file's name states (``blobs/sha256/<hex>``, ``<hex>.pack``), if any."""
    m = DIGEST_NAME.search(name)
    return m.group(1) if m else None


@dataclass(frozen=True)
class ServedFile:
    name: str
    path: Path
    size: int
    sha256: str
    ident: tuple[int, int] = (0, 0)  # (st_dev, st_ino) when the table was made: the file served is that one

    def listing(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "sha256": self.sha256}


def file_table(root: Path | str, include: list[str] | None = None) -> dict[str, ServedFile]:
    """The files served from ``root``: ``include`` (names relative to it) or every regular file."""
    root = Path(root)
    if not root.is_dir():
        raise ColdSnapError(f"transfer root {root} is not a directory on this host",
                            fix="give the directory that holds the files to serve")
    names: list[str] = []
    if include:
        for name in include:
            parts = Path(name).parts
            if not name or "\x00" in name or Path(name).is_absolute() or any(p in (".", "..") for p in parts):
                raise ColdSnapError(f"transfer file name {name!r} is not a plain relative path",
                                    fix="name files relative to the transfer root, without '..'")
            names.append(Path(name).as_posix())
    else:
        for dirpath, _dirs, files in os.walk(root):
            for f in files:
                names.append((Path(dirpath) / f).relative_to(root).as_posix())
    table: dict[str, ServedFile] = {}
    for name in sorted(names):
        path = root / name
        linked = first_link_below(root, name)
        if linked is not None:
            if include:
                raise ColdSnapError(f"{path} lies below the symbolic link {linked}; files are served only from "
                                    f"below {root} itself", fix="serve regular files only")
            continue
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise ColdSnapError(f"{path} (to serve as {name!r}) does not exist on this host",
                                fix="the source host does not have it; capture again or restore elsewhere") from None
        if not stat.S_ISREG(st.st_mode):
            if include:
                raise ColdSnapError(f"{path} is not a regular file", fix="serve regular files only")
            continue  # a symlink or special file inside a tree is never served
        # Every file is listed with its digest (the client verifies each on arrival): named by it, or hashed now.
        digest = digest_in_name(name) or file_sha256(path).split(":", 1)[1]
        table[name] = ServedFile(name, path, st.st_size, digest, (st.st_dev, st.st_ino))
    if not table:
        raise ColdSnapError(f"transfer root {root} has no regular file to serve", fix="check the transfer root")
    return table


class PeerServer(ThreadingHTTPServer):
    """Serves one file table to authenticated clients until shut down."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, sock: socket.socket, table: dict[str, ServedFile], token: str, *,
                 log=None) -> None:
        self.table = table
        self.verifier = auth.Verifier(token)
        self.log = log or (lambda _msg: None)
        self.last_activity = time.monotonic()
        self.active = 0
        self.bytes_sent = 0
        self._state_lock = threading.Lock()
        super().__init__(sock.getsockname()[:2], _Handler, bind_and_activate=False)
        self.socket.close()
        self.socket = sock
        self.server_address = sock.getsockname()[:2]

    def touch(self, delta_active: int = 0, sent: int = 0) -> None:
        """An authenticated request began (+1) or ended (-1), or sent bytes: the idle clock starts again.
        Requests that fail authentication never call it, so they cannot keep the server alive."""
        with self._state_lock:
            self.active += delta_active
            self.bytes_sent += sent
            self.last_activity = time.monotonic()

    def idle_for(self) -> float:
        with self._state_lock:
            return 0.0 if self.active else time.monotonic() - self.last_activity


# C0 and C1 control characters as \xHH and a backslash doubled, as http.server's own log escapes them (its
# table is private, and missing from Python releases before the fix for gh-100001).
_CONTROL_CHARS = str.maketrans({**{c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7f, 0xa0))}, "\\": "\\\\"})


class _Handler(BaseHTTPRequestHandler):
    server: PeerServer
    protocol_version = "HTTP/1.1"
    server_version = "coldsnap-transfer/1"
    sys_version = ""
    timeout = 60  # a connection that sends nothing (or stops reading) gives its thread up

    def log_message(self, format: str, *args: Any) -> None:  # pylint: disable=redefined-builtin
        # The request line is the client's, authenticated or not: its control characters are escaped, as
        # http.server's own log does, so nobody who reaches the port writes terminal sequences into the log.
        self.server.log(f"{self.client_address[0]} {(format % args).translate(_CONTROL_CHARS)}")

    def do_GET(self) -> None:  # pylint: disable=invalid-name
        range_header = self.headers.get("Range", "")
        if not self.server.verifier.verify("GET", self.path, range_header, self.headers.get(auth.NONCE_HEADER),
                                           self.headers.get(auth.MAC_HEADER)):
            self._reply(HTTPStatus.FORBIDDEN, b"authentication failed\n")
            return
        self.server.touch(+1)
        try:
            self._get(range_header)
        finally:
            self.server.touch(-1)

    def _get(self, range_header: str) -> None:
        if self.path == LIST_PATH:
            body = json.dumps({"files": [f.listing() for f in self.server.table.values()]}).encode()
            self._reply(HTTPStatus.OK, body, "application/json")
            return
        served = self.server.table.get(unquote(self.path[len(FILE_PREFIX):])) \
            if self.path.startswith(FILE_PREFIX) else None
        if served is None:
            self._reply(HTTPStatus.NOT_FOUND, b"not served\n")
            return
        self._send_file(served, range_header)

    def _send_file(self, served: ServedFile, range_header: str) -> None:
        try:
            fd = os.open(served.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            self._reply(HTTPStatus.GONE, f"cannot open: {exc.strerror}\n".encode())
            return
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            size = st.st_size
            # Another file at that name now (a directory on its path swapped for a link, the file replaced):
            # never served.
            if size != served.size or served.ident not in ((0, 0), (st.st_dev, st.st_ino)):
                self._reply(HTTPStatus.CONFLICT, b"the file changed since the server started\n")
                return
            start = 0
            if range_header:
                m = _RANGE.fullmatch(range_header)
                if not m or int(m.group(1)) >= size:  # nothing at or past the end to send
                    self.send_response(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start = int(m.group(1))
            self.send_response(HTTPStatus.PARTIAL_CONTENT if range_header else HTTPStatus.OK)
            if range_header:
                self.send_header("Content-Range", f"bytes {start}-{max(size - 1, start)}/{size}")
            self.send_header("Content-Length", str(size - start))
            self.send_header("Content-Type", "application/octet-stream")
            self.end_headers()
            self.wfile.flush()
            sent = 0
            while start + sent < size:
                n = self.connection.sendfile(f, start + sent, min(size - start - sent, 64 << 20))
                if not n:
                    break
                sent += n
                self.server.touch(sent=n)

    def _reply(self, status: HTTPStatus, body: bytes, ctype: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def bind(address: str, port: int) -> socket.socket:
    """A listening socket on ``address`` (an IP of this host, or a name that resolves to one)."""
    errors = []
    for family, kind, proto, _name, sockaddr in bind_targets(address, port):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(16)
            return sock
        except OSError as exc:
            sock.close()
            errors.append(f"{sockaddr[0]}:{port}: {exc.strerror}")
    raise ColdSnapError(f"the transfer server cannot listen on {address}:{port} ({'; '.join(errors)})",
                        fix="set coldsnap_transfer_address to an IP address of this host that the destination "
                            "reaches, and coldsnap_transfer_port to a free port (0 picks one)")


def bind_targets(address: str, port: int) -> list[tuple]:
    """Where :func:`bind` would listen (``getaddrinfo``'s answers), checked: a port in 0..65535, an address
    that resolves and is not every interface. Checked before a running server is stopped, and in check mode."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ColdSnapError(f"transfer port {port!r} is not 0..65535", fix="give 0 for an ephemeral port")
    try:
        infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ColdSnapError(f"transfer address {address!r} does not resolve: {exc.strerror}",
                            fix="set coldsnap_transfer_address for this host to one of its IP addresses") from None
    for _family, _kind, _proto, _name, sockaddr in infos:
        ip = ipaddress.ip_address(sockaddr[0].split("%", 1)[0])
        if ip.is_unspecified or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_unspecified):
            raise ColdSnapError(f"transfer address {address!r} means every interface; the transfer server "
                                "listens on one address only",
                                fix="set coldsnap_transfer_address to the IP address of this host that the "
                                    "destination reaches")
    return infos


def serve(server: PeerServer, *, idle_timeout: float, lifetime: float) -> str:
    """Serve until idle, out of time or SIGTERM; returns why it stopped."""
    started = time.monotonic()
    why = ["stopped"]

    def watchdog() -> None:
        while True:
            time.sleep(0.5)
            if server.idle_for() > idle_timeout:
                why[0] = f"idle for {idle_timeout:g} s"
            elif time.monotonic() - started > lifetime:
                why[0] = f"lifetime of {lifetime:g} s over"
            else:
                continue
            server.shutdown()
            return

    def on_term(_signum: int, _frame: object) -> None:
        why[0] = "SIGTERM"
        threading.Thread(target=server.shutdown, daemon=True).start()

    def on_kept(_signum: int, _frame: object) -> None:
        server.touch()  # a start of the same transfer keeps this server: its idle clock starts again

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGUSR1, on_kept)
    threading.Thread(target=watchdog, daemon=True, name="transfer-watchdog").start()
    server.serve_forever(poll_interval=0.2)
    server.server_close()
    return why[0]


# -- the detached server -----------------------------------------------------------------------

def start_server(root: Path | str, *, token: str, address: str, run_file: Path | str, port: int = 0,
                 include: list[str] | None = None, idle_timeout: float = 300.0,
                 lifetime: float = 14400.0, check_mode: bool = False) -> dict[str, Any]:
    """Serve ``root``'s files in a detached process; returns ``{changed, address, port, pid, files, bytes}``.

    A server of this transfer that already serves the same files (same names, sizes, digests and
    inodes) with the same token, address, port and limits is kept (``changed`` False); any other
    one is stopped first."""
    try:
        auth.check_token(token)
    except ValueError as exc:
        raise ColdSnapError(str(exc), fix="pass a random token (the roles generate one per transfer)") from None
    for key, value in (("idle_timeout", idle_timeout), ("lifetime", lifetime)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ColdSnapError(f"{key} {value!r} is not a finite number of seconds > 0",
                                fix=f"give {key} in seconds")
    bind_targets(address, port)  # a refused address or port stops nothing and says so in check mode too
    run_file = Path(run_file)
    table = file_table(root, include)
    info: dict[str, Any] = {"files": len(table), "bytes": sum(f.size for f in table.values())}
    fingerprint = _fingerprint(token, table, root=root, address=address, port=port, idle_timeout=idle_timeout,
                               lifetime=lifetime)
    same = _same_server(run_file, fingerprint, lifetime=lifetime, check_mode=check_mode)
    if same is not None:
        return {**info, "changed": False, "address": same["address"], "port": same["port"], "pid": same["pid"]}
    if check_mode:
        return {**info, "changed": True, "address": address, "port": port, "pid": None}
    # An earlier server of the same transfer (a retried play) never lingers; it is stopped once the new one
    # has its socket, so a port another process holds fails here and the running server keeps serving. Only
    # when that server itself holds the port asked for is it stopped first.
    try:
        sock = bind(address, port)
    except ColdSnapError:
        if not port or not _holds_port(run_file, port):
            raise
        stop_server(run_file)
        sock = bind(address, port)
    else:
        stop_server(run_file)
    bound = sock.getsockname()[:2]
    log_path = run_file.with_suffix(".log")
    private_dir(run_file.parent)
    try:
        # Never through a link: one planted there (a state root its user owns) would have root append to any file.
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        sock.close()
        raise ColdSnapError(f"cannot open the transfer server's log {log_path}: {exc.strerror or exc}",
                            fix=f"remove {log_path} (a symbolic link or a directory is refused); the next run "
                                "makes it") from None
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        _detach(sock, table, token, write_fd=write_fd, read_fd=read_fd, log_fd=log_fd,
                idle_timeout=idle_timeout, lifetime=lifetime)
    os.close(write_fd)
    os.close(log_fd)
    sock.close()
    os.waitpid(pid, 0)
    with os.fdopen(read_fd, "rb") as r:
        ready, _w, _x = select.select([r], [], [], 15)
        line = r.readline() if ready else b""
    try:
        server_pid = int(line)
    except ValueError:
        raise ColdSnapError(f"the transfer server did not start (see {log_path})", fix="read its log") from None
    record = {"pid": server_pid, "start_time": start_time(server_pid), "address": bound[0], "port": bound[1],
              "fingerprint": fingerprint, "started_unix": time.time()}
    atomic_write_bytes(run_file, json.dumps(record).encode(), mode=0o600)
    return {**info, "changed": True, "address": bound[0], "port": bound[1], "pid": server_pid}


def _fingerprint(token: str, table: dict[str, ServedFile], *, root: Path | str, address: str, port: int,
                 idle_timeout: float, lifetime: float) -> str:
    """What a server serves and how, keyed with its token (the run file holds no token, and this
    digest tells nothing about it)."""
    doc = {"root": os.path.realpath(root), "address": address, "port": port, "idle_timeout": idle_timeout,
           "lifetime": lifetime, "files": [[f.name, f.size, f.sha256, *f.ident] for f in table.values()]}
    return hmac.new(token.encode(), json.dumps(doc, sort_keys=True).encode(), hashlib.sha256).hexdigest()


def _same_server(run_file: Path, fingerprint: str, *, lifetime: float, check_mode: bool) -> dict[str, Any] | None:
    """The run file's record when its server still runs, serves exactly ``fingerprint`` and has at
    least half its lifetime left; it is told to start its idle clock again (SIGUSR1), so it does not
    stop by itself right after being handed out (check mode only looks)."""
    live = _running_server(run_file)
    if live is None:
        return None
    try:
        record = json.loads(run_file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not hmac.compare_digest(str(record.get("fingerprint", "")), fingerprint):
        return None
    started = record.get("started_unix")
    if not isinstance(started, (int, float)) or time.time() - started > lifetime / 2:
        return None
    if check_mode:
        return record
    try:
        os.kill(live[0], signal.SIGUSR1)
    except ProcessLookupError:
        return None
    time.sleep(0.3)  # a server that was already stopping (its watchdog decided first) is gone by now
    return record if _running_server(run_file) == live else None


def _detach(sock: socket.socket, table: dict[str, ServedFile], token: str, *, write_fd: int, read_fd: int,
            log_fd: int, idle_timeout: float, lifetime: float) -> None:  # pragma: no cover - child
    code = 1
    try:
        os.close(read_fd)
        os.setsid()
        if os.fork() != 0:
            os._exit(0)
        null = os.open(os.devnull, os.O_RDWR)
        for target, src in ((0, null), (1, log_fd), (2, log_fd)):
            os.dup2(src, target)
        keep = {0, 1, 2, sock.fileno(), write_fd}
        for fd in map(int, os.listdir("/proc/self/fd")):
            if fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
        os.chdir("/")

        def log(msg: str) -> None:
            os.write(2, f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} [{os.getpid()}] {msg}\n".encode(errors="replace"))

        server = PeerServer(sock, table, token, log=log)
        log(f"serving {len(table)} file(s) on {sock.getsockname()[0]}:{sock.getsockname()[1]}")
        os.write(write_fd, f"{os.getpid()}\n".encode())
        os.close(write_fd)
        why = serve(server, idle_timeout=idle_timeout, lifetime=lifetime)
        log(f"stopped ({why}); {server.bytes_sent} bytes sent")
        code = 0
    except BaseException as exc:  # the child must never return into the module
        with contextlib.suppress(Exception):
            os.write(2, f"transfer server failed: {type(exc).__name__}: {exc}\n".encode(errors="replace"))
    finally:
        os._exit(code)


def _running_server(run_file: Path) -> tuple[int, Any] | None:
    """``(pid, start_time)`` of the live server a run file describes; None for none (a recycled
    pid, whose start time differs, is not it)."""
    try:
        record = json.loads(run_file.read_text())
        pid, start = int(record["pid"]), record.get("start_time")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (pid, start) if start is not None and start_time(pid) == start else None


def _holds_port(run_file: Path, port: int) -> bool:
    """Whether the live server a run file describes listens on ``port``."""
    if _running_server(run_file) is None:
        return False
    try:
        return json.loads(run_file.read_text()).get("port") == port
    except (OSError, ValueError, AttributeError):
        return False


def stop_server(run_file: Path | str, *, timeout: float = 10.0, check_mode: bool = False) -> bool:
    """Stop the server a run file describes; True when one was running (in check mode: would stop
    one, and nothing is signalled or removed). Idempotent."""
    run_file = Path(run_file)
    live = _running_server(run_file)
    if check_mode:
        return live is not None
    running = live is not None
    if live is not None:
        pid, start = live
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while start_time(pid) == start and time.monotonic() < deadline:
            time.sleep(0.05)
        if start_time(pid) == start:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        run_file.unlink()
    return running


def file_url_path(name: str) -> str:
    return FILE_PREFIX + quote(name)
