"""The stdlib OCI distribution client: references, auth challenges, and credentials that never leak."""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.registry import (
    RegistryClient,
    RegistryError,
    parse_repository,
    split_repository_digest,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from slow_servers import answering, header_trickler, self_signed

DIGEST = "sha256:" + "c" * 64
PASSWORD = "pw-9f8e7d6c5b4a"
TOKEN = "tok-0123456789abcdef"


def test_repository_references() -> None:
    r = parse_repository("127.0.0.1:5000/coldsnap/capsules")
    assert (r.registry, r.name) == ("127.0.0.1:5000", "coldsnap/capsules")
    assert parse_repository("registry.example/a").registry == "registry.example"
    for bad in ("coldsnap/capsules", "capsules", "Registry:5000/x", "127.0.0.1:5000/x:tag", ""):
        with pytest.raises(ColdSnapError):
            parse_repository(bad)
    assert split_repository_digest(f"127.0.0.1:5000/c@{DIGEST}") == ("127.0.0.1:5000/c", DIGEST)
    for bad in ("127.0.0.1:5000/c:latest", f"127.0.0.1:5000/c:tag@{DIGEST}", "127.0.0.1:5000/c@sha256:abc"):
        with pytest.raises(ColdSnapError):
            split_repository_digest(bad)


class _AuthRegistry(BaseHTTPRequestHandler):
    """Bearer-protected /v2 with a Basic-protected token realm; or Basic-protected /v2 (scheme='basic')."""

    scheme = "bearer"
    seen_auth: list[str] = []

    def log_message(self, *args: object) -> None:
        pass

    def _reply(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path.startswith("/token"):
            good = "Basic " + base64.b64encode(f"alice:{PASSWORD}".encode()).decode()
            if self.headers.get("Authorization") != good:
                self._reply(401, b'{"errors":[{"code":"UNAUTHORIZED","message":"bad credentials"}]}')
                return
            assert "scope=repository%3Acoldsnap%2Fcapsules%3Apull" in self.path
            self._reply(200, json.dumps({"token": TOKEN}).encode())
            return
        self.do_HEAD()

    def do_HEAD(self) -> None:
        auth = self.headers.get("Authorization") or ""
        self.seen_auth.append(auth)
        ok = auth == f"Bearer {TOKEN}" if self.scheme == "bearer" else \
            auth == "Basic " + base64.b64encode(f"alice:{PASSWORD}".encode()).decode()
        if not ok:
            host = self.headers.get("Host")
            challenge = (f'Bearer realm="http://{host}/token",service="test"' if self.scheme == "bearer"
                         else 'Basic realm="test"')
            self._reply(401, b'{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}',
                        {"WWW-Authenticate": challenge})
            return
        self._reply(404, b'{"errors":[{"code":"BLOB_UNKNOWN","message":"blob unknown"}]}')


@pytest.fixture(params=["bearer", "basic"])
def auth_registry(request: pytest.FixtureRequest) -> Iterator[str]:
    handler = type("H", (_AuthRegistry,), {"scheme": request.param, "seen_auth": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_auth_challenge_is_answered_with_the_given_credentials(auth_registry: str) -> None:
    client = RegistryClient(f"{auth_registry}/coldsnap/capsules", auth={"username": "alice", "password": PASSWORD})
    assert client.blob_exists(DIGEST) is False


def test_refused_credentials_are_reported_without_the_secret(auth_registry: str) -> None:
    client = RegistryClient(f"{auth_registry}/coldsnap/capsules", auth={"username": "alice", "password": "wrong-pw"})
    with pytest.raises(RegistryError) as err:
        client.blob_exists(DIGEST)
    assert err.value.status == 401
    assert "wrong-pw" not in str(err.value) and "credentials" in str(err.value)
    anonymous = RegistryClient(f"{auth_registry}/coldsnap/capsules")
    with pytest.raises(RegistryError, match="401"):
        anonymous.blob_exists(DIGEST)


def test_unreachable_registry_is_a_clear_error() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RegistryError, match="unreachable"):
        RegistryClient(f"127.0.0.1:{port}/x", timeout=2).blob_exists(DIGEST)


class _Elsewhere(BaseHTTPRequestHandler):
    """Another host (object storage, a token service behind a redirect): records what reaches it."""

    seen: list = []

    def log_message(self, *_a) -> None:
        pass

    def _any(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        type(self).seen.append((self.command, self.path, self.headers.get("Authorization")))
        self.send_response(201 if self.command == "PUT" else 200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_PUT = do_POST = _any


def test_registry_credentials_never_reach_another_host() -> None:
    """An upload's Location on another host gets the bytes, never the credentials; nor does a token realm
    that redirects elsewhere."""
    import hashlib

    data = b"layer bytes"
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    other = ThreadingHTTPServer(("127.0.0.2", 0), _Elsewhere)
    other_url = f"http://127.0.0.2:{other.server_address[1]}"

    class Registry(BaseHTTPRequestHandler):
        bearer = False

        def log_message(self, *_a) -> None:
            pass

        def _any(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if not self.headers.get("Authorization"):
                self.send_response(401)
                realm = f'Bearer realm="http://127.0.0.1:{self.server.server_address[1]}/token"'
                self.send_header("WWW-Authenticate", realm if Registry.bearer else 'Basic realm="r"')
            elif self.path.startswith("/token"):
                self.send_response(302)
                self.send_header("Location", other_url + "/stolen")
            elif self.command == "POST":
                self.send_response(202)
                self.send_header("Location", other_url + "/upload/1")
            else:
                self.send_response(404 if self.command == "HEAD" else 200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_PUT = do_POST = do_HEAD = _any

    registry = ThreadingHTTPServer(("127.0.0.1", 0), Registry)
    for s in (other, registry):
        threading.Thread(target=s.serve_forever, daemon=True).start()
    try:
        client = RegistryClient(f"127.0.0.1:{registry.server_address[1]}/coldsnap/capsules",
                                auth={"username": "alice", "password": "S3cret"})
        client.upload_blob(digest, len(data), lambda: data, what="a layer")
        assert [(m, auth) for m, _p, auth in _Elsewhere.seen] == [("PUT", None)], _Elsewhere.seen
        _Elsewhere.seen.clear()
        Registry.bearer = True
        fresh = RegistryClient(f"127.0.0.1:{registry.server_address[1]}/coldsnap/capsules",
                               auth={"username": "alice", "password": "S3cret"})
        with pytest.raises(ColdSnapError):
            fresh.upload_blob(digest, len(data), lambda: data, what="a layer")
        assert all(auth is None for _m, _p, auth in _Elsewhere.seen), _Elsewhere.seen
    finally:
        other.shutdown()
        registry.shutdown()


def test_a_challenge_from_where_a_download_was_redirected_is_never_answered() -> None:
    """A blob GET redirected to another host (object storage) that answers 401 with a Bearer challenge
    naming a token realm of its own: the registry's credentials never go to that realm."""
    seen: list = []

    class Storage(BaseHTTPRequestHandler):
        def log_message(self, *_a) -> None:
            pass

        def do_GET(self) -> None:
            seen.append((self.path, self.headers.get("Authorization")))
            if self.path.startswith("/token"):
                body = json.dumps({"token": "stolen"}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.send_response(401)
            self.send_header("WWW-Authenticate",
                             f'Bearer realm="http://127.0.0.2:{self.server.server_address[1]}/token",service="s"')
            self.send_header("Content-Length", "0")
            self.end_headers()

    storage = ThreadingHTTPServer(("127.0.0.2", 0), Storage)

    class Registry(BaseHTTPRequestHandler):
        def log_message(self, *_a) -> None:
            pass

        def do_GET(self) -> None:
            if self.headers.get("Authorization") is None:
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="r"')
            else:
                self.send_response(307)
                self.send_header("Location", f"http://127.0.0.2:{storage.server_address[1]}/data/blob")
            self.send_header("Content-Length", "0")
            self.end_headers()

    registry = ThreadingHTTPServer(("127.0.0.1", 0), Registry)
    for s in (storage, registry):
        threading.Thread(target=s.serve_forever, daemon=True).start()
    try:
        client = RegistryClient(f"127.0.0.1:{registry.server_address[1]}/coldsnap/capsules",
                                auth={"username": "alice", "password": PASSWORD})
        with pytest.raises(RegistryError, match=r"127\.0\.0\.2") as err:
            client.open_blob(DIGEST, what="a layer")
        assert seen and all(auth is None for _p, auth in seen), seen
        assert not any(p.startswith("/token") for p, _a in seen), seen
        assert PASSWORD not in str(err.value)
    finally:
        storage.shutdown()
        registry.shutdown()


@pytest.mark.parametrize("how", ["reset", "chunked-cut", "stall"])
def test_a_download_cut_short_or_stalled_is_a_registry_error(how: str) -> None:
    """A connection reset, a chunked body cut mid-chunk, a read that times out: a RegistryError naming the
    registry and how far the download got, never a bare socket or HTTP exception."""
    import socket
    import struct

    release = threading.Event()

    class Registry(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_a) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            half = b"x" * 5000
            if how == "chunked-cut":
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.write(b"%x\r\n" % 10000 + half)
            else:
                self.send_header("Content-Length", "10000")
                self.end_headers()
                self.wfile.write(half)
            self.wfile.flush()
            if how == "stall":
                release.wait(30)
            elif how == "reset":
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True

    registry = ThreadingHTTPServer(("127.0.0.1", 0), Registry)
    threading.Thread(target=registry.serve_forever, daemon=True).start()
    try:
        client = RegistryClient(f"127.0.0.1:{registry.server_address[1]}/coldsnap/capsules", timeout=1)
        with pytest.raises(RegistryError, match=r"connection to registry 127\.0\.0\.1:\d+ broke while downloading "
                                                r"a layer after \d+ bytes"):
            with client.open_blob(DIGEST, what="a layer") as body:
                while body.read(1 << 20):
                    pass
    finally:
        release.set()
        registry.shutdown()


@pytest.mark.parametrize(("old", "new", "kept"), [
    ("https://reg.example/v2/x/blobs/a", "https://reg.example/v2/x/blobs/b", True),
    ("https://reg.example/v2/x/blobs/a", "http://reg.example/v2/x/blobs/a", False),  # a downgrade, same host
    ("https://reg.example/v2/x/blobs/a", "https://reg.example:8443/v2/x/blobs/a", False),
    ("https://reg.example/token", "https://storage.example/signed?sig=1", False),
    ("https://REG.example/token", "https://reg.example/token/", True),
    ("https://reg.example/v2/x", "https://reg.example:443/v2/x", True),  # the default port, written out
])
def test_a_redirect_keeps_the_credentials_only_within_scheme_host_and_port(old: str, new: str, kept: bool) -> None:
    from email.message import Message

    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.registry import _NoRedirect

    req = urllib.request.Request(old)
    req.add_header("Authorization", "Bearer S3cret")
    followed = _NoRedirect().redirect_request(req, None, 302, "Found", Message(), new)
    assert followed is not None and followed.full_url == new
    assert followed.has_header("Authorization") is kept
    upload = urllib.request.Request(old, method="PUT", data=b"x")
    assert _NoRedirect().redirect_request(upload, None, 307, "Temporary Redirect", Message(), new) is None


@pytest.mark.parametrize("what", ["blob", "manifest"])
def test_a_download_trickled_below_the_minimum_rate_is_a_registry_error(what: str) -> None:
    """A registry that sends a byte now and then, each well within the per-read timeout, is not waited on
    for as long as it keeps trickling: the download fails naming the registry and the rate it fell below."""
    release = threading.Event()

    class Registry(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_a) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            for _byte in range(120):  # 6 s of one byte every 0.05 s, then the connection ends
                try:
                    self.wfile.write(b"x")
                    self.wfile.flush()
                except OSError:
                    break
                if release.wait(0.05):
                    break
            self.close_connection = True

    registry = ThreadingHTTPServer(("127.0.0.1", 0), Registry)
    threading.Thread(target=registry.serve_forever, daemon=True).start()
    try:
        client = RegistryClient(f"127.0.0.1:{registry.server_address[1]}/coldsnap/capsules", timeout=1)
        with pytest.raises(RegistryError, match=r"registry 127\.0\.0\.1:\d+ is too slow while .* \(after \d+ "
                                                r"bytes\): \d+ bytes in [\d.]+ s, under the floor of 32 KiB a "
                                                r"second") as err:
            if what == "manifest":
                client.get_manifest(DIGEST, ("application/json",), what="a capsule")
            else:
                with client.open_blob(DIGEST, what="a layer") as body:
                    while body.read(1 << 20):
                        pass
        assert type(err.value).__name__ == "RegistryTooSlow" and err.value.code == "TOO_SLOW"
    finally:
        release.set()
        registry.shutdown()


def test_response_headers_trickled_past_the_deadline_are_a_registry_error() -> None:
    """A registry that sends its headers a byte at a time, each within the read timeout, is cut off at twice
    that timeout (common.http_deadline), naming the registry and the deadline, instead of holding the
    request for as long as it keeps trickling."""
    with header_trickler() as port:
        client = RegistryClient(f"127.0.0.1:{port}/coldsnap/capsules", timeout=0.5)
        with pytest.raises(RegistryError, match=rf"registry 127\.0\.0\.1:{port} is too slow while .*: its status "
                                                r"line and headers did not all come within 1 s") as err:
            client.get_manifest(DIGEST, ("application/json",), what="a capsule")
    assert type(err.value).__name__ == "RegistryTooSlow" and err.value.code == "TOO_SLOW"


def test_the_deadline_holds_over_tls_too(tmp_path, monkeypatch) -> None:
    """A registry's https endpoint (certificate verified) trickling its headers meets the same deadline."""
    pytest.importorskip("cryptography")
    cert, key = self_signed(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    with header_trickler(tls=(cert, key)) as port:
        client = RegistryClient(f"127.0.0.1:{port}/coldsnap/capsules", insecure=False, timeout=0.5)
        assert client.base.startswith("https://")
        with pytest.raises(RegistryError, match=r"is too slow while .*: its status line and headers did not all "
                                                r"come within 1 s") as err:
            client.get_manifest(DIGEST, ("application/json",), what="a capsule")
    assert err.value.code == "TOO_SLOW"


def test_a_body_that_outlasts_the_headers_deadline_is_read_whole() -> None:
    """The deadline covers the status line and headers only: a layer that streams at a sound rate for longer
    than twice the timeout comes in whole."""
    chunk, chunks = b"y" * (64 << 10), 15  # 960 KiB over 1.5 s; the deadline is 1 s

    def steady(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(chunk) * chunks))
        handler.end_headers()
        for _chunk in range(chunks):
            time.sleep(0.1)
            handler.wfile.write(chunk)
            handler.wfile.flush()

    with answering(steady) as port:
        client = RegistryClient(f"127.0.0.1:{port}/coldsnap/capsules", timeout=0.5)
        got = 0
        with client.open_blob(DIGEST, what="a layer") as body:
            while data := body.read(1 << 20):
                got += len(data)
    assert got == len(chunk) * chunks
