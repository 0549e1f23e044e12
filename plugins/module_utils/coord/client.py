"""CSKV v1 client: one TCP connection per request, nothing kept between calls.

The in-unit runtime calls this from engine processes and rank controllers that
CRIU checkpoints, so the client holds no socket between calls (every request
opens, sends, reads the reply and closes before returning) and starts no thread.

Retries: only establishing the connection is retried, and only when it is
refused (the server is not listening yet, or restarting), within a bounded
budget. Once a request byte has left, nothing is retried: ``add`` and
``append`` are not idempotent.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import time
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord import protocol as p
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.endpoint import (
    EndpointDescriptor,
    read_endpoint,
)

# Extra seconds the socket waits past a blocking get's own timeout for the reply.
_REPLY_MARGIN = 5.0
_RETRY_PAUSE = (0.01, 0.2)  # first and largest pause between refused connects


class CoordinatorError(ColdSnapError):
    """A coordinator request failed; ``status`` is the CSKV status when the server answered."""

    def __init__(self, message: str, *, fix: str | None = None, status: p.Status | None = None) -> None:
        super().__init__(message, fix=fix)
        self.status = status


class CoordinatorUnavailable(CoordinatorError):
    """No answer: connection refused/reset/timed out, or bytes that are not CSKV."""


class CoordinatorNotFound(CoordinatorError):
    """The key does not exist (get without wait, delete)."""


class CoordinatorTimeout(CoordinatorError):
    """A blocking get's wait expired before the key appeared."""


class CoordinatorUnauthorized(CoordinatorError):
    """The server refused the token."""


_ERROR_FOR_STATUS: dict[p.Status, tuple[type[CoordinatorError], str]] = {
    p.Status.NOT_FOUND: (CoordinatorNotFound, "check the key, or wait for it with a timeout"),
    p.Status.UNAUTHORIZED: (
        CoordinatorUnauthorized,
        "use the endpoint file of the running activation (the token changes with every start)",
    ),
    p.Status.INVALID: (CoordinatorError, "send a well-formed request (add takes a decimal int64 delta)"),
    p.Status.TIMEOUT: (CoordinatorTimeout, "wait longer, or check that the peer that sets the key is running"),
    p.Status.TOO_LARGE: (
        CoordinatorError,
        f"keep keys <= {p.MAX_KEY} bytes, values <= {p.MAX_VALUE} bytes and the store under its limit",
    ),
    p.Status.INTERNAL: (CoordinatorError, "retry; if the server is shutting down, restart the activation"),
}


def _b(data: bytes | bytearray | memoryview | str) -> bytes:
    return data.encode("utf-8") if isinstance(data, str) else bytes(data)


