"""The client of the engine control API (:mod:`..formats.engine_control`), and the one
way anything in ColdSnap talks HTTP to an engine's ports.

``engine_request`` is a single request on a connection that ends with a reset;
:class:`EngineClient` speaks the control contract to one worker (token, JSON
bodies, clock offset, errors); :func:`engine_answers` proves that a pid is our
engine (a pid alone proves nothing: it may have been reused).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.proctree import environment_value
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import engine_control as ec

_LINGER_RESET = struct.pack("ii", 1, 0)


class ControlCallError(RuntimeError):
    """A control request failed: ``status`` is the HTTP status (0 for a transport error)."""

    def __init__(self, message: str, *, status: int = 0, reply: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reply = reply or {}


@contextlib.contextmanager
def engine_request(host: str, port: int, method: str, path: str, *, timeout: float, body: bytes | None = None,
                   headers: dict | None = None, deadline: float | None = None) -> Iterator[http.client.HTTPResponse]:
    """One request to an engine, on a connection that ends with a reset, not a FIN exchange.

    Yields the response; on a normal exit whatever the caller left unread is read first (the
    reply is complete before the reset), and the connection is closed in every case.
    Every client of an engine's (captured) ports goes through here: the rank controller's
    health polls, validation stream and control calls, and prepare's check of a running
    engine. Engines close their HTTP connections first, so each request would leave a
    TIME_WAIT connection on the engine's side of the port; on some kernels (the GPU hosts)
    that keeps the port from being bound again for a minute, SO_REUSEADDR or not, and a
    restore right after a capture waited for it (:func:`require_ports_free`). A reset from
    this side (SO_LINGER 0) ends the engine's side at once.
    """
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    timer = None
    try:
        conn.request(method, path, body=body, headers={"Connection": "close", **(headers or {})})
        with contextlib.suppress(OSError):
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        if deadline is not None:
            # ``timeout`` bounds each socket operation; ``deadline`` (monotonic) the whole exchange: a server
            # that trickles a byte at a time is cut off there (the caller's read then fails or ends).
            timer = threading.Timer(max(0.0, deadline - time.monotonic()), _cut, args=(conn.sock,))
            timer.daemon = True
            timer.start()
        resp = conn.getresponse()
        yield resp
        resp.read()
        resp.close()
    finally:
        if timer is not None:
            timer.cancel()
        conn.close()


def _cut(sock: socket.socket | None) -> None:
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


class EngineClient:
    """The control API of one engine worker, reached through its :class:`ControlInfo`."""

    def __init__(self, info: ec.ControlInfo) -> None:
        self.info = info

    @classmethod
    def from_file(cls, path: Path | str) -> EngineClient:
        return cls(ec.ControlInfo.load(path))

    def call(self, method: str, path: str, body: dict | None = None, *, timeout: float = 600) -> dict:
        """One control request; the reply (``ok`` true) with ``clock_offset_ns`` added.

        Raises :class:`ControlCallError` for a refusal (``ok`` false) and ``OSError`` /
        ``http.client.HTTPException`` when the engine cannot be reached.
        """
        payload = json.dumps(body or {}).encode() if method == "POST" else None
        headers = {"Authorization": self.info.authorization, "Content-Type": "application/json"}
        with engine_request(ec.CONTROL_HOST, self.info.port, method, path, timeout=timeout, body=payload,
                            headers=headers) as resp:
            raw = resp.read()
            status = resp.status
        try:
            data = json.loads(raw or b"{}")
        except ValueError:
            raise ControlCallError(f"{path}: the engine answered {status} with no JSON", status=status) from None
        if not isinstance(data, dict):
            raise ControlCallError(f"{path}: the engine answered {status} with a non-object", status=status)
        if "monotonic_ns" in data:
            # Offset of the engine's clock from ours (a restored engine lives in a time namespace).
            data["clock_offset_ns"] = time.monotonic_ns() - int(data["monotonic_ns"])
        if status != 200 or not data.get("ok"):
            raise ControlCallError(str(data.get("error") or f"HTTP {status}"), status=status, reply=data)
        return data

    def status(self, *, timeout: float = 10) -> dict:
        return self.call("GET", ec.STATUS, timeout=timeout)


def pid_alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    return True


def engine_answers(info: ec.ControlInfo | dict, timeout: float = 5.0) -> bool:
    """True when the process behind ``info`` is our engine, alive, and knows the token."""
    try:
        info = info if isinstance(info, ec.ControlInfo) else ec.ControlInfo.from_json(info)
    except ValueError:
        return False
    if not pid_alive(info.pid):
        return False
    try:
        body = EngineClient(info).status(timeout=timeout)
    except (OSError, ControlCallError, http.client.HTTPException):
        return False
    return int(body.get("pid", -1)) == info.pid


def started_for(pid: int, control_file: Path | str) -> bool:
    """``pid`` is alive and was started for ``control_file`` (the marker the activation runtime puts in every
    engine's environment): this worker's engine, whether its control API answers or not (a recycled pid
    does not carry it)."""
    if not pid_alive(pid):
        return False
    mark = environment_value(pid, ec.ENV_CONTROL_FILE)
    return mark is not None and os.path.realpath(os.fsdecode(mark)) == os.path.realpath(control_file)
