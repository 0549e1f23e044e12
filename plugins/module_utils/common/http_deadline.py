"""A deadline on an HTTP response's status line and headers, for the registry client and the peer transfer.

A read timeout bounds each read only: a server (or something between) that sends a header byte now and
then never reaches it, and holds the request, and whatever lock its caller holds, for as long as it keeps
going. Bodies are held to a rate floor (common.rate); the status line and headers, which come before any
body, get a deadline instead: all of them within ``HEADERS_WITHIN`` times the connection's timeout after
the request was sent. The first byte may still take up to one timeout (a registry that checks an upload
before answering); a live server sends the rest at once. When the deadline passes, the connection is shut
down under the waiting read and :class:`HeadersTooSlow` (an ``OSError``) is raised.

:class:`HTTPConnection` and :class:`HTTPSConnection` are ``http.client``'s with that deadline;
:func:`handlers` gives ``urllib.request`` handlers that use them.
"""

from __future__ import annotations

import http.client
import socket
import threading
import urllib.request
from typing import Any

HEADERS_WITHIN = 2  # times the connection's timeout


class HeadersTooSlow(OSError):
    """The response's status line and headers did not all come within the deadline."""


class _Watch:
    """Shuts ``sock`` down (both ways: the waiting read returns at once) unless cancelled within ``seconds``."""

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self.expired = False
        self._sock = sock
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        self.expired = True
        try:
            # The plain socket's shutdown, under TLS too: the TLS object stays as it is for its owner's thread.
            socket.socket.shutdown(self._sock, socket.SHUT_RDWR)
        except OSError:
            pass  # already closed

    def cancel(self) -> None:
        self._timer.cancel()


class _HeadersDeadline:
    """``getresponse`` within ``HEADERS_WITHIN`` times the connection's timeout (none without a timeout)."""

    timeout: Any
    sock: socket.socket | None

    def getresponse(self) -> http.client.HTTPResponse:
        timeout = self.timeout
        if self.sock is None or not isinstance(timeout, (int, float)) or timeout <= 0:
            return super().getresponse()  # type: ignore[misc]
        seconds = HEADERS_WITHIN * timeout
        watch = _Watch(self.sock, seconds)
        try:
            resp = super().getresponse()  # type: ignore[misc]
        except Exception:
            if watch.expired:
                raise HeadersTooSlow(_too_slow(seconds)) from None
            raise
        finally:
            watch.cancel()
        if watch.expired:  # the last header came as the deadline passed: the connection is gone all the same
            resp.close()
            raise HeadersTooSlow(_too_slow(seconds))
        return resp


def _too_slow(seconds: float) -> str:
    return (f"its status line and headers did not all come within {seconds:g} s of the request "
            "(a stalled or trickling server)")


class HTTPConnection(_HeadersDeadline, http.client.HTTPConnection):
    """``http.client.HTTPConnection`` whose response headers must come within the deadline."""


class HTTPSConnection(_HeadersDeadline, http.client.HTTPSConnection):
    """``http.client.HTTPSConnection`` whose response headers must come within the deadline."""


class _HTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(HTTPConnection, req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        how: dict[str, Any] = {"context": self._context}
        if hasattr(self, "_check_hostname"):  # Python 3.11 passes it on; later versions fold it into the context
            how["check_hostname"] = self._check_hostname
        return self.do_open(HTTPSConnection, req, **how)


def handlers() -> list[urllib.request.BaseHandler]:
    """``urllib.request`` handlers for http and https with the deadline (``build_opener`` then leaves its
    default ones out)."""
    return [_HTTPHandler(), _HTTPSHandler()]
