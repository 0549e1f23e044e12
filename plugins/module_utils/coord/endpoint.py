"""The coordinator endpoint descriptor: where one activation's CSKV server listens.

A JSON file, mode 0600, written temp -> fsync -> rename::

    {"format": 1, "kind": "coldsnap-coordinator-endpoint", "address": "127.0.0.1",
     "port": 40123, "scope": "<operation id>", "token": "<64 hex chars>"}

``address`` is the address the server is bound to, ``scope`` the operation id of
the activation, ``token`` a fresh random secret per activation. The token is the
only secret here: it is kept out of repr()/str() and out of every log line.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import (
    atomic_write_json,
    check_private,
    make_private_dirs,
    planted_by_another,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.strictjson import (
    duplicates_of,
    strict_loads,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.versions import (
    ENDPOINT_FORMAT,
    ENDPOINT_KIND,
)

TOKEN_HEX_CHARS = 64
_TOKEN_RE = re.compile(r"[0-9a-f]{64}\Z")
_FIELDS = ("format", "kind", "address", "port", "scope", "token")
MAX_SCOPE = 256
MAX_DESCRIPTOR_BYTES = 64 * 1024


def new_token() -> str:
    """A fresh random token: 32 bytes from the OS CSPRNG as 64 lower-case hex chars."""
    return secrets.token_hex(TOKEN_HEX_CHARS // 2)


def check_address(address: str) -> str:
    """Return ``address`` normalised if it is an IP literal; hostnames are refused.

    A literal keeps "bind only to the configured address" exact: a name could
    resolve to several interfaces, or to a different one tomorrow.
    """
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        raise ColdSnapError(
            f"coordinator address {address!r} is not an IP address",
            fix="give an IP literal such as 127.0.0.1 (loopback) or the one interface address to listen on",
        ) from None
    mapped = getattr(ip, "ipv4_mapped", None)
    if mapped is not None:
        # ::ffff:0.0.0.0 listens on every IPv4 interface while it reads like one IPv6 address.
        raise ColdSnapError(f"coordinator address {address!r} is an IPv4 address written as IPv6",
                            fix=f"give the IPv4 address itself: {mapped}")
    return str(ip)


def check_scope(scope: Any) -> str:
    """``scope`` when it is a usable operation id (1..MAX_SCOPE printable characters), else ColdSnapError."""
    if not isinstance(scope, str) or not scope or len(scope) > MAX_SCOPE or not scope.isprintable():
        raise ColdSnapError(
            f"coordinator scope {scope!r} is not a usable operation id",
            fix=f"give the operation id: 1 to {MAX_SCOPE} printable characters",
        )
    return scope


@dataclass(frozen=True)
class EndpointDescriptor:
    """One activation's coordinator endpoint. ``token`` is secret and never printed."""

    address: str
    port: int
    scope: str
    token: str = field(repr=False)

    def __post_init__(self) -> None:
        check_address(self.address)
        check_scope(self.scope)
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 1 <= self.port <= 65535:
            raise ColdSnapError(
                f"coordinator endpoint port {self.port!r} is not a TCP port",
                fix="use the port the server actually listens on (1..65535)",
            )
        if not isinstance(self.token, str) or not _TOKEN_RE.match(self.token):
            # Never echo the value: it may be a real secret with a typo.
            raise ColdSnapError(
                "coordinator endpoint token is not 64 lower-case hex characters",
                fix="let the coordinator generate the endpoint file (coldsnap.fleet.coordinator state=started)",
            )

    def __str__(self) -> str:
        return f"coordinator {self.address}:{self.port} (scope {self.scope})"

    @property
    def token_bytes(self) -> bytes:
        """The token as it travels on the wire (its ASCII)."""
        return self.token.encode("ascii")

    def connect_address(self) -> str:
        """Where a client connects: the bind address, or loopback for a wildcard bind."""
        ip = ipaddress.ip_address(self.address)
        if ip.is_unspecified:
            return "::1" if ip.version == 6 else "127.0.0.1"
        return self.address

    def public(self) -> dict[str, Any]:
        """The descriptor without its token (safe for logs, module results, receipts)."""
        return {"address": self.address, "port": self.port, "scope": self.scope}

    def to_json(self) -> dict[str, Any]:
        """The full descriptor document, token included (only for the 0600 file)."""
        return {
            "format": ENDPOINT_FORMAT,
            "kind": ENDPOINT_KIND,
            "address": self.address,
            "port": self.port,
            "scope": self.scope,
            "token": self.token,
        }


