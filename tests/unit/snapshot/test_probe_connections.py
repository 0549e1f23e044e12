"""Our requests to an engine leave no TIME_WAIT on the engine's (captured) port.

The engine speaks HTTP/1.0 and closes first, so a plain client leaves the engine's side of
every connection in TIME_WAIT on the serving or control port; on some kernels that blocks
binding the port again for a minute, which a restore right after its capture must do.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import engine_client, ports

import coldsnap  # noqa: F401  # pylint: disable=unused-import

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "runtime_image" / "activation"))
from coldsnap_activation import probes


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the engine's: the server closes each connection first

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = b"{}"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for t, finish in (("Cold", b"null"), ("Snap", b'"length"')):
            self.wfile.write(b'data: {"choices": [{"text": "%s", "finish_reason": %s}]}\n\n' % (t.encode(), finish))
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def engine_port():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def _time_waits(port: int) -> int:
    time.sleep(0.2)  # let both ends finish closing
    return ports.local_states(port).count(ports.TIME_WAIT)


def test_a_plain_client_leaves_time_wait_on_the_engine_port(engine_port):
    """The control case: what the helpers avoid does happen on this kernel. The client reads up
    to the engine's close (as a full reply read does) so the engine is the side that closes first."""
    with socket.create_connection(("127.0.0.1", engine_port), timeout=5) as sock:
        sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        while sock.recv(4096):
            pass
    assert _time_waits(engine_port) == 1


def test_health_polls_validation_stream_and_prepare_check_leave_none(engine_port):
    probes.wait_http_ready("127.0.0.1", engine_port, "/health", timeout=5, alive=lambda: True)
    done = probes.stream_completion("127.0.0.1", engine_port, model="m", prompt="p", max_tokens=2)
    assert done.text == "ColdSnap" and done.first_ns > 0
    with engine_client.engine_request("127.0.0.1", engine_port, "POST", "/status", timeout=5, body=b"{}") as resp:
        assert resp.read().startswith(b"data:")
    # prepare's "is the running engine ours?" check (this stand-in reports no pid: not ours)
    assert engine_client.engine_answers({"pid": os.getpid(), "port": engine_port, "token": "t" * 64}) is False
    assert _time_waits(engine_port) == 0


# ----------------------------------------------------------------------------- hostile engines

def _raw_server(handler):
    """A TCP server whose every connection ``handler(conn)`` answers by hand."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)

    def loop():
        while True:
            try:
                conn, _addr = srv.accept()
            except OSError:
                return
            threading.Thread(target=handler, args=(conn,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    return srv


def _read_request(conn) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _sep, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        body += conn.recv(65536)


def _sse(conn, events: list[bytes]) -> None:
    with conn:
        _read_request(conn)
        conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
        for e in events:
            conn.sendall(b"data: " + e + b"\n\n")


def _chunk(text: str, index: int = 0, finish: str | None = None) -> bytes:
    import json

    return json.dumps({"choices": [{"index": index, "text": text, "finish_reason": finish}]}).encode()


@pytest.mark.parametrize(("events", "expect"), [
    ([_chunk("Hel"), _chunk("lo")], "ended before [DONE]"),                      # the engine died mid-stream
    ([_chunk("Hello"), b"[DONE]"], "ended before its finish_reason"),
    ([b"7", _chunk("x", finish="length"), b"[DONE]"], "not an object"),
    ([b'{"choices": [{"text": 5}]}', b"[DONE]"], "sent text 5"),
])
def test_a_validation_stream_that_is_not_complete_is_never_the_reply(events, expect):
    srv = _raw_server(lambda conn: _sse(conn, events))
    try:
        with pytest.raises(RuntimeError, match=re.escape(expect)):
            probes.stream_completion("127.0.0.1", srv.getsockname()[1], model="m", prompt="p", max_tokens=4)
    finally:
        srv.close()


def test_a_validation_stream_reads_the_first_choice_and_skips_usage_chunks():
    events = [_chunk("A", 0), _chunk("B", 1), b'{"choices": [], "usage": {"total_tokens": 3}}',
              _chunk("C", 0, finish="length"), _chunk("D", 1, finish="length"), b"[DONE]"]
    srv = _raw_server(lambda conn: _sse(conn, events))
    try:
        done = probes.stream_completion("127.0.0.1", srv.getsockname()[1], model="m", prompt="p", max_tokens=4)
        assert done.text == "AC"
    finally:
        srv.close()


def test_a_server_that_trickles_is_cut_off_at_the_callers_deadline():
    def trickle(conn):
        with conn:
            _read_request(conn)
            with contextlib.suppress(OSError):
                for b in b"HTTP/1.0 200 OK\r\n" * 100:
                    conn.sendall(bytes([b]))
                    time.sleep(0.5)

    srv = _raw_server(trickle)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            probes.wait_http_ready("127.0.0.1", srv.getsockname()[1], "/health", timeout=2, alive=lambda: True)
        assert time.monotonic() - t0 < 10
        t0 = time.monotonic()
        with pytest.raises((RuntimeError, OSError)):
            probes.stream_completion("127.0.0.1", srv.getsockname()[1], model="m", prompt="p", max_tokens=4,
                                     timeout=2)
        assert time.monotonic() - t0 < 10
    finally:
        srv.close()
