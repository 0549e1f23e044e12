"""The barrier with many ranks, its timeouts and its errors over a real server: behaviour, never timing."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord import protocol as p
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.barrier import (
    RELEASE_VALUE,
    BarrierError,
    BarrierTimeout,
    barrier,
    barrier_key,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.client import (
    CoordinatorError,
    CoordinatorUnauthorized,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.endpoint import new_token
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.server import CoordinatorServer
from cskv_testlib import client_for


def run_ranks(client, name: str, ranks, world: int, timeout: float) -> dict:
    results: dict = {}
    go = threading.Barrier(len(ranks))

    def rank_main(rank: int) -> None:
        go.wait()
        try:
            results[rank] = barrier(client, name, rank, world, timeout)
        except Exception as exc:
            results[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def start_waiting(server, client, name: str, *, ranks: int, world: int, timeout: float,
                  waiting: int | None = None) -> tuple[list[threading.Thread], dict]:
    """Ranks 0..ranks-1 enter barrier ``name`` in threads; returns once ``waiting`` of them (all by default)
    wait on the server. (threads, results by rank)"""
    results: dict = {}
    threads = [threading.Thread(target=lambda r=r: results.update({r: barrier(client, name, r, world, timeout)}))
               for r in range(ranks)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while server.stats().waiting_gets < (waiting or ranks) and time.monotonic() < deadline:
        time.sleep(0.005)
    return threads, results


def settle(server) -> None:
    deadline = time.monotonic() + 10
    while (server.stats().connections or server.stats().waiting_gets) and time.monotonic() < deadline:
        time.sleep(0.005)


def test_64_ranks_leave_together_and_leave_nothing_behind(server) -> None:
    client = client_for(server)
    for phase in range(3):
        results = run_ranks(client, f"wide/{phase}", range(64), 64, 60)
        # arrival orders within the groups of 16 ranks: 0-15, 16-31, 32-47, 48-63
        assert sorted(results.values()) == sorted([*range(1, 17)] * 4), results
        for group in range(4):  # 16 arrivals, each rank's two-bit field 1
            assert int(client.get(barrier_key(f"wide/{phase}", f"arrived/{group}@64"))) == 16 * 2**32 + 0x55555555
        assert client.get(barrier_key(f"wide/{phase}", "groups@64")) == b"4"
        assert client.get(barrier_key(f"wide/{phase}", "release@64")) == RELEASE_VALUE
    settle(server)
    stats = server.stats()
    # Every wait was answered: no slot, no waiter is left.
    assert stats.connections == 0 and stats.waiting_gets == 0
    assert stats.statuses["timeout"] == 0 and stats.statuses["internal"] == 0


def test_release_waits_are_in_place_before_the_last_count(server) -> None:
    """The ranks that arrived early wait on the release key while the barrier is open; nobody leaves early."""
    client = client_for(server)
    threads, results = start_waiting(server, client, "open", ranks=3, world=4, timeout=30)
    assert server.stats().waiting_gets == 3 and not results
    assert client.try_get(barrier_key("open", "release@4")) is None
    assert barrier(client, "open", 3, 4, 30) == 4
    for t in threads:
        t.join(30)
    assert sorted(results.values()) == [1, 2, 3]


def test_many_ranks_time_out_naming_the_missing_ones(server) -> None:
    client = client_for(server)
    present = [r for r in range(40) if r not in (3, 17, 39)]
    results = run_ranks(client, "holes", present, 40, 0.5)
    for rank in present:
        exc = results[rank]
        assert isinstance(exc, BarrierTimeout), exc
        assert exc.missing == [3, 17, 39] and exc.arrived == 37
        assert "missing ranks 3, 17, 39" in str(exc)
    settle(server)
    assert server.stats().waiting_gets == 0 and server.stats().connections == 0


def test_a_duplicate_rank_is_refused_before_it_counts(server) -> None:
    client = client_for(server)
    waiting: dict = {}
    t = threading.Thread(target=lambda: waiting.update(r=barrier(client, "dup", 0, 2, 30)))
    t.start()
    deadline = time.monotonic() + 10
    while server.stats().waiting_gets < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    with pytest.raises(BarrierError, match="rank 0 arrived more than once"):
        barrier(client, "dup", 0, 2, 30)  # a second rank 0 must not complete a world of 2
    assert int(client.get(barrier_key("dup", "arrived/0@2"))) == 2**32 + 1 and not waiting
    assert barrier(client, "dup", 1, 2, 30) == 2
    t.join(30)
    assert waiting["r"] == 1


def test_too_many_arrivals_leave_no_wait(server) -> None:
    client = client_for(server)
    client.set(barrier_key("over", "arrived/0@2"), str(2 * 2**32 + 5))  # as if both ranks had already passed
    with pytest.raises(BarrierError, match="rank 0 arrived more than once"):
        barrier(client, "over", 0, 2, 30)
    assert int(client.get(barrier_key("over", "arrived/0@2"))) == 2 * 2**32 + 5  # taken back
    settle(server)
    assert server.stats().waiting_gets == 0 and server.stats().connections == 0


def test_wrong_token_fails_at_the_first_request(server) -> None:
    bad = client_for(server, token=new_token())
    with pytest.raises(CoordinatorUnauthorized):
        barrier(bad, "auth", 0, 2, 5)
    client = client_for(server)
    assert client.try_get(barrier_key("auth", "arrived/0@2")) is None and server.stats().waiting_gets == 0


def test_shutdown_while_waiting_is_an_error_not_a_timeout(make_server) -> None:
    server = make_server()
    client = client_for(server)
    out: dict = {}

    def rank0() -> None:
        try:
            barrier(client, "bye", 0, 2, 30)
        except Exception as exc:
            out["exc"] = exc

    t = threading.Thread(target=rank0)
    t.start()
    deadline = time.monotonic() + 10
    while server.stats().waiting_gets < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    server.shutdown(timeout=10)
    t.join(30)
    exc = out["exc"]
    assert isinstance(exc, CoordinatorError) and not isinstance(exc, BarrierTimeout)
    assert exc.status == p.Status.INTERNAL


def test_client_connects_to_an_ip_literal_without_a_name_lookup(monkeypatch) -> None:
    try:
        server = CoordinatorServer("b" * 64, address="::1")
    except ColdSnapError:
        pytest.skip("no IPv6 loopback here")
    server.start_thread()
    try:
        def no_lookup(*_a, **_k):
            raise AssertionError("the client looked the address up")

        monkeypatch.setattr(socket, "getaddrinfo", no_lookup)
        client = client_for(server, token="b" * 64)
        client.set("k", b"v")
        assert client.get("k") == b"v"
        assert barrier(client, "v6", 0, 1, 5) == 1
    finally:
        server.shutdown(timeout=10)


def test_duplicates_never_complete_a_group_whatever_their_order(server) -> None:
    """Ranks 0 and 0 again (while 1 is missing), caught before the duplicate takes its arrival back: the
    innocent ranks are not blamed for it, and the group completes only with each rank once."""
    client = client_for(server)
    key = barrier_key("carry", "arrived/0@3")
    client.add(key, 2**32 + 1)  # rank 0 arrived ...
    client.add(key, 2**32 + 1)  # ... and a copy of it, caught between its add and its take-back
    results = run_ranks(client, "carry", [1, 2], 3, 0.5)  # 4 arrivals for 3 ranks, rank 0's field 2
    # Neither rank 1 nor rank 2 is taken for the duplicate (with one bit a rank, rank 0's second arrival
    # carried into rank 1's bit); nobody is released either.
    assert isinstance(results[1], BarrierTimeout) and isinstance(results[2], BarrierTimeout), results
    assert client.try_get(barrier_key("carry", "release@3")) is None
    with pytest.raises(BarrierError, match="rank 0 arrived more than once"):
        barrier(client, "carry", 0, 3, 0.5)


def test_a_timeout_past_the_first_group_names_the_missing_ranks_of_every_group(server) -> None:
    client = client_for(server)
    present = [r for r in range(70) if r not in (0, 30, 31, 61, 62, 69)]
    results = run_ranks(client, "groups", present, 70, 0.5)
    exc = results[present[0]]
    assert isinstance(exc, BarrierTimeout), exc
    assert exc.missing == [0, 30, 31, 61, 62, 69] and exc.arrived == 64
    # the groups that completed (none here) would have counted in groups@70: nobody released
    assert client.try_get(barrier_key("groups", "release@70")) is None


def test_more_waiting_ranks_than_connection_slots_still_let_the_last_rank_in(make_server) -> None:
    """Waiting ranks hold a slot each; they wait in slices, so the rank that releases them gets a slot
    before their timeout instead of queueing behind them in the kernel's backlog."""
    server = make_server(max_connections=3)
    client = client_for(server)
    threads, early = start_waiting(server, client, "slots", ranks=4, world=5, timeout=20, waiting=3)
    assert server.stats().connections == 3  # every slot held by a waiter, a fourth rank in the backlog
    barrier(client, "slots", 4, 5, 20)
    for t in threads:
        t.join(30)
    assert sorted(early) == [0, 1, 2, 3], early
