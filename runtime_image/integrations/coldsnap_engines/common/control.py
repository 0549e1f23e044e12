"""The loopback server of the engine control API, served inside every engine process.

The contract (routes, states, bodies, control file, environment names) is
``formats.engine_control``; the client is ``process.engine_client``. This
module only serves it over a :class:`~coldsnap_engines.common.lifecycle.Lifecycle`.

Authentication: the bearer token is checked against the 0600 control file on
every request, not against a value kept in memory. A restored engine's memory
(and so the capsule) holds the token of its capture; the activation runtime
writes a fresh token into the control file before the restore, which makes the
captured one worthless.
"""

from __future__ import annotations

import errno
import hmac
import json
import os
import secrets
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.listen_ports import restorable_ports
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import engine_control as ec

from coldsnap_engines.common.lifecycle import EngineStateError, Lifecycle

# Kept for integrations that name the environment variable (vLLM/SGLang plugins).
CONTROL_ENV = ec.ENV_CONTROL_FILE


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64


def _listen(handler) -> _Server:
    """The control listener, on a port outside the ephemeral range: a restore binds it again, and an
    ephemeral port may meanwhile be the local port of any outgoing connection on the host."""
    for port in restorable_ports():
        try:
            return _Server((ec.CONTROL_HOST, port), handler)
        except OSError as exc:
            if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                raise
    return _Server((ec.CONTROL_HOST, 0), handler)


def _reply(handler: BaseHTTPRequestHandler, code: int, obj: dict) -> None:
    # The engine's own monotonic clock: a CRIU-restored process runs in a time namespace whose
    # clock is offset from its host's, so the activation runtime aligns engine spans with this.
    body = json.dumps({**obj, "monotonic_ns": time.monotonic_ns()}, default=str).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.send_header("Connection", "close")
    handler.end_headers()
    handler.wfile.write(body)


# A client that sends nothing (an idle or half-open connection) frees its handler thread after this;
# a streaming client that stops reading frees it (and the generation it holds) too.
HANDLER_TIMEOUT = 60


def read_json_body(handler: BaseHTTPRequestHandler, limit: int = ec.MAX_BODY) -> dict:
    """The request's JSON object body, at most ``limit`` bytes; ValueError for anything else (a
    negative or non-numeric Content-Length never turns into a read until the client hangs up)."""
    raw_length = handler.headers.get("Content-Length")
    try:
        length = int(raw_length) if raw_length is not None else 0
    except ValueError:
        raise ValueError(f"Content-Length {raw_length[:20]!r} is not a number") from None
    if length < 0:
        raise ValueError("Content-Length is negative")
    if length > limit:
        raise ValueError("request body too large")
    raw = handler.rfile.read(length) if length else b"{}"
    try:
        data = json.loads(raw or b"{}")
    except RecursionError:
        raise ValueError("request body nests too deeply") from None
    if not isinstance(data, dict):
        raise ValueError("request body must be a JSON object")
    return data


class TokenSource:
    """Where the current bearer token is read: the control file (re-read when it changes), or a
    fixed token for a server without a file (tests, an engine outside ColdSnap)."""

    def __init__(self, control_file: Path | None, token: str) -> None:
        self.control_file = control_file
        self._token = token
        self._stamp: tuple | None = None
        self._lock = threading.Lock()

    def current(self) -> str | None:
        if self.control_file is None:
            return self._token
        try:
            st = os.stat(self.control_file)
        except OSError:
            return None
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        with self._lock:
            if stamp != self._stamp:
                try:
                    self._token = ec.ControlInfo.load(self.control_file).token
                except (OSError, ValueError):
                    return None
                self._stamp = stamp
            return self._token


