"""Servers that answer too slowly on purpose, for the clients' deadlines: raw TCP, so that nothing in
``http.server`` buffers or completes what the test means to hold back."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def self_signed(where: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key (PEM files in ``where``): a client trusts it through
    ``SSL_CERT_FILE``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = where / "cert.pem", where / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


@contextlib.contextmanager
def header_trickler(every: float = 0.1, tls: tuple[Path, Path] | None = None) -> Iterator[int]:
    """A server on 127.0.0.1 that reads each request's head, sends a status line, then one byte of a header
    every ``every`` seconds, each well within any client's read timeout, until the test is done; yields its
    port. ``tls``: (certificate, key) to speak TLS with."""
    context = None
    if tls:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*tls)
    done = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)

    def trickle(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            if context is not None:
                conn.settimeout(5)
                conn = context.wrap_socket(conn, server_side=True)
        with conn, contextlib.suppress(OSError):
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                head += chunk
            conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
            while not done.wait(every):
                conn.sendall(b"x")

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _addr = listener.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=trickle, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        done.set()
        listener.close()


@contextlib.contextmanager
def answering(do_get: Callable[[BaseHTTPRequestHandler], None]) -> Iterator[int]:
    """An HTTP/1.1 server on 127.0.0.1 whose GET handler is ``do_get(handler)``, quiet; yields its port."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_a) -> None:
            pass

        def do_GET(self) -> None:
            do_get(self)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
