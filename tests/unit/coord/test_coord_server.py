"""The CSKV server over real loopback TCP: golden replay and FAULTS.md cases 13-16."""

from __future__ import annotations

import hmac
import socket
import threading
import time
import tracemalloc

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord import protocol as p
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord import server as server_mod
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.server import CoordinatorServer
from cskv_testlib import CSKV_FIXTURES, FIXTURE_TOKEN, client_for, exchange, load_index, read_to_eof

CASES = load_index()["cases"]
TOKEN = FIXTURE_TOKEN.encode()


def wait_until(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def raw_request(op: p.Op, key: bytes = b"", value: bytes = b"", *, token: bytes = TOKEN,
                timeout_ms: int = 0) -> bytes:
    return p.encode_request(op, token, key, value, timeout_ms=timeout_ms)


# -- golden replay -----------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_golden_fixture_replay(make_server, case) -> None:
    server = make_server(**case["server"])
    client = client_for(server)
    for step in case["setup"]:
        assert step["op"] == "set"
        client.set(bytes.fromhex(step["key_hex"]), bytes.fromhex(step["value_hex"]))
    request = (CSKV_FIXTURES / case["request"]).read_bytes()
    expected = (CSKV_FIXTURES / case["response"]).read_bytes()
    with socket.create_connection((server.address, server.port), timeout=30) as sock:
        sock.sendall(request)
        if case["trigger"]:
            wait_until(lambda: server.stats().waiting_gets == 1, "the get to wait")
            if case["trigger"]["action"] == "set":
                client.set(bytes.fromhex(case["trigger"]["key_hex"]), bytes.fromhex(case["trigger"]["value_hex"]))
            else:
                server.shutdown(wait=False)
        # The reply is the whole of what comes back: the server closes after it.
        assert read_to_eof(sock) == expected
    if case["trigger"] and case["trigger"]["action"] == "shutdown":
        return
    for key_hex, value_hex in case["expect_after"].items():
        assert client.try_get(bytes.fromhex(key_hex)) == bytes.fromhex(value_hex)
    for key_hex in case["expect_absent"]:
        assert client.try_get(bytes.fromhex(key_hex)) is None
    assert server.stats().inflight_bytes == 0


# -- FAULTS 13: authentication -----------------------------------------------------------------


@pytest.mark.parametrize("token", [
    b"", b"0123456789abcde", FIXTURE_TOKEN[:16].encode(), FIXTURE_TOKEN[:-1].encode(),
    TOKEN + b"0", b"f" * 64, b"x" * 1024,
], ids=["empty", "short", "prefix16", "prefix63", "extended", "same-length", "max-length"])
def test_bad_tokens_are_unauthorized_and_store_nothing(server, token) -> None:
    for op, value in ((p.Op.SET, b"v"), (p.Op.APPEND, b"v"), (p.Op.ADD, b"1")):
        reply = exchange(server, raw_request(op, b"k", value, token=token))
        assert reply == p.encode_response(p.Status.UNAUTHORIZED)
    assert server.stats().keys == 0
    assert client_for(server).try_get("k") is None


def test_token_comparison_is_constant_time(server, monkeypatch) -> None:
    seen = []
    real = hmac.compare_digest

    def spy(a, b):
        seen.append((bytes(a), bytes(b)))
        return real(a, b)

    monkeypatch.setattr(server_mod.hmac, "compare_digest", spy)
    exchange(server, raw_request(p.Op.HEALTH, token=b"f" * 64))
    client_for(server).health()
    assert (b"f" * 64, TOKEN) in seen and (TOKEN, TOKEN) in seen


def test_unauthorized_reply_does_not_wait_for_key_and_value(server) -> None:
    # Header + a bad token announcing a 16 MiB value: refused after the token, no body read.
    header = p.pack_request_header(p.Op.SET, token_len=64, key_len=1, value_len=p.MAX_VALUE)
    with socket.create_connection((server.address, server.port), timeout=10) as sock:
        sock.sendall(header + b"f" * 64)
        reply = p.recv_exact(sock, p.RESPONSE_HEADER_SIZE)
    assert p.decode_response_header(reply) == (p.Status.UNAUTHORIZED, 0)
    assert server.stats().inflight_bytes == 0


# -- FAULTS 14: malformed frames and caps --------------------------------------------------------


_CAPS = {"token_len": p.MAX_TOKEN, "key_len": p.MAX_KEY, "value_len": p.MAX_VALUE}
_OVERSIZED = [(f, size) for f, cap in _CAPS.items() for size in (cap + 1, 2**31, p.U32_MAX)]


@pytest.mark.parametrize(("field", "size"), _OVERSIZED)
def test_oversized_lengths_refused_from_the_header(server, field, size) -> None:
    lengths = {"token_len": 0, "key_len": 0, "value_len": 0, field: size}
    header = p.pack_request_header(p.Op.SET, **lengths)
    with socket.create_connection((server.address, server.port), timeout=10) as sock:
        sock.sendall(header)  # no body at all: the reply must come anyway
        reply = read_to_eof(sock)
    assert reply == p.encode_response(p.Status.TOO_LARGE)


def test_oversized_requests_do_not_grow_memory(server) -> None:
    tracemalloc.start()
    try:
        exchange(server, p.pack_request_header(p.Op.SET, token_len=0, key_len=0, value_len=p.U32_MAX))
        tracemalloc.reset_peak()
        base, _unused = tracemalloc.get_traced_memory()
        for field in ("token_len", "key_len", "value_len") * 10:
            lengths = {"token_len": 0, "key_len": 0, "value_len": 0, field: p.U32_MAX}
            header = p.pack_request_header(p.Op.SET, **lengths)
            assert exchange(server, header) == p.encode_response(p.Status.TOO_LARGE)
        _unused, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # A buffer sized from any of those headers would be >= 1 KiB..4 GiB; allow only bookkeeping.
    assert peak - base < 256 * 1024, peak - base
    assert server.stats().inflight_bytes == 0 and server.stats().keys == 0


@pytest.mark.parametrize(("mutation", "offset", "byte"), [
    ("magic", 0, b"X"), ("version", 4, b"\x02"), ("op", 5, b"\x09"), ("reserved", 7, b"\x01"),
    ("total", 27, b"\x00"),
])
def test_malformed_headers_are_invalid_and_store_nothing(server, mutation, offset, byte) -> None:
    frame = bytearray(raw_request(p.Op.SET, b"key", b"value"))
    frame[offset:offset + 1] = byte
    assert exchange(server, bytes(frame)) == p.encode_response(p.Status.INVALID), mutation
    assert client_for(server).try_get("key") is None


def test_values_at_the_caps_are_accepted(server, client) -> None:
    big = bytes(range(256)) * (p.MAX_VALUE // 256)
    client.set(b"k" * p.MAX_KEY, big)
    assert client.get(b"k" * p.MAX_KEY) == big
    client.append("a", big[:-1])
    client.append("a", b"!")
    assert client.get("a") == big[:-1] + b"!"
    reply = client.request(p.Op.APPEND, "a", b"?")
    assert reply.status == p.Status.TOO_LARGE
    assert client.get("a") == big[:-1] + b"!"


def test_store_limit_refuses_with_too_large_and_changes_nothing(make_server) -> None:
    server = make_server(max_store_bytes=1000)
    client = client_for(server)
    client.set("a", b"x" * 500)
    assert client.request(p.Op.SET, "b", b"y" * 500).status == p.Status.TOO_LARGE
    assert client.request(p.Op.APPEND, "a", b"y" * 500).status == p.Status.TOO_LARGE
    assert client.try_get("b") is None and client.get("a") == b"x" * 500
    client.set("a", b"z" * 800)  # replacing frees the old value first
    assert client.delete("a")
    client.set("b", b"y" * 800)
    assert server.stats().stored_bytes == 1 + 800 + server_mod.ENTRY_OVERHEAD


def test_inflight_budget_answers_internal_without_reading(make_server) -> None:
    budget = p.MAX_KEY + p.MAX_VALUE
    server = make_server(max_inflight_bytes=budget)
    client = client_for(server)
    header = p.pack_request_header(p.Op.SET, token_len=64, key_len=1, value_len=p.MAX_VALUE)
    with socket.create_connection((server.address, server.port), timeout=10) as slow:
        slow.sendall(header + TOKEN + b"k")  # authenticated, holds 16 MiB + 1 of the budget
        wait_until(lambda: server.stats().inflight_bytes == p.MAX_VALUE + 1, "the reservation")
        assert client.request(p.Op.SET, "x", b"v" * p.MAX_KEY).status == p.Status.INTERNAL
        client.set("small", b"fits")  # 5 + 4 bytes still fit in what is left
        slow.sendall(b"\0" * p.MAX_VALUE)
        assert p.decode_response_header(p.recv_exact(slow, 12)) == (p.Status.OK, 0)
    assert server.stats().inflight_bytes == 0
    assert len(client.get("k")) == p.MAX_VALUE


def test_large_replies_to_clients_that_do_not_read_share_the_inflight_budget(make_server) -> None:
    """A reply of a large value holds its bytes until the client reads them, even after a set replaced the
    value in the store: such replies have a budget as large as max_inflight_bytes, so memory stays bounded however
    many clients ask and never read (100 of them, each after a new 16 MiB set, used to hold 1.6 GB)."""
    budget = p.MAX_KEY + p.MAX_VALUE
    size = 4 << 20
    server = make_server(max_inflight_bytes=budget)
    client = client_for(server)
    readers = []
    try:
        for i in range(6):
            client.set("big", bytes([97 + i]) * size)  # each reader is answered with another value
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((server.address, server.port))
            sock.sendall(raw_request(p.Op.GET, b"big"))
            readers.append(sock)
            wait_until(lambda n=i: server.stats().requests >= 2 * (n + 1), "the get to be answered")
        assert server.stats().outbound_bytes == 4 * size <= budget
        client.set("big", b"small")
        for i, sock in enumerate(readers):
            status, length = p.decode_response_header(p.recv_exact(sock, 12))
            if i < 4:  # answered with the bytes stored when it asked
                assert (status, p.recv_exact(sock, length)) == (p.Status.OK, bytes([97 + i]) * size)
            else:  # no budget left: internal (transient), holding nothing
                assert (status, length) == (p.Status.INTERNAL, 0)
    finally:
        for sock in readers:
            sock.close()
    wait_until(lambda: server.stats().outbound_bytes == 0, "the budget to be released")
    assert client.get("big") == b"small"


# -- FAULTS 15: stalled clients ------------------------------------------------------------------


@pytest.mark.parametrize("sent", [14, 28 + 10, 28 + 64 + 2], ids=["half-header", "in-token", "in-body"])
def test_stalled_client_is_closed_by_the_read_deadline(make_server, sent) -> None:
    server = make_server(read_timeout=0.3, max_connections=4)
    client = client_for(server)
    frame = raw_request(p.Op.SET, b"key", b"value")
    stalled = socket.create_connection((server.address, server.port), timeout=20)
    try:
        stalled.sendall(frame[:sent])
        for i in range(20):  # others are served while it stalls
            client.set(f"k{i}", b"v")
            assert client.get(f"k{i}") == b"v"
        assert read_to_eof(stalled) == b""  # closed without a reply once the deadline passed
    finally:
        stalled.close()
    wait_until(lambda: server.stats().connections == 0, "the slot to be freed")
    assert server.stats().deadline_closes == 1
    assert client.try_get("key") is None


def test_a_stalled_client_in_the_only_slot_is_evicted(make_server) -> None:
    server = make_server(read_timeout=0.3, max_connections=1)
    stalled = socket.create_connection((server.address, server.port), timeout=20)
    try:
        stalled.sendall(b"CSKV\x01")
        wait_until(lambda: server.stats().connections == 1, "the stalled connection")
        # This request waits in the accept backlog until the stalled client loses the slot (its
        # deadline, or, sooner, an eviction once its grace is over).
        client_for(server, io_timeout=20).health()
        assert read_to_eof(stalled) == b""
    finally:
        stalled.close()
    stats = server.stats()
    assert stats.deadline_closes + stats.evicted_unauthenticated == 1


# -- FAULTS 16: listen address -------------------------------------------------------------------


def _outward_ip() -> str | None:
    """An address of this host that is not loopback (if it has one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 9))  # UDP connect sends nothing; it only picks a route
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


def test_default_bind_is_loopback_only(server) -> None:
    assert server.address == "127.0.0.1"
    assert server._listener.getsockname()[0] == "127.0.0.1"
    other = _outward_ip()
    if other is not None:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((other, server.port), timeout=5).close()
    client_for(server).health()


def test_all_interfaces_only_when_asked() -> None:
    with CoordinatorServer(FIXTURE_TOKEN, address="0.0.0.0") as server:
        assert server.address == "0.0.0.0"


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_ipv6_addresses_are_served() -> None:
    with CoordinatorServer(FIXTURE_TOKEN, address="::1") as server:
        assert server.address == "::1"
        server.start_thread()
        client_for(server).health()


@pytest.mark.parametrize("address", ["localhost", "", "example.org", "127.0.0.1:80"])
def test_names_are_refused_as_bind_addresses(address) -> None:
    with pytest.raises(ColdSnapError, match="not an IP address"):
        CoordinatorServer(FIXTURE_TOKEN, address=address)


def test_short_server_token_is_refused() -> None:
    with pytest.raises(ColdSnapError, match="token"):
        CoordinatorServer("short")


# -- connection behaviour and shutdown -----------------------------------------------------------


def test_one_request_per_connection(server) -> None:
    two = raw_request(p.Op.SET, b"a", b"1") + raw_request(p.Op.SET, b"b", b"2")
    with socket.create_connection((server.address, server.port), timeout=10) as sock:
        sock.sendall(two)
        reply = read_to_eof(sock)
    assert reply == p.encode_response(p.Status.OK)
    client = client_for(server)
    assert client.get("a") == b"1" and client.try_get("b") is None


def test_blocking_get_wakes_every_waiter(server, client) -> None:
    results = []

    def wait() -> None:
        results.append(client.get("ready", timeout=30))

    threads = [threading.Thread(target=wait) for _i in range(5)]
    for t in threads:
        t.start()
    wait_until(lambda: server.stats().waiting_gets == 5, "five waiters")
    client.append("ready", b"go")
    for t in threads:
        t.join(30)
    assert results == [b"go"] * 5
    assert server.stats().waiting_gets == 0


def test_add_wakes_a_waiter(server, client) -> None:
    results = []
    t = threading.Thread(target=lambda: results.append(client.get("n", timeout=30)))
    t.start()
    wait_until(lambda: server.stats().waiting_gets == 1, "the waiter")
    assert client.add("n", 7) == 7
    t.join(30)
    assert results == [b"7"]


def test_waiter_that_resets_frees_its_slot(server) -> None:
    sock = socket.create_connection((server.address, server.port), timeout=10)
    sock.sendall(raw_request(p.Op.GET, b"never", timeout_ms=600_000))
    wait_until(lambda: server.stats().waiting_gets == 1, "the waiter")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")  # close with RST
    sock.close()
    wait_until(lambda: server.stats().connections == 0, "the slot to be freed")
    assert server.stats().waiting_gets == 0


def test_half_closed_waiter_still_gets_its_reply(server, client) -> None:
    with socket.create_connection((server.address, server.port), timeout=10) as sock:
        sock.sendall(raw_request(p.Op.GET, b"later", timeout_ms=30_000))
        sock.shutdown(socket.SHUT_WR)
        wait_until(lambda: server.stats().waiting_gets == 1, "the waiter")
        client.set("later", b"v")
        assert read_to_eof(sock) == p.encode_response(p.Status.OK, b"v")


def test_shutdown_finishes_requests_in_flight_and_refuses_new_ones(server) -> None:
    frame = raw_request(p.Op.SET, b"k", b"v")
    with socket.create_connection((server.address, server.port), timeout=10) as sock:
        sock.sendall(frame[:10])
        wait_until(lambda: server.stats().connections == 1, "the connection")
        server.shutdown(wait=False)
        # The listener closes as soon as the loop sees the request; a connect racing the close
        # is reset by the kernel (it was in the accept queue), later ones are refused.
        with pytest.raises((ConnectionRefusedError, ConnectionResetError)):
            for _i in range(200):
                socket.create_connection((server.address, server.port), timeout=1).close()
                time.sleep(0.01)
        sock.sendall(frame[10:])
        assert read_to_eof(sock) == p.encode_response(p.Status.OK)


def test_shutdown_wait_returns_after_the_loop_ends(make_server) -> None:
    server = make_server()
    threads_before = {t.name for t in threading.enumerate()}
    assert f"cskv-{server.port}" in threads_before
    server.shutdown(timeout=10)
    assert server._stopped.is_set()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((server.address, server.port), timeout=5).close()


@pytest.mark.parametrize(("limits", "needle"), [
    ({"read_timeout": 0}, "read_timeout 0 must be finite and > 0"),
    ({"auth_timeout": float("nan")}, "auth_timeout nan must be finite and > 0"),
    ({"max_store_bytes": -5}, "max_store_bytes -5 must be >= 1"),
])
def test_server_limits_name_the_limit_that_is_wrong(limits, needle) -> None:
    from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.server import ServerLimits

    with pytest.raises(ColdSnapError, match=needle):
        ServerLimits(**limits)
