"""FAULTS.md 15 under a flood: more clients than slots send half a header and stall; authenticated
clients are still served at once (a stalled client, not an unread one, gives up its slot), and a
coordinator whose operation is gone exits by itself."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.server import ServerLimits
from cskv_testlib import client_for


def test_authenticated_clients_are_served_while_stalled_clients_outnumber_the_slots(make_server):
    server = make_server(max_connections=32, read_timeout=30.0, auth_timeout=20.0, auth_grace=0.05)
    stalled = []
    try:
        for _i in range(120):
            s = socket.create_connection((server.address, server.port), timeout=5)
            s.sendall(b"CSKV\x01")  # half a header, then nothing
            stalled.append(s)
        # Well under the 20-s authentication deadline those clients were given: they lost their slots
        # because they stalled, not because time ran out.
        client = client_for(server, io_timeout=3.0, connect_timeout=3.0)
        for i in range(20):
            client.set(f"k{i}", b"v")
            assert client.get(f"k{i}") == b"v"
        assert server.stats().evicted_unauthenticated > 0
    finally:
        for s in stalled:
            s.close()


def test_one_source_cannot_hold_every_unauthenticated_slot(make_server):
    server = make_server(max_connections=256, max_unauthenticated_per_source=8, auth_grace=0.05)
    held = [socket.create_connection((server.address, server.port), timeout=5) for _i in range(40)]
    try:
        for s in held:
            s.sendall(b"CS")
        threading.Event().wait(0.1)  # past the grace a client gets to send its request
        client = client_for(server, io_timeout=3.0, connect_timeout=3.0)
        client.health()
        # Each new connection from a source at its limit closes that source's oldest stalled one.
        assert server.stats().evicted_unauthenticated >= 1
        assert server.stats().connections <= 40
    finally:
        for s in held:
            s.close()


def test_an_idle_coordinator_exits_on_its_own(make_server):
    server = make_server(idle_timeout=0.3)
    done = threading.Event()
    threading.Thread(target=lambda: (server._stopped.wait(10), done.set()), daemon=True).start()
    assert done.wait(10), "a coordinator nobody talks to exits after its idle timeout"


def test_connections_that_never_authenticate_do_not_keep_an_idle_coordinator_alive(make_server):
    server = make_server(idle_timeout=1.0, read_timeout=30.0, auth_timeout=30.0)
    held = []
    try:
        deadline = time.monotonic() + 15
        while not server._stopped.is_set() and time.monotonic() < deadline:
            try:  # one junk connection left open every 0.2 s, and one that connects and goes away
                s = socket.create_connection((server.address, server.port), timeout=2)
                s.sendall(b"CSKV")
                held.append(s)
                socket.create_connection((server.address, server.port), timeout=2).close()
            except OSError:
                break  # it stopped listening
            time.sleep(0.2)
        assert server._stopped.wait(5), "unauthenticated connections kept the coordinator alive"
    finally:
        for s in held:
            s.close()


@pytest.mark.parametrize("field", ["idle_timeout", "read_timeout", "auth_timeout"])
def test_limits_that_are_not_numbers_of_seconds_are_refused(field):
    with pytest.raises(ColdSnapError, match="timeout"):
        ServerLimits(**{field: float("nan")})
    if field != "idle_timeout":  # an infinite idle timeout means never, like 0
        with pytest.raises(ColdSnapError, match="finite"):
            ServerLimits(**{field: float("inf")})
