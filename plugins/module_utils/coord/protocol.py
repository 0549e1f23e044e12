"""CSKV version 1: the one definition of the coordinator's wire format.

Binary, big-endian, one request per TCP connection (DESIGN.md section 5):

request header, 28 bytes::

    [0:4]   b"CSKV"             magic
    [4]     1                   version
    [5]     op                  Op below
    [6:8]   0                   reserved, must be zero
    [8:12]  timeout_ms          only get uses it (blocking wait)
    [12:16] token length
    [16:20] key length
    [20:24] value length
    [24:28] total               token + key + value lengths (header excluded)

then token, key and value bytes. Response header, 12 bytes::

    [0:4] b"CSKV"  [4] version  [5] status  [6:8] 0  [8:12] value length

then the value. The server closes the connection after its reply.

This module is pure (no sockets, no I/O beyond the ``recv_exact`` helper): the
server, the client, the golden fixtures under tests/fixtures/cskv/ and any future
client are all checked against these functions.
"""

from __future__ import annotations

import enum
import re
import socket
import struct
from dataclasses import dataclass, field

from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.versions import CSKV_VERSION

MAGIC = b"CSKV"
VERSION = CSKV_VERSION

REQUEST_HEADER = struct.Struct(">4sBBHIIIII")
RESPONSE_HEADER = struct.Struct(">4sBBHI")
REQUEST_HEADER_SIZE = REQUEST_HEADER.size  # 28
RESPONSE_HEADER_SIZE = RESPONSE_HEADER.size  # 12

# Caps, enforced from the header before any body byte is read.
MAX_TOKEN = 1024
MAX_KEY = 64 * 1024
MAX_VALUE = 16 * 1024 * 1024
MIN_TOKEN = 16
U32_MAX = 2**32 - 1

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
# Decimal int64 on the wire: optional minus sign, 1..19 digits, nothing else.
_DECIMAL = re.compile(rb"-?[0-9]{1,19}\Z")


class Op(enum.IntEnum):
    """Request operations (byte 5 of the request header)."""

    SET = 1
    GET = 2
    DELETE = 3
    HEALTH = 4
    ADD = 5
    APPEND = 6


class Status(enum.IntEnum):
    """Response statuses (byte 5 of the response header)."""

    OK = 0
    NOT_FOUND = 1
    UNAUTHORIZED = 2
    INVALID = 3
    TIMEOUT = 4
    TOO_LARGE = 5
    INTERNAL = 6

    @property
    def label(self) -> str:
        """The status name as the docs and fixtures spell it (``not-found``)."""
        return self.name.lower().replace("_", "-")


OPS_BY_NAME = {op.name.lower(): op for op in Op}
STATUS_BY_LABEL = {status.label: status for status in Status}


class ProtocolError(Exception):
    """Bytes that are not a CSKV v1 frame (a response the client cannot trust)."""


@dataclass(frozen=True)
class RequestHeader:
    """The 28 request header bytes as numbers, before any check."""

    magic: bytes
    version: int
    op: int
    reserved: int
    timeout_ms: int
    token_len: int
    key_len: int
    value_len: int
    total: int

    @property
    def body_len(self) -> int:
        """Bytes that follow the header when ``total`` is honest."""
        return self.token_len + self.key_len + self.value_len


@dataclass(frozen=True)
class Request:
    """A decoded request. The token never appears in repr()."""

    op: Op
    key: bytes
    value: bytes = b""
    timeout_ms: int = 0
    token: bytes = field(default=b"", repr=False)


@dataclass(frozen=True)
class Response:
    """A decoded response."""

    status: Status
    value: bytes = b""


def _as_bytes(data: bytes | bytearray | memoryview | str, what: str) -> bytes:
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    raise TypeError(f"CSKV {what} must be bytes or str, got {type(data).__name__}")


def pack_request_header(
    op: int,
    *,
    token_len: int,
    key_len: int,
    value_len: int,
    timeout_ms: int = 0,
    total: int | None = None,
    magic: bytes = MAGIC,
    version: int = VERSION,
    reserved: int = 0,
) -> bytes:
    """Pack a raw request header. Every field can be set, so tests can build bad frames."""
    if total is None:
        total = token_len + key_len + value_len
    return REQUEST_HEADER.pack(magic, version, op, reserved, timeout_ms, token_len, key_len, value_len, total)


def encode_request(
    op: Op | int,
    token: bytes | str,
    key: bytes | str = b"",
    value: bytes | str = b"",
    *,
    timeout_ms: int = 0,
) -> bytes:
    """One complete request frame (header + token + key + value)."""
    token_b = _as_bytes(token, "token")
    key_b = _as_bytes(key, "key")
    value_b = _as_bytes(value, "value")
    if len(token_b) > MAX_TOKEN or len(key_b) > MAX_KEY or len(value_b) > MAX_VALUE:
        raise ValueError(
            f"CSKV request over its caps (token {len(token_b)}/{MAX_TOKEN}, key {len(key_b)}/{MAX_KEY}, "
            f"value {len(value_b)}/{MAX_VALUE} bytes); send a smaller key or value"
        )
    if not 0 <= timeout_ms <= U32_MAX:
        raise ValueError(f"CSKV timeout_ms {timeout_ms} is outside 0..{U32_MAX}")
    header = pack_request_header(
        int(op), token_len=len(token_b), key_len=len(key_b), value_len=len(value_b), timeout_ms=timeout_ms
    )
    return header + token_b + key_b + value_b


