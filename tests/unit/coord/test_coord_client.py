"""CoordinatorClient against a real server: results, errors, retries, nothing kept between calls."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord import protocol as p
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.client import (
    CoordinatorClient,
    CoordinatorError,
    CoordinatorNotFound,
    CoordinatorTimeout,
    CoordinatorUnauthorized,
    CoordinatorUnavailable,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.endpoint import (
    EndpointDescriptor,
    new_token,
)
from cskv_testlib import FIXTURE_TOKEN, client_for


def open_sockets() -> int:
    """Sockets this process holds right now."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                count += 1
        except OSError:
            pass
    return count


def test_every_operation(client) -> None:
    client.health()
    client.set("a", "1")
    assert client.get("a") == b"1"
    assert client.try_get("nope") is None
    assert client.add("n", 5) == 5 and client.add("n", -8) == -3 and client.add(b"n") == -2
    client.append("log", b"x")
    client.append("log", "y")
    assert client.get("log") == b"xy"
    assert client.delete("a") is True and client.delete("a") is False


def test_errors_carry_status_and_fix(server, client) -> None:
    with pytest.raises(CoordinatorNotFound) as nf:
        client.get("missing")
    assert nf.value.status == p.Status.NOT_FOUND and "missing" in str(nf.value)
    with pytest.raises(CoordinatorTimeout):
        client.get("missing", timeout=0.05)
    client.set("text", "abc")
    with pytest.raises(CoordinatorError) as bad:
        client.add("text", 1)
    assert bad.value.status == p.Status.INVALID
    assert "the value stored there is not a decimal int64" in bad.value.problem
    client.set("max", str(2**63 - 1))
    with pytest.raises(CoordinatorError, match="adding 1 would leave the int64 range"):
        client.add("max", 1)
    assert client.get("max") == str(2**63 - 1).encode()
    with pytest.raises(CoordinatorError, match="int64"):
        client.add("n", 2**63)
    with pytest.raises(CoordinatorUnauthorized) as unauth:
        client_for(server, token=new_token()).health()
    assert unauth.value.status == p.Status.UNAUTHORIZED
    for bad in (-1, float("nan"), float("inf")):  # NaN/inf used to escape as ValueError/OverflowError
        with pytest.raises(CoordinatorError, match="not a number of seconds >= 0"):
            client.get("missing", timeout=bad)


def test_a_key_or_value_over_its_cap_or_not_text_is_a_coordinator_error_naming_it(client) -> None:
    """Refused before anything is sent, as the coordinator error callers catch (it escaped as ValueError)."""
    cases = [("set", ("k" * (p.MAX_KEY + 1), "v"), "key"), ("set", ("big", b"x" * (p.MAX_VALUE + 1)), "value"),
             ("get", ("\udcff",), "surrogate"), ("append", ("k" * (p.MAX_KEY + 1), "v"), "key")]
    for op, args, named in cases:
        with pytest.raises(CoordinatorError) as exc:
            getattr(client, op)(*args)
        assert exc.value.status is None and named in str(exc.value) and exc.value.fix
    assert client.try_get("big") is None


def test_no_connection_or_thread_outlives_a_call(server, client) -> None:
    # The in-unit runtime is CRIU-checkpointed between calls: nothing may stay open.
    client.health()
    settle(server)
    sockets, threads = open_sockets(), threading.active_count()
    for i in range(20):
        client.set(f"k{i}", b"v")
        client.get(f"k{i}")
        client.add("n", 1)
        client.append("l", b".")
        client.delete(f"k{i}")
        with pytest.raises(CoordinatorTimeout):
            client.get("never", timeout=0.01)
    settle(server)  # the in-process server closes its side just after replying
    assert open_sockets() == sockets
    assert threading.active_count() == threads


def settle(server) -> None:
    deadline = time.monotonic() + 10
    while server.stats().connections and time.monotonic() < deadline:
        time.sleep(0.005)
    assert server.stats().connections == 0


def test_refused_connect_is_retried_within_its_budget() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free, nothing listens after close
    client = CoordinatorClient(EndpointDescriptor("127.0.0.1", port, "s", new_token()), connect_retry_s=0.3)
    with pytest.raises(CoordinatorUnavailable, match="refused"):
        client.health()


def test_health_waits_for_a_server_that_starts_late(make_server) -> None:
    from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.server import CoordinatorServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    late: list[CoordinatorServer] = []

    def start_later() -> None:
        time.sleep(0.3)
        server = CoordinatorServer(FIXTURE_TOKEN, port=port)
        server.start_thread()
        late.append(server)

    t = threading.Thread(target=start_later)
    t.start()
    try:
        client = CoordinatorClient(EndpointDescriptor("127.0.0.1", port, "s", FIXTURE_TOKEN), connect_retry_s=0)
        client.health(wait_s=20)
    finally:
        t.join()
        for server in late:
            server.shutdown()


def test_silent_peer_times_out_as_unavailable() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        endpoint = EndpointDescriptor("127.0.0.1", listener.getsockname()[1], "s", new_token())
        client = CoordinatorClient(endpoint, io_timeout=0.2)
        with pytest.raises(CoordinatorUnavailable, match="timed out"):
            client.health()


def test_non_cskv_peer_is_reported() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()

        def answer() -> None:
            conn, _addr = listener.accept()
            conn.recv(4096)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            conn.close()

        t = threading.Thread(target=answer)
        t.start()
        client = CoordinatorClient(EndpointDescriptor("127.0.0.1", listener.getsockname()[1], "s", new_token()))
        with pytest.raises(CoordinatorUnavailable, match="not CSKV"):
            client.health()
        t.join()


def test_client_text_never_shows_the_token(client) -> None:
    token = client.endpoint.token
    for text in (repr(client), str(client), repr(client.endpoint), str(client.endpoint)):
        assert token not in text
    with pytest.raises(CoordinatorNotFound) as exc:
        client.get("missing")
    assert token not in str(exc.value)
