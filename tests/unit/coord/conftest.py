"""Fixtures for the CSKV coordinator tests: real servers on loopback TCP."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.client import CoordinatorClient
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.server import (
    CoordinatorServer,
    ServerLimits,
)
from cskv_testlib import FIXTURE_TOKEN, client_for, load_index


@pytest.fixture
def cskv_index() -> dict:
    return load_index()


@pytest.fixture
def make_server() -> Iterator[Callable[..., CoordinatorServer]]:
    """Start real servers (each in its own loop thread); all are shut down after the test."""
    servers: list[CoordinatorServer] = []

    def start(token: str = FIXTURE_TOKEN, **limits: float) -> CoordinatorServer:
        server = CoordinatorServer(token, limits=ServerLimits(**limits))
        server.start_thread()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown(timeout=10)


@pytest.fixture
def server(make_server) -> CoordinatorServer:
    return make_server()


@pytest.fixture
def client(server) -> CoordinatorClient:
    return client_for(server)