def decode_request_header(data: bytes | bytearray | memoryview) -> RequestHeader:
    """Unpack exactly 28 header bytes (no checks: see :func:`check_request_header`)."""
    if len(data) != REQUEST_HEADER_SIZE:
        raise ProtocolError(f"a CSKV request header is {REQUEST_HEADER_SIZE} bytes, got {len(data)}")
    return RequestHeader(*REQUEST_HEADER.unpack(bytes(data)))


def check_request_header(header: RequestHeader) -> Status | None:
    """The header checks in protocol order; None when the body may be read.

    1. magic, version, reserved, op, total != sum of lengths -> ``invalid``;
    2. any length over its cap -> ``too-large`` (decided from the header, so no
       body byte is read and no buffer is allocated for it).
    The token check (``unauthorized``) needs the token bytes and comes next.
    """
    if (
        header.magic != MAGIC
        or header.version != VERSION
        or header.reserved != 0
        or header.op not in _OP_VALUES
        or header.total != header.body_len
    ):
        return Status.INVALID
    if header.token_len > MAX_TOKEN or header.key_len > MAX_KEY or header.value_len > MAX_VALUE:
        return Status.TOO_LARGE
    return None


def decode_request(data: bytes | bytearray | memoryview) -> Request:
    """Decode one complete, well-formed request frame (fixtures, tools). Raises ProtocolError."""
    data = bytes(data)
    if len(data) < REQUEST_HEADER_SIZE:
        raise ProtocolError(f"a CSKV request is at least {REQUEST_HEADER_SIZE} bytes, got {len(data)}")
    header = decode_request_header(data[:REQUEST_HEADER_SIZE])
    problem = check_request_header(header)
    if problem is not None:
        raise ProtocolError(f"request header is refused with status {problem.label}")
    body = data[REQUEST_HEADER_SIZE:]
    if len(body) != header.body_len:
        raise ProtocolError(f"request body is {len(body)} bytes, header says {header.body_len}")
    t, k = header.token_len, header.token_len + header.key_len
    return Request(Op(header.op), key=body[t:k], value=body[k:], timeout_ms=header.timeout_ms, token=body[:t])


def encode_response_header(status: Status | int, value_len: int) -> bytes:
    """The 12-byte response header."""
    return RESPONSE_HEADER.pack(MAGIC, VERSION, int(status), 0, value_len)


def encode_response(status: Status | int, value: bytes = b"") -> bytes:
    """One complete response frame."""
    return encode_response_header(status, len(value)) + bytes(value)


def decode_response_header(data: bytes | bytearray | memoryview) -> tuple[Status, int]:
    """Check and unpack 12 response header bytes into (status, value length)."""
    if len(data) != RESPONSE_HEADER_SIZE:
        raise ProtocolError(f"a CSKV response header is {RESPONSE_HEADER_SIZE} bytes, got {len(data)}")
    magic, version, status, reserved, value_len = RESPONSE_HEADER.unpack(bytes(data))
    if magic != MAGIC or version != VERSION or reserved != 0:
        raise ProtocolError(
            f"not a CSKV v{VERSION} response (magic {magic!r}, version {version}, reserved {reserved})"
        )
    if status not in _STATUS_VALUES:
        raise ProtocolError(f"unknown CSKV status {status}")
    if value_len > MAX_VALUE:
        raise ProtocolError(f"response value of {value_len} bytes exceeds the {MAX_VALUE}-byte cap")
    return Status(status), value_len


def decode_response(data: bytes | bytearray | memoryview) -> Response:
    """Decode one complete response frame."""
    data = bytes(data)
    status, value_len = decode_response_header(data[:RESPONSE_HEADER_SIZE])
    value = data[RESPONSE_HEADER_SIZE:]
    if len(value) != value_len:
        raise ProtocolError(f"response value is {len(value)} bytes, header says {value_len}")
    return Response(status, value)


def parse_int64(data: bytes) -> int | None:
    """A strict decimal int64 (``-?[0-9]+``, in range), or None."""
    if not _DECIMAL.match(data):
        return None
    number = int(data)
    if not INT64_MIN <= number <= INT64_MAX:
        return None
    return number


def format_int64(number: int) -> bytes:
    """The decimal ASCII form of an int64, as ``add`` stores and returns it."""
    if not INT64_MIN <= number <= INT64_MAX:
        raise ValueError(f"{number} is outside int64")
    return str(number).encode("ascii")


def recv_exact(sock: socket.socket, size: int) -> bytes:
    """Read exactly ``size`` bytes from a blocking socket, or raise ConnectionError on EOF."""
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise ConnectionError(f"connection closed after {got} of {size} bytes")
        got += n
    return bytes(buf)


_OP_VALUES = frozenset(int(op) for op in Op)
_STATUS_VALUES = frozenset(int(s) for s in Status)