def make_handler(lifecycle: Lifecycle, tokens: TokenSource, extra_status: dict):
    routes = {
        ec.QUIESCE: lifecycle.quiesce,
        ec.EXPORT: lifecycle.export,
        ec.RELEASE: lifecycle.release,
        ec.RESUME: lifecycle.resume,
        ec.FINISH_WARM: lifecycle.finish_warm,
        ec.SLEEP: lifecycle.sleep,
        ec.WAKE: lifecycle.wake,
        ec.START: lifecycle.start,
    }

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"
        server_version = "coldsnap-control"
        timeout = HANDLER_TIMEOUT

        def log_message(self, fmt, *args):  # the workload log is for the engine
            pass

        def _authorized(self) -> bool:
            token = tokens.current()
            got = self.headers.get("Authorization", "").encode()
            if token is None or not hmac.compare_digest(got, f"Bearer {token}".encode()):
                _reply(self, 401, {"ok": False, "error": "unauthorized"})
                return False
            return True

        def do_GET(self):
            if not self._authorized():
                return
            if self.path != ec.STATUS:
                _reply(self, 404, {"ok": False, "error": f"no route {self.path}"})
                return
            try:
                _reply(self, 200, {"ok": True, **lifecycle.status(), "pid": os.getpid(), **extra_status})
            except Exception as exc:
                _reply(self, 500, {"ok": False, "error": f"{type(exc).__name__}: {exc}", "state": lifecycle.state})

        def do_POST(self):
            if not self._authorized():
                return
            fn = routes.get(self.path)
            if fn is None:
                _reply(self, 404, {"ok": False, "error": f"no route {self.path}"})
                return
            try:
                body = read_json_body(self)
            except ValueError as exc:
                _reply(self, 400, {"ok": False, "error": str(exc), "state": lifecycle.state})
                return
            try:
                result = fn(body)
                _reply(self, 200, {"ok": True, "state": lifecycle.state, **(result or {})})
            except EngineStateError as exc:
                _reply(self, 409, {"ok": False, "error": str(exc), "state": lifecycle.state})
            except ValueError as exc:  # a body that does not fit the contract
                _reply(self, 400, {"ok": False, "error": str(exc), "state": lifecycle.state})
            except Exception as exc:
                lifecycle.last_error = f"{type(exc).__name__}: {exc}"
                print(f"[coldsnap] control {self.path} failed: {lifecycle.last_error}", file=sys.stderr, flush=True)
                _reply(self, 500, {"ok": False, "error": lifecycle.last_error, "state": lifecycle.state})

    return Handler


def write_control_file(path: Path, port: int, token: str) -> None:
    """Where (and how) the activation runtime reaches this engine; mode 0600, atomic."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(ec.ControlInfo(port=port, token=token, pid=os.getpid()).to_json(), fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class ControlServer:
    """A running control endpoint (thread + socket on 127.0.0.1)."""

    def __init__(self, lifecycle: Lifecycle, *, control_file: Path | None, extra_status: dict | None = None) -> None:
        self.lifecycle = lifecycle
        self.control_file = Path(control_file) if control_file else None
        token = secrets.token_hex(32)
        self.tokens = TokenSource(self.control_file, token)
        self.httpd = _listen(make_handler(lifecycle, self.tokens, dict(extra_status or {})))
        self.port = self.httpd.server_address[1]
        if self.control_file is not None:
            write_control_file(self.control_file, self.port, token)
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="coldsnap-control", daemon=True)
        self.thread.start()

    @property
    def token(self) -> str | None:
        return self.tokens.current()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def control_file_for(rank: int, local_ranks: int, env: dict | None = None) -> Path | None:
    """The control file this process serves: ``COLDSNAP_CONTROL_FILE`` as is for one endpoint per unit,
    or with ``.rank<N>`` before the suffix when several local workers each serve one."""
    env = os.environ if env is None else env
    base = env.get(ec.ENV_CONTROL_FILE)
    if not base:
        return None
    p = Path(base)
    if local_ranks <= 1:
        return p
    return p.with_name(f"{p.stem}.rank{rank}{p.suffix}")


def start_from_env(lifecycle: Lifecycle, *, rank: int = 0, local_ranks: int = 1,
                   extra_status: dict | None = None) -> ControlServer | None:
    """Serve the control API if this process runs under ColdSnap (``COLDSNAP_CONTROL_FILE`` set)."""
    path = control_file_for(rank, local_ranks)
    if path is None:
        return None
    return ControlServer(lifecycle, control_file=path,
                         extra_status={"unit": os.environ.get(ec.ENV_UNIT), **(extra_status or {})})
