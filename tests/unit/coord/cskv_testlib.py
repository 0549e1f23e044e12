"""Helpers shared by the CSKV tests (imported by name; fixtures live in conftest.py)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.client import CoordinatorClient
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.endpoint import EndpointDescriptor
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.server import CoordinatorServer

CSKV_FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "cskv"


def load_index() -> dict:
    return json.loads((CSKV_FIXTURES / "index.json").read_text())


FIXTURE_TOKEN: str = load_index()["token"]


def client_for(server: CoordinatorServer, token: str = FIXTURE_TOKEN, **kwargs: float) -> CoordinatorClient:
    return CoordinatorClient(EndpointDescriptor(server.address, server.port, "test-scope", token), **kwargs)


def exchange(server: CoordinatorServer, data: bytes, *, timeout: float = 10.0) -> bytes:
    """Send raw bytes on a fresh connection, half-close, and read until the server closes."""
    with socket.create_connection((server.address, server.port), timeout=timeout) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        return read_to_eof(sock)


def read_to_eof(sock: socket.socket) -> bytes:
    chunks = []
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
