"""Request authentication of the peer transfer server: HMAC-SHA256 over the request, keyed by a
token the control node generated for this transfer only.

The token never travels: each request carries a fresh nonce and
``HMAC(token, method \\n path \\n range \\n nonce)``; the server refuses a bad MAC and a
nonce it has already seen (a replayed request). What moves in the clear is the
file's bytes, which the receiver checks against their digest.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from collections import OrderedDict

NONCE_HEADER = "X-ColdSnap-Nonce"
MAC_HEADER = "X-ColdSnap-Auth"
MIN_TOKEN_CHARS = 32
_MAX_NONCES = 100_000


def check_token(token: object, *, what: str = "transfer token") -> str:
    """The token as given; ValueError saying why it cannot be used."""
    if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS or not token.isprintable():
        raise ValueError(f"the {what} must be a printable string of at least {MIN_TOKEN_CHARS} characters")
    return token


def sign(token: str, method: str, path: str, range_header: str, nonce: str) -> str:
    message = "\n".join((method, path, range_header, nonce)).encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def request_headers(token: str, method: str, path: str, range_header: str = "") -> dict[str, str]:
    """The headers that authenticate one request."""
    nonce = secrets.token_hex(16)
    headers = {NONCE_HEADER: nonce, MAC_HEADER: sign(token, method, path, range_header, nonce)}
    if range_header:
        headers["Range"] = range_header
    return headers


class Verifier:
    """Checks requests against one token; remembers nonces so none is accepted twice."""

    def __init__(self, token: str) -> None:
        self._token = check_token(token)
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def verify(self, method: str, path: str, range_header: str, nonce: str | None, mac: str | None) -> bool:
        if not nonce or not mac or len(nonce) != 32 or len(mac) != 64:
            return False
        if not mac.isascii() or not hmac.compare_digest(sign(self._token, method, path, range_header, nonce), mac):
            return False
        with self._lock:
            if nonce in self._seen:
                return False
            self._seen[nonce] = None
            while len(self._seen) > _MAX_NONCES:
                self._seen.popitem(last=False)
        return True
