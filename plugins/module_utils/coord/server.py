"""The CSKV v1 coordinator server: one activation's authenticated key-value rendezvous.

This module is the socket loop and the process entry point; what each operation does to
the keys is :mod:`.kv`.

Design (stdlib only, one thread):

* a ``selectors`` event loop owns every socket and the whole store, so ``add`` and
  ``append`` are atomic without locks and a blocked ``get`` costs no thread;
* at most ``max_connections`` connections are open at once (a *slot* each); when
  all slots are taken the listener stops accepting and new clients wait in the
  kernel's accept backlog until a slot frees (backpressure, not an error);
* every connection has a deadline: the whole request (header + body) must arrive
  within ``read_timeout`` of the accept, a reply must drain within
  ``write_timeout``; a stalled client is closed without a reply and its slot freed;
* header checks run in protocol order before the body is read: ``invalid``, then
  ``too-large`` (decided from the header alone, so no buffer is ever sized from
  an unauthenticated length), then the token (<= 1 KiB) is read and compared in
  constant time; only an authenticated request gets a key/value buffer.

Memory policy (bounded, documented in docs/coordinator.md):

* stored bytes (sum of key + value + ``ENTRY_OVERHEAD`` per key) never exceed
  ``max_store_bytes``: a ``set``/``append``/``add`` that would cross it is refused
  with ``too-large`` and changes nothing; an ``append`` whose result would exceed
  the 16 MiB value cap is ``too-large`` too;
* bytes buffered for request bodies being received never exceed
  ``max_inflight_bytes``: a request that does not fit right now gets ``internal``
  (transient: retry later) before its body is read; large values (over 64 KiB)
  being sent to clients that have not read them yet have a budget of the same
  size (a value a slow reader still holds may have been replaced in the store):
  a ``get`` whose value does not fit right now gets ``internal`` too;
* unexpected failures while handling one request answer ``internal`` and close
  that connection only.

Shutdown: :meth:`CoordinatorServer.shutdown` stops accepting at once, answers
every blocked ``get`` with ``internal`` (the key never appeared; the server is
going away), lets requests already being received finish for up to
``shutdown_grace`` seconds, then closes what is left.

The process around it (descriptor, signals, daemonizing) is :mod:`.serve`.

Why one ~600-line unit: the loop is one state machine over every connection's phase
(header, token, body, wait, write, drain), its deadline timers and the slot count; split
across modules its invariants (a slot per connection, a deadline per phase, no buffer sized
before authentication) would no longer be visible in one place.
"""

from __future__ import annotations