def write_endpoint(path: Path | str, descriptor: EndpointDescriptor) -> Path:
    """Write the descriptor atomically (temp -> fsync -> rename -> dir fsync), mode 0600."""
    path = Path(path)
    make_private_dirs(path.parent)  # the directories it creates are private too
    atomic_write_json(path, descriptor.to_json(), mode=0o600)
    return path


def refuse_planted_endpoint(path: Path | str) -> None:
    """An endpoint file, or a directory above it, that another user made in a directory anyone may write
    to (``/tmp/cskv`` of uid 65534) is theirs to redirect: they could swap in a descriptor naming their
    own listener (which then receives every rank's keys) or, for a coordinator started there, the code
    it runs. Refused with ColdSnapError naming the component."""
    planted = planted_by_another(path)
    if planted is not None:
        cur, parent, uid = planted
        raise ColdSnapError(
            f"coordinator endpoint file {path}: {cur} belongs to uid {uid}, not to this user (uid {os.geteuid()}), "
            f"and lies in {parent}, which anyone may write to: that user could replace the descriptor or the "
            "coordinator's code",
            fix="keep endpoint files in a directory of your own (the default: the operation's run directory in "
                "the state root)")


def read_endpoint(path: Path | str) -> EndpointDescriptor:
    """Read and strictly validate a descriptor; refuse a file that group or others can read, or one
    another user planted (:func:`refuse_planted_endpoint`)."""
    path = Path(path)
    refuse_planted_endpoint(path)
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # before its mode is judged: /tmp is no endpoint file
            raise ColdSnapError(f"coordinator endpoint file {path} is not a regular file",
                                fix="point at the endpoint file the coordinator wrote")
        check_private(path)
        if os.path.getsize(path) > MAX_DESCRIPTOR_BYTES:
            raise ColdSnapError(
                f"coordinator endpoint file {path} is larger than {MAX_DESCRIPTOR_BYTES} bytes",
                fix="point at the endpoint file the coordinator wrote",
            )
        text = path.read_bytes()
    except FileNotFoundError:
        raise ColdSnapError(
            f"coordinator endpoint file {path} does not exist",
            fix="start the coordinator first (coldsnap.fleet.coordinator state=started) or fix the path",
        ) from None
    except OSError as exc:  # a directory, a file this user cannot read
        raise ColdSnapError(f"coordinator endpoint file {path} cannot be read: {exc.strerror or exc}",
                            fix="point at the endpoint file the coordinator wrote") from None
    doc = strict_loads(text, document=f"coordinator endpoint file {path}")
    return endpoint_from_json(doc, source=str(path))


def endpoint_from_json(doc: Any, *, source: str = "coordinator endpoint") -> EndpointDescriptor:
    """Validate a decoded descriptor document: exact fields, format and kind."""
    if not isinstance(doc, dict):
        raise ColdSnapError(f"{source} is not a JSON object", fix="point at the endpoint file the coordinator wrote")
    dups = duplicates_of(doc)
    unknown = sorted(set(doc) - set(_FIELDS))
    missing = [name for name in _FIELDS if name not in doc]
    if dups or unknown or missing:
        raise ColdSnapError(
            f"{source} has the wrong fields (missing {missing}, unknown {unknown}, duplicated {dups})",
            fix="rewrite it with the coordinator; the fields are " + ", ".join(_FIELDS),
        )
    # bool is an int subclass; JSON true must not pass as format 1
    fmt = doc["format"]
    if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt != ENDPOINT_FORMAT:
        raise ColdSnapError(
            f"{source} has format {doc['format']!r}; this ColdSnap reads format {ENDPOINT_FORMAT}",
            fix="restart the coordinator with this ColdSnap version",
        )
    if doc["kind"] != ENDPOINT_KIND:
        raise ColdSnapError(f"{source} has kind {doc['kind']!r}, expected {ENDPOINT_KIND!r}",
                            fix="point at a coordinator endpoint file")
    if not isinstance(doc["address"], str):
        raise ColdSnapError(f"{source}: address must be a string", fix="give an IP literal")
    return EndpointDescriptor(address=doc["address"], port=doc["port"], scope=doc["scope"], token=doc["token"])