class CoordinatorClient:
    """Talk to one activation's coordinator; safe to copy into a CRIU-checkpointed process."""

    def __init__(
        self,
        endpoint: EndpointDescriptor,
        *,
        connect_timeout: float = 5.0,
        io_timeout: float = 30.0,
        connect_retry_s: float = 2.0,
        address: str | None = None,
    ) -> None:
        """``address`` overrides where to connect (e.g. a remote rank reaching a wildcard bind)."""
        self.endpoint = endpoint
        self.connect_timeout = connect_timeout
        self.io_timeout = io_timeout
        self.connect_retry_s = connect_retry_s
        self._address = address or endpoint.connect_address()
        self._family = socket.AF_INET6 if ":" in self._address else socket.AF_INET

    @classmethod
    def from_file(cls, path: Path | str, **kwargs: float | str | None) -> CoordinatorClient:
        """A client for the descriptor at ``path`` (must be mode 0600)."""
        return cls(read_endpoint(path), **kwargs)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"CoordinatorClient({self._address}:{self.endpoint.port}, scope={self.endpoint.scope!r})"

    # -- operations ---------------------------------------------------------------------------

    def health(self, *, wait_s: float | None = None) -> None:
        """Check that the server answers ``ok``; retry refused connects for ``wait_s`` seconds."""
        self._expect_ok(self.request(p.Op.HEALTH, retry_s=wait_s), "health", b"")

    def set(self, key: bytes | str, value: bytes | str) -> None:
        """Store ``value`` under ``key`` (replacing it) and wake blocked gets of that key."""
        self._expect_ok(self.request(p.Op.SET, key, value), "set", key)

    def get(self, key: bytes | str, timeout: float = 0.0) -> bytes:
        """The value of ``key``; with ``timeout`` > 0 wait up to that many seconds for it.

        Raises CoordinatorNotFound (no wait) or CoordinatorTimeout (wait expired).
        """
        timeout_ms = _timeout_ms(timeout)
        response = self.request(p.Op.GET, key, timeout_ms=timeout_ms)
        return self._expect_ok(response, "get", key)

    def try_get(self, key: bytes | str) -> bytes | None:
        """The value of ``key`` now, or None when it does not exist."""
        response = self.request(p.Op.GET, key)
        if response.status == p.Status.NOT_FOUND:
            return None
        return self._expect_ok(response, "get", key)

    def delete(self, key: bytes | str) -> bool:
        """Delete ``key``; False when it did not exist."""
        response = self.request(p.Op.DELETE, key)
        if response.status == p.Status.NOT_FOUND:
            return False
        self._expect_ok(response, "delete", key)
        return True

    def add(self, key: bytes | str, delta: int = 1) -> int:
        """Atomically add ``delta`` to the decimal int64 at ``key`` (missing = 0); the new total."""
        if isinstance(delta, bool) or not isinstance(delta, int) or not p.INT64_MIN <= delta <= p.INT64_MAX:
            raise CoordinatorError(f"add delta {delta!r} is not an int64", fix="pass an int in int64 range")
        response = self.request(p.Op.ADD, key, p.format_int64(delta))
        if response.status == p.Status.INVALID:  # the delta is checked above: the stored value is the cause
            raise CoordinatorError(
                f"{self}: add {_show(key)} answered invalid: the value stored there is not a decimal int64, or "
                f"adding {delta} would leave the int64 range",
                fix="add only to counter keys (keys that only add writes), within int64", status=response.status)
        value = self._expect_ok(response, "add", key)
        total = p.parse_int64(value)
        if total is None:
            raise CoordinatorUnavailable(
                f"{self}: add {_show(key)} answered {value[:32]!r}, not a decimal int64",
                fix="check that the endpoint is a ColdSnap CSKV v1 coordinator",
            )
        return total

    def append(self, key: bytes | str, value: bytes | str) -> None:
        """Append ``value`` to ``key`` atomically (a missing key is created)."""
        self._expect_ok(self.request(p.Op.APPEND, key, value), "append", key)

    # -- one request --------------------------------------------------------------------------

    def request(
        self,
        op: p.Op,
        key: bytes | str = b"",
        value: bytes | str = b"",
        *,
        timeout_ms: int = 0,
        retry_s: float | None = None,
    ) -> p.Response:
        """Send one request on a fresh connection and return the server's response (any status)."""
        try:
            frame = p.encode_request(op, self.endpoint.token_bytes, _b(key), _b(value), timeout_ms=timeout_ms)
        except (ValueError, UnicodeError) as exc:  # over a cap, or a key that is not text
            raise CoordinatorError(
                f"{self}: {p.Op(op).name.lower()} {_show(key)} cannot be sent: {exc}",
                fix=f"keep keys within {p.MAX_KEY} bytes and values within {p.MAX_VALUE} bytes (UTF-8 text or bytes)",
            ) from None
        reply_wait = self.io_timeout + (timeout_ms / 1000.0 + _REPLY_MARGIN if timeout_ms else 0.0)
        sock = self._connect(self.connect_retry_s if retry_s is None else retry_s)
        try:
            sock.settimeout(reply_wait)
            send_error: OSError | None = None
            try:
                sock.sendall(frame)
            except OSError as exc:
                # The server may have answered early (too-large, unauthorized) and
                # stopped reading; its reply can still be waiting in our buffer.
                send_error = exc
            try:
                status, length = p.decode_response_header(p.recv_exact(sock, p.RESPONSE_HEADER_SIZE))
                value_bytes = p.recv_exact(sock, length) if length else b""
            except p.ProtocolError as exc:
                raise CoordinatorUnavailable(
                    f"{self}: {p.Op(op).name.lower()} got a reply that is not CSKV v1 ({exc})",
                    fix="check that the endpoint file names a ColdSnap coordinator",
                ) from None
            except (OSError, ConnectionError) as exc:
                cause = send_error or exc
                raise CoordinatorUnavailable(
                    f"{self}: {p.Op(op).name.lower()} failed: {_describe(cause)}",
                    fix="check that the coordinator is running (coldsnap coordinator health)",
                ) from None
            return p.Response(status, value_bytes)
        finally:
            sock.close()

    def _connect(self, retry_s: float) -> socket.socket:
        deadline = time.monotonic() + max(0.0, retry_s)
        pause = _RETRY_PAUSE[0]
        while True:
            # The address is an IP literal (endpoint.check_address): no name lookup, one socket, one connect.
            sock = socket.socket(self._family, socket.SOCK_STREAM)
            try:
                sock.settimeout(self.connect_timeout)
                sock.connect((self._address, self.endpoint.port))
            except ConnectionRefusedError as exc:
                sock.close()
                if time.monotonic() + pause > deadline:
                    raise CoordinatorUnavailable(
                        f"{self}: connection refused ({_describe(exc)})",
                        fix="start the coordinator (coldsnap.fleet.coordinator state=started) "
                        "or check the endpoint file",
                    ) from None
                time.sleep(pause)
                pause = min(pause * 2, _RETRY_PAUSE[1])
                continue
            except OSError as exc:
                sock.close()
                raise CoordinatorUnavailable(
                    f"{self}: cannot connect ({_describe(exc)})",
                    fix="check the address/port in the endpoint file and the network path",
                ) from None
            except BaseException:
                sock.close()
                raise
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock

    def _expect_ok(self, response: p.Response, what: str, key: bytes | str) -> bytes:
        if response.status == p.Status.OK:
            return response.value
        cls, fix = _ERROR_FOR_STATUS[response.status]
        subject = f"{what} {_show(key)}" if what != "health" else what
        raise cls(f"{self}: {subject} answered {response.status.label}", fix=fix, status=response.status)

    def __str__(self) -> str:
        return f"coordinator {self._address}:{self.endpoint.port} (scope {self.endpoint.scope})"


def _timeout_ms(timeout: float) -> int:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < float("inf"):
        raise CoordinatorError(f"get timeout {timeout!r} is not a number of seconds >= 0",
                               fix="give a finite number of seconds >= 0 (0: answer at once)")
    if timeout == 0:
        return 0
    return min(p.U32_MAX, max(1, round(timeout * 1000)))


def _show(key: bytes | str) -> str:
    text = key if isinstance(key, str) else bytes(key).decode("utf-8", "backslashreplace")
    return repr(text if len(text) <= 80 else text[:77] + "...")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno:
        return f"{errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror}"
    if isinstance(exc, TimeoutError | socket.timeout):
        return "timed out waiting for the reply"
    return str(exc) or type(exc).__name__