import contextlib
import heapq
import hmac
import itertools
import resource
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord import protocol as p
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.endpoint import (
    check_address,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.kv import (  # noqa: F401  # pylint: disable=W0611
    ENTRY_OVERHEAD,
    KeyValueStore,
)

DEFAULT_ADDRESS = "127.0.0.1"
_SCRATCH_SIZE = 64 * 1024
_LISTEN_BACKLOG = 128
_DRAIN_LIMIT = p.MAX_TOKEN + p.MAX_KEY + p.MAX_VALUE + p.REQUEST_HEADER_SIZE

# Connection phases.
_HEADER, _TOKEN, _BODY, _WAIT, _WRITE, _DRAIN = range(6)


@dataclass(frozen=True)
class ServerLimits:
    """Every bound the server enforces (slots, deadlines, memory)."""

    max_connections: int = 512
    read_timeout: float = 10.0
    write_timeout: float = 10.0
    drain_timeout: float = 1.0
    shutdown_grace: float = 2.0
    max_store_bytes: int = 256 * 1024 * 1024
    max_inflight_bytes: int = 64 * 1024 * 1024
    # Header and token must arrive this soon after the accept: a client that authenticates
    # sends them at once; a stalled one is closed before it can hold a slot for long.
    auth_timeout: float = 2.0
    # Unauthenticated connections one source address may hold; beyond it its oldest stalled one
    # (connected longer than ``auth_grace`` and still short of its token) is closed.
    max_unauthenticated_per_source: int = 64
    auth_grace: float = 0.2
    # The coordinator of an activation whose controller died exits after this long with no
    # authenticated client (0: never; connections that never authenticate do not count). Phases
    # hold their waiting clients' connections open.
    idle_timeout: float = 3600.0

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ColdSnapError("coordinator max_connections must be >= 1", fix="give a positive slot count")
        if self.max_store_bytes < 1:
            raise ColdSnapError(f"coordinator max_store_bytes {self.max_store_bytes} must be >= 1",
                                fix="give the store's byte budget, e.g. 268435456")
        for name in ("read_timeout", "write_timeout", "drain_timeout", "auth_timeout"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ColdSnapError(f"coordinator {name} {getattr(self, name)!r} must be finite and > 0",
                                    fix="give positive seconds" + (" (coldsnap coordinator serve --read-timeout)"
                                                                   if name == "read_timeout" else ""))
        if not self.idle_timeout >= 0 or self.max_unauthenticated_per_source < 1:  # NaN fails the comparison
            raise ColdSnapError("coordinator idle_timeout must be >= 0 and the per-source limit >= 1",
                                fix="give 0 (never) or positive seconds, and a positive count")
        if self.max_inflight_bytes < p.MAX_KEY + p.MAX_VALUE:
            raise ColdSnapError(
                f"coordinator max_inflight_bytes {self.max_inflight_bytes} cannot hold one maximal request",
                fix=f"give at least {p.MAX_KEY + p.MAX_VALUE} bytes",
            )


@dataclass(frozen=True)
class ServerStats:
    """A snapshot of the server's counters (no keys, no values, no token)."""

    connections: int
    peak_connections: int
    waiting_gets: int
    keys: int
    stored_bytes: int
    inflight_bytes: int
    outbound_bytes: int  # bytes of large values in replies clients have not read yet
    requests: int
    statuses: dict[str, int]
    deadline_closes: int
    evicted_unauthenticated: int = 0


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    phase: int = _HEADER
    buf: bytearray = field(default_factory=lambda: bytearray(p.REQUEST_HEADER_SIZE))
    got: int = 0
    header: p.RequestHeader | None = None
    token: bytes = b""
    reserved: int = 0
    sending: int = 0  # bytes of a large value this connection's reply still holds
    out: list[memoryview] = field(default_factory=list)
    request_complete: bool = False
    wait_key: bytes | None = None
    deadline: float = 0.0
    timer_gen: int = 0
    drained: int = 0
    events: int = 0
    source: str = ""
    accepted: float = 0.0


class CoordinatorServer:
    """A CSKV v1 server bound at construction (so its port is known before serving)."""

    def __init__(
        self,
        token: str | bytes,
        *,
        address: str = DEFAULT_ADDRESS,
        port: int = 0,
        limits: ServerLimits | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        token_b = token.encode("ascii") if isinstance(token, str) else bytes(token)
        if len(token_b) < p.MIN_TOKEN or len(token_b) > p.MAX_TOKEN:
            raise ColdSnapError(
                f"coordinator token must be {p.MIN_TOKEN}..{p.MAX_TOKEN} bytes",
                fix="use endpoint.new_token() (64 hex characters)",
            )
        self._token = token_b
        self.limits = limits or ServerLimits()
        self._max_conns = _clamp_to_fd_limit(self.limits.max_connections)
        self._log = log or (lambda _msg: None)
        address = check_address(address)
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ColdSnapError(f"coordinator port {port!r} is not 0..65535", fix="give 0 for an ephemeral port")
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with contextlib.suppress(OSError):
                # Accepted sockets inherit it on Linux: replies (often header and value in two
                # sends) are never held back waiting for an ACK.
                self._listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._listener.bind((address, port))
            self._listener.listen(_LISTEN_BACKLOG)
        except OSError as exc:
            self._listener.close()
            raise ColdSnapError(
                f"coordinator cannot listen on {address}:{port}: {exc.strerror or exc}",
                fix="choose a free port (0 picks one) and an address of this host",
            ) from None
        self._listener.setblocking(False)
        self._bound: tuple[str, int] = self._listener.getsockname()[:2]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._accepting = True
        self._conns: set[_Conn] = set()
        self._kv = KeyValueStore(self.limits.max_store_bytes)
        self._inflight = 0
        self._outbound = 0
        self._timers: list[tuple[float, int, int, _Conn]] = []
        self._seq = itertools.count()
        self._scratch = memoryview(bytearray(_SCRATCH_SIZE))
        self._stop_requested = False
        self._stopping_since: float | None = None
        self._serving = threading.Event()
        self._stopped = threading.Event()
        self._closed = False
        self._loop_thread: int | None = None
        self._requests = 0
        self._peak = 0
        self._deadline_closes = 0
        self._statuses = dict.fromkeys((s.label for s in p.Status), 0)
        # Connections that have not authenticated yet, oldest first (dicts keep insertion order).
        self._preauth: dict[_Conn, None] = {}
        self._preauth_by_source: dict[str, int] = {}
        self._evicted = 0
        self._last_activity = time.monotonic()

    # -- public -------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The address the listening socket is bound to (from getsockname at bind time)."""
        return self._bound[0]

    @property
    def port(self) -> int:
        """The TCP port the listening socket is bound to."""
        return self._bound[1]

    @property
    def max_connections(self) -> int:
        """The slot count actually used (the configured one, clamped to the fd limit)."""
        return self._max_conns

    def stats(self) -> ServerStats:
        """Counters for tests, benchmarks and status (never keys, values or the token)."""
        return ServerStats(
            connections=len(self._conns),
            peak_connections=self._peak,
            waiting_gets=self._kv.waiting,
            keys=len(self._kv),
            stored_bytes=self._kv.stored_bytes,
            inflight_bytes=self._inflight,
            outbound_bytes=self._outbound,
            requests=self._requests,
            statuses=dict(self._statuses),
            deadline_closes=self._deadline_closes,
            evicted_unauthenticated=self._evicted,
        )

    def serve_forever(self) -> None:
        """Run the event loop until :meth:`shutdown`; then close every socket."""
        if self._closed:
            raise ColdSnapError("coordinator server is already closed", fix="create a new CoordinatorServer")
        self._loop_thread = threading.get_ident()
        self._serving.set()
        try:
            while not self._loop_once():
                pass
        finally:
            self._close_all()
            self._stopped.set()

    def wakeup_fileno(self) -> int:
        """The write end of the loop's wake-up socket (for ``signal.set_wakeup_fd``)."""
        return self._wake_w.fileno()

    def start_thread(self) -> threading.Thread:
        """Serve in a daemon thread (tests, benchmarks, in-process use); returns the thread."""
        thread = threading.Thread(target=self.serve_forever, name=f"cskv-{self.port}", daemon=True)
        thread.start()
        self._serving.wait()
        return thread

    def shutdown(self, *, wait: bool = True, timeout: float | None = None) -> None:
        """Stop gracefully (see the module doc). Safe from another thread or a signal handler."""
        self._stop_requested = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if not wait:
            return
        if not self._serving.is_set():
            self._close_all()  # never served: nothing to drain
        elif threading.get_ident() != self._loop_thread:
            self._stopped.wait(timeout)

    def __enter__(self) -> CoordinatorServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- event loop ---------------------------------------------------------------------------

    def _loop_once(self) -> bool:
        """One select round; True when the loop is finished."""
        now = time.monotonic()
        # Idle: no authenticated client for idle_timeout (connections that never authenticate do not count,
        # so whoever can reach the port cannot keep an abandoned coordinator alive).
        if (self.limits.idle_timeout and len(self._conns) == len(self._preauth) and self._stopping_since is None
                and now - self._last_activity >= self.limits.idle_timeout):
            self._log(f"coordinator idle for {self.limits.idle_timeout:.0f}s (its operation is gone): exiting")
            self._stop_requested = True
        if self._stop_requested and self._stopping_since is None:
            self._begin_stop(now)
        if self._stopping_since is not None:
            if not self._conns or now - self._stopping_since >= self.limits.shutdown_grace:
                return True
        timeout = self._next_timeout(now)
        for key, mask in self._sel.select(timeout):
            if key.data == "listen":
                self._accept()
            elif key.data == "wake":
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
            else:
                conn = key.data
                if conn not in self._conns:
                    continue  # closed earlier in this round (its fd may already be reused)
                try:
                    if mask & selectors.EVENT_READ:
                        self._on_readable(conn)
                    if mask & selectors.EVENT_WRITE and conn in self._conns:
                        self._flush(conn)
                except Exception as exc:
                    self._fail(conn, exc)
        self._fire_timers(time.monotonic())
        if not self._accepting and self._stopping_since is None and self._preauth:
            # Every slot is taken: once the oldest unauthenticated client has had its grace, it makes room.
            self._evict_preauth(None)
        return False

    def _next_timeout(self, now: float) -> float | None:
        while self._timers and self._timers[0][2] != self._timers[0][3].timer_gen:
            heapq.heappop(self._timers)
        candidates = []
        if self._timers:
            candidates.append(max(0.0, self._timers[0][0] - now))
        if self._stopping_since is not None:
            candidates.append(max(0.0, self._stopping_since + self.limits.shutdown_grace - now))
        elif self.limits.idle_timeout and len(self._conns) == len(self._preauth):
            candidates.append(max(0.0, self._last_activity + self.limits.idle_timeout - now))
        if not self._accepting and self._preauth:
            oldest = next(iter(self._preauth))
            candidates.append(max(0.0, oldest.accepted + self.limits.auth_grace - now))
        # Never sleep long: a stop request is seen within a second even if its wake-up byte is lost.
        candidates.append(1.0)
        return min(candidates)

    def _begin_stop(self, now: float) -> None:
        self._stopping_since = now
        if self._accepting:
            self._sel.unregister(self._listener)
            self._accepting = False
        self._listener.close()  # new clients get "connection refused" at once
        for conn in self._kv.take_all_waiters():
            conn.wait_key = None
            self._reply(conn, p.Status.INTERNAL)
        self._log("coordinator shutting down")

    def _accept(self) -> None:
        while True:
            if len(self._conns) >= self._max_conns and not self._evict_preauth(None):
                break
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # EMFILE and friends: keep serving the connections we have.
                self._log(f"coordinator accept failed: {exc.strerror or exc}")
                return
            sock.setblocking(False)
            now = time.monotonic()
            source = str(addr[0]) if isinstance(addr, tuple) and addr else ""
            if self._preauth_by_source.get(source, 0) >= self.limits.max_unauthenticated_per_source:
                self._evict_preauth(source)
            conn = _Conn(sock, source=source, accepted=now)
            self._conns.add(conn)
            self._preauth[conn] = None
            self._preauth_by_source[source] = self._preauth_by_source.get(source, 0) + 1
            self._peak = max(self._peak, len(self._conns))
            self._set_deadline(conn, now + min(self.limits.read_timeout, self.limits.auth_timeout))
            # A client sends its request right after connecting, so it is often here already:
            # serve it now, and only watch the socket for what has not arrived.
            try:
                self._on_readable(conn)
            except Exception as exc:
                self._fail(conn, exc)
            if conn in self._conns and conn.events == 0 and conn.phase in (_HEADER, _TOKEN, _BODY):
                self._watch(conn, selectors.EVENT_READ)
        if self._accepting:
            # Every slot is taken by authenticated clients: leave new ones in the backlog until one frees.
            self._sel.unregister(self._listener)
            self._accepting = False

    def _evict_preauth(self, source: str | None) -> bool:
        """Free a slot held by a stalled client: the oldest connection (of ``source``, or of anyone) that
        has been open longer than ``auth_grace`` and, once whatever it already sent is read, still has
        not authenticated. A flood of half-sent headers cannot keep authenticated clients waiting, and
        a busy server never drops a client whose request is merely unread. False when none is stalled."""
        now = time.monotonic()
        for conn in list(self._preauth):
            if source is not None and conn.source != source:
                continue
            if now - conn.accepted < self.limits.auth_grace:
                return False  # oldest first: every later one is younger still
            if conn.phase in (_HEADER, _TOKEN) and conn in self._conns:
                self._on_readable(conn)
            if conn not in self._conns:
                return True  # reading it finished (or ended) it: its slot is free
            if conn in self._preauth:
                self._evicted += 1
                self._close(conn)
                return True
        return False

    def _read_pending(self, conn: _Conn) -> bool:
        """Read what a connection has already sent; True when that moved it past authentication."""
        self._on_readable(conn)
        return conn in self._conns and conn not in self._preauth

    def _authenticated(self, conn: _Conn) -> None:
        if conn in self._preauth:
            del self._preauth[conn]
            left = self._preauth_by_source.get(conn.source, 1) - 1
            if left > 0:
                self._preauth_by_source[conn.source] = left
            else:
                self._preauth_by_source.pop(conn.source, None)

    def _watch(self, conn: _Conn, events: int) -> None:
        if conn.events == events:
            return
        if conn.events == 0:
            self._sel.register(conn.sock, events, conn)
        elif events == 0:
            self._sel.unregister(conn.sock)
        else:
            self._sel.modify(conn.sock, events, conn)
        conn.events = events

    def _set_deadline(self, conn: _Conn, deadline: float) -> None:
        conn.timer_gen += 1
        conn.deadline = deadline
        heapq.heappush(self._timers, (deadline, next(self._seq), conn.timer_gen, conn))
        if len(self._timers) > 4 * len(self._conns) + 1024:
            # Superseded deadlines linger until they expire; drop them so the heap
            # stays proportional to the open connections, not to the request rate.
            self._timers = [t for t in self._timers if t[2] == t[3].timer_gen and t[3] in self._conns]
            heapq.heapify(self._timers)

    def _fire_timers(self, now: float) -> None:
        while self._timers and self._timers[0][0] <= now:
            _deadline, _seq, gen, conn = heapq.heappop(self._timers)
            if gen != conn.timer_gen or conn not in self._conns:
                continue
            if conn.phase == _WAIT:
                self._unwait(conn)
                self._reply(conn, p.Status.TIMEOUT)
            elif conn.phase in (_HEADER, _TOKEN) and self._read_pending(conn):
                continue  # its request was only unread (a busy loop): it goes on with a new deadline
            else:
                # Stalled reader, writer that does not read, or drain done: free the slot.
                if conn.phase in (_HEADER, _TOKEN, _BODY, _WRITE):
                    self._deadline_closes += 1
                self._close(conn)

    # -- reading ------------------------------------------------------------------------------

    def _on_readable(self, conn: _Conn) -> None:
        if conn.phase == _DRAIN:
            self._drain(conn)
            return
        if conn.phase == _WAIT:
            # EOF may be a half-close (a client that shut down its sending side and
            # still reads): keep waiting, stop watching. A reset means the waiter is
            # gone; more bytes break "one request per connection". Both free the slot.
            try:
                n = conn.sock.recv_into(self._scratch, 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                n = -1
            if n == 0:
                self._watch(conn, 0)
                return
            self._unwait(conn)
            self._close(conn)
            return
        # Keep reading while the request's next part is already here: one select
        # wake-up usually carries header, token and body together.
        while conn.phase in (_HEADER, _TOKEN, _BODY) and conn in self._conns:
            want = len(conn.buf) - conn.got
            if want:
                try:
                    n = conn.sock.recv_into(memoryview(conn.buf)[conn.got:], want)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:
                    self._close(conn)
                    return
                if n == 0:
                    self._close(conn)  # the client gave up before sending a whole request
                    return
                conn.got += n
                if conn.got < len(conn.buf):
                    return
            if conn.phase == _HEADER:
                self._header_done(conn)
            elif conn.phase == _TOKEN:
                self._token_done(conn)
            else:
                self._body_done(conn)

    def _header_done(self, conn: _Conn) -> None:
        header = p.decode_request_header(conn.buf)
        conn.header = header
        problem = p.check_request_header(header)
        if problem is not None:
            self._reply(conn, problem)
            return
        self._start_phase(conn, _TOKEN, header.token_len)

    def _start_phase(self, conn: _Conn, phase: int, size: int) -> None:
        # An empty part (no token, no key and value) completes at once in the read loop.
        conn.phase = phase
        conn.buf = bytearray(size)
        conn.got = 0

    def _token_done(self, conn: _Conn) -> None:
        token = bytes(conn.buf)
        # compare_digest runs in time independent of where the bytes differ.
        if len(token) < p.MIN_TOKEN or not hmac.compare_digest(token, self._token):
            self._reply(conn, p.Status.UNAUTHORIZED)
            return
        header = conn.header
        if header is None:  # an invariant: the header is parsed before any body byte is read
            raise AssertionError("CSKV connection has a body but no header")
        size = header.key_len + header.value_len
        if self._inflight + size > self.limits.max_inflight_bytes:
            self._reply(conn, p.Status.INTERNAL)  # transient: other bodies hold the budget
            return
        conn.reserved = size
        self._inflight += size
        self._authenticated(conn)
        # Authenticated: the body may take the full read deadline (counted from the accept).
        self._set_deadline(conn, conn.accepted + self.limits.read_timeout)
        self._start_phase(conn, _BODY, size)

    def _body_done(self, conn: _Conn) -> None:
        header = conn.header
        if header is None:  # an invariant: the header is parsed before any body byte is read
            raise AssertionError("CSKV connection has a body but no header")
        body = bytes(conn.buf)
        conn.buf = bytearray()
        self._release(conn)
        conn.request_complete = True
        key, value = body[: header.key_len], body[header.key_len :]
        self._requests += 1
        self._dispatch(conn, p.Op(header.op), key, value, header.timeout_ms)

    def _release(self, conn: _Conn) -> None:
        self._inflight -= conn.reserved
        conn.reserved = 0

    def _sent(self, conn: _Conn) -> None:
        self._outbound -= conn.sending
        conn.sending = 0

    # -- operations ---------------------------------------------------------------------------

    def _dispatch(self, conn: _Conn, op: p.Op, key: bytes, value: bytes, timeout_ms: int) -> None:
        if op == p.Op.HEALTH:
            self._reply(conn, p.Status.OK if not key and not value else p.Status.INVALID)
        elif op == p.Op.GET:
            self._op_get(conn, key, value, timeout_ms)
        else:
            status, reply, woken = self._kv.apply(op, key, value)
            if woken:
                # A barrier's release wakes every rank at once: send all the replies first, so
                # the last waiter does not also wait for the others' connections to close.
                sent = []
                for waiter, stored in woken:
                    waiter.wait_key = None
                    if self._reply(waiter, p.Status.OK, stored, finish=False):
                        sent.append(waiter)
                for waiter in sent:
                    self._reply_sent(waiter)
            self._reply(conn, status, reply)

    def _op_get(self, conn: _Conn, key: bytes, value: bytes, timeout_ms: int) -> None:
        if value:
            self._reply(conn, p.Status.INVALID)
            return
        found = self._kv.get(key)
        if found is not None:
            self._reply(conn, p.Status.OK, found)
        elif timeout_ms == 0:
            self._reply(conn, p.Status.NOT_FOUND)
        elif self._stopping_since is not None:
            self._reply(conn, p.Status.INTERNAL)
        else:
            conn.phase = _WAIT
            conn.wait_key = key
            self._kv.wait(key, conn)
            self._watch(conn, selectors.EVENT_READ)  # to notice a waiter that hangs up
            self._set_deadline(conn, time.monotonic() + timeout_ms / 1000.0)

    def _unwait(self, conn: _Conn) -> None:
        key = conn.wait_key
        if key is None:
            return
        conn.wait_key = None
        self._kv.unwait(key, conn)

    # -- writing ------------------------------------------------------------------------------

    def _reply(self, conn: _Conn, status: p.Status, value: bytes = b"", *, finish: bool = True) -> bool:
        """Answer ``conn``; True when the whole reply went out at once and, with ``finish=False``,
        the caller still has to call ``_reply_sent`` (which closes or drains the connection)."""
        self._release(conn)
        if len(value) > _SCRATCH_SIZE:
            # A large value goes out from the stored bytes, which a later set may replace while a slow
            # reader still holds them: such replies have a budget of their own, as large as the bodies'.
            if self._outbound + len(value) > self.limits.max_inflight_bytes:
                status, value = p.Status.INTERNAL, b""  # transient: other replies hold the budget
            else:
                conn.sending = len(value)
                self._outbound += len(value)
        self._statuses[status.label] += 1
        conn.buf = bytearray()
        conn.phase = _WRITE
        header = p.encode_response_header(status, len(value))
        # Small replies go out in one segment; large values are sent from the stored bytes.
        conn.out = [memoryview(header + value)] if len(value) <= _SCRATCH_SIZE else [
            memoryview(header), memoryview(value)]
        return self._flush(conn, finish=finish)

    def _flush(self, conn: _Conn, *, finish: bool = True) -> bool:
        while conn.out:
            try:
                sent = conn.sock.send(conn.out[0])
            except (BlockingIOError, InterruptedError):
                if conn.events != selectors.EVENT_WRITE:
                    # The client reads slowly: from now on it has write_timeout to take the rest.
                    self._set_deadline(conn, time.monotonic() + self.limits.write_timeout)
                    self._watch(conn, selectors.EVENT_WRITE)
                return False
            except OSError:
                self._close(conn)
                return False
            if sent < len(conn.out[0]):
                conn.out[0] = conn.out[0][sent:]
            else:
                conn.out.pop(0)
        self._sent(conn)  # the reply is out: its bytes no longer count
        if finish:
            self._reply_sent(conn)
        return True

    def _reply_sent(self, conn: _Conn) -> None:
        if conn.request_complete and not self._unread_bytes(conn):
            self._close(conn)
            return
        # We answered before reading the whole request (invalid, too-large,
        # unauthorized...), or the client sent more than one request. Closing now
        # with unread bytes would send a RST that can destroy the reply in flight,
        # so half-close and discard what still comes, into a shared scratch
        # buffer, for a bounded time and byte count.
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_WR)
        conn.phase = _DRAIN
        conn.drained = 0
        self._watch(conn, selectors.EVENT_READ)
        self._set_deadline(conn, time.monotonic() + self.limits.drain_timeout)

    def _unread_bytes(self, conn: _Conn) -> bool:
        try:
            return bool(conn.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except OSError:  # EAGAIN: nothing pending; anything else: closing is all that is left
            return False

    def _drain(self, conn: _Conn) -> None:
        try:
            n = conn.sock.recv_into(self._scratch)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        conn.drained += n
        if n == 0 or conn.drained > _DRAIN_LIMIT:
            self._close(conn)

    # -- closing ------------------------------------------------------------------------------

    def _fail(self, conn: _Conn, exc: Exception) -> None:
        self._log(f"coordinator request failed: {type(exc).__name__}")
        if conn not in self._conns:
            return
        self._unwait(conn)
        if conn.phase in (_HEADER, _TOKEN, _BODY, _WAIT):
            try:
                self._reply(conn, p.Status.INTERNAL)
                return
            except Exception:
                pass
        self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if conn not in self._conns:
            return
        if conn not in self._preauth:
            self._last_activity = time.monotonic()  # an authenticated client's request ended
        self._authenticated(conn)  # no longer counted as waiting to authenticate
        self._conns.discard(conn)
        self._release(conn)
        self._sent(conn)
        self._unwait(conn)
        conn.timer_gen += 1
        conn.out = []
        conn.buf = bytearray()
        if conn.events:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(conn.sock)
            conn.events = 0
        conn.sock.close()
        if not self._accepting and self._stopping_since is None and len(self._conns) < self._max_conns:
            self._sel.register(self._listener, selectors.EVENT_READ, "listen")
            self._accepting = True

    def _close_all(self) -> None:
        if self._closed:
            return
        self._stopping_since = self._stopping_since or time.monotonic()
        for conn in list(self._conns):
            self._close(conn)
        self._timers.clear()
        with contextlib.suppress(OSError):
            self._listener.close()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()
        self._kv.clear()
        self._closed = True


def _clamp_to_fd_limit(wanted: int) -> int:
    """Leave room under RLIMIT_NOFILE for the listener, the wake pair and the log."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - 32))
