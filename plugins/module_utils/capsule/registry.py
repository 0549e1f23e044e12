"""A small OCI distribution client (push and pull by digest) on the standard library only.

Used for OCI-layout capsules, which live on hosts that may have no Docker: blob
HEAD, monolithic upload (POST then PUT ``?digest=``), manifest PUT and GET, blob
GET. Every byte that comes back is hashed against the digest that named it.

Authentication follows the registry's ``WWW-Authenticate`` challenge: Basic
with username/password, or Bearer with a token fetched from the named realm (with
the same credentials, or a given identity/registry token). Credentials are never
logged, never put into an exception message, and never written to disk.
"""

from __future__ import annotations

import base64
import http.client
import ipaddress
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.http_deadline import (
    HeadersTooSlow,
    handlers,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.rate import MIN_RATE, RateFloor
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import identifiers as ids

USER_AGENT = "coldsnap-capsule-client/1"
ERROR_BODY_LIMIT = 4096


class RegistryError(ColdSnapError):
    """The registry refused or failed a request (status, registry error code, message)."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None,
                 fix: str | None = None) -> None:
        self.status = status
        self.code = code
        super().__init__(message, fix=fix)


@dataclass(frozen=True)
class Repository:
    """``host[:port]/path`` split into its registry and its repository name."""

    registry: str
    name: str

    @property
    def full(self) -> str:
        return f"{self.registry}/{self.name}"


def parse_repository(repository: str) -> Repository:
    """Split a repository reference; the registry host must be explicit (nothing defaults to a public hub)."""
    if not isinstance(repository, str) or not re.fullmatch(ids.REPOSITORY, repository):
        raise ColdSnapError(f"capsule repository {repository!r} is not a valid repository reference",
                            fix="write it as 'registry.example:5000/coldsnap/capsules' (no tag, no digest)")
    head, sep, rest = repository.partition("/")
    if not sep or not ("." in head or ":" in head or head == "localhost"):
        raise ColdSnapError(f"capsule repository {repository!r} does not name its registry host",
                            fix="prefix the registry, e.g. 'registry.example:5000/" + repository + "'")
    return Repository(head, rest)


def split_repository_digest(value: str) -> tuple[str, str]:
    """``repo@sha256:<hex>`` -> (repo, digest); tags are refused (they are mutable)."""
    repo, sep, digest = (value or "").partition("@")
    if not sep:
        raise ColdSnapError(f"capsule reference {value!r} is not pinned by digest", fix=ids.IMAGE_REF_FIX)
    ids.parse_digest(digest, what=f"digest of {value!r}")
    last = repo.rsplit("/", 1)[-1]
    if ":" in last:
        raise ColdSnapError(f"capsule reference {value!r} carries a tag besides its digest",
                            fix="use 'repository@sha256:<hex>' only")
    parse_repository(repo)
    return repo, digest


def _is_loopback(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.startswith("[") else host[1:].split("]", maxsplit=1)[0]
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _sep, rest = header.strip().partition(" ")
    params = dict(re.findall(r'(\w+)="([^"]*)"', rest))
    return scheme.lower(), params


def _origin(url: str) -> tuple[str, str, int | None]:
    """Scheme, host and port (the scheme's default when none is written) of ``url``."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port or {"http": 80, "https": 443}.get(scheme)
    except ValueError:  # not a port: compares unlike any real origin
        port = -1
    return scheme, (parts.hostname or "").lower(), port


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Uploads must not be replayed elsewhere by urllib (a PUT body is a stream). A GET or HEAD follows
    its redirect, with the credentials only to the same scheme, host and port: never to object
    storage (signed URLs) nor over plain http from https on the same host."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: PLR0917 - urllib's signature
        if req.get_method() in ("GET", "HEAD"):
            new = super().redirect_request(req, fp, code, msg, headers, newurl)
            if new is not None and _origin(newurl) != _origin(req.full_url):
                new.remove_header("Authorization")
            return new
        return None


class RegistryTooSlow(RegistryError):
    """A response that kept coming, but slower than the client allows: a body under the minimum rate, or a
    status line and headers past their deadline."""


_TOO_SLOW_FIX = "check the network path to the registry and the registry's load, and run again; nothing was cached"


class _Body:
    """A response body whose transport failures (a connection reset or cut short, a read that timed out)
    are a RegistryError naming the registry, what was read and how far, never a bare socket or HTTP error.

    It is read one receive at a time, so that a body trickled below the rate floor (``common.rate``) is a
    RegistryTooSlow: a read of a whole chunk would wait for as long as the trickle lasts, each byte
    arriving within the socket's timeout."""

    def __init__(self, resp: Any, registry: str, what: str, *, window: float = 120.0,
                 min_rate: float = MIN_RATE) -> None:
        self.resp, self.registry, self.what = resp, registry, what
        self.got = 0
        self.floor = RateFloor(window, min_rate)

    def read(self, n: int = -1) -> bytes:
        parts, got = [], 0
        while n is None or n < 0 or got < n:
            data = self._read1(1 << 20 if n is None or n < 0 else n - got)
            if not data:
                break
            parts.append(data)
            got += len(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _read1(self, n: int) -> bytes:
        try:
            data = self.resp.read1(n)
        except (OSError, http.client.HTTPException) as exc:
            got = self.got + len(getattr(exc, "partial", b"") or b"")  # what IncompleteRead held back
            raise RegistryError(f"the connection to registry {self.registry} broke while {self.what} after "
                                f"{got} bytes ({type(exc).__name__}: {exc})",
                                fix="check the network and the registry, and run again; nothing was cached") from None
        self.got += len(data)
        slow = self.floor.count(len(data)) if data else None
        if slow is not None:
            raise RegistryTooSlow(f"registry {self.registry} is too slow while {self.what} (after {self.got} "
                                  f"bytes): {slow}", code="TOO_SLOW",
                                  fix=_TOO_SLOW_FIX)
        return data

    def close(self) -> None:
        self.resp.close()

    def __enter__(self) -> _Body:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RegistryClient:
    """One repository on one registry."""

    def __init__(self, repository: str, *, auth: dict[str, Any] | None = None, insecure: bool | None = None,
                 timeout: float = 120.0, min_rate: float = MIN_RATE) -> None:
        self.repo = parse_repository(repository)
        self.min_rate = min_rate
        plain = _is_loopback(self.repo.registry) if insecure is None else insecure
        self.base = f"{'http' if plain else 'https'}://{self.repo.registry}"
        self._auth = dict(auth or {})
        self._authorization: str | None = None
        self.timeout = timeout
        # Response headers within twice the timeout (common.http_deadline); bodies above a rate floor (_Body).
        self._opener = urllib.request.build_opener(_NoRedirect(), *handlers())

    # ------------------------------------------------------------------ plumbing
    def _url(self, path: str) -> str:
        if path.startswith(("http://", "https://")):
            return path
        return self.base + path

    def request(self, method: str, path: str, *, headers: dict[str, str] | None = None,
                body: Callable[[], IO[bytes] | bytes] | None = None, expect: tuple[int, ...] = (200,),
                what: str, scope: str = "pull") -> Any:
        """Send one request (re-sent once after an auth challenge); return the open response."""
        for attempt in range(2):
            req = urllib.request.Request(self._url(path), method=method, data=body() if body else None)
            req.add_header("User-Agent", USER_AGENT)
            for k, v in (headers or {}).items():
                req.add_header(k, v)
            if self._authorization and self._same_origin(req.full_url):
                # Never to another host (an upload's Location may be object storage) nor over another scheme.
                req.add_header("Authorization", self._authorization)
            try:
                resp = self._opener.open(req, timeout=self.timeout)
            except urllib.error.HTTPError as exc:
                if exc.code == 401 and not self._same_origin(exc.geturl()):
                    # A redirect's target (object storage, a CDN) asking for credentials: its challenge is never
                    # answered, or the registry's credentials would go to whatever realm it names.
                    exc.close()
                    elsewhere = urllib.parse.urlsplit(exc.geturl()).netloc
                    how = "sent" if urllib.parse.urlsplit(req.full_url).netloc == elsewhere else "redirected"
                    raise RegistryError(f"registry {self.repo.registry} {how} {method} to {elsewhere}, which "
                                        f"asks for credentials while {what}; they are given only to the registry "
                                        "itself", status=401, code="UNAUTHORIZED",
                                        fix="have the registry redirect to URLs that carry their own signature "
                                            "(or serve blobs itself)") from None
                if exc.code == 401 and attempt == 0 and self._answer_challenge(exc.headers, scope):
                    exc.close()
                    continue
                if exc.code == 401 and attempt == 1:  # the challenge was answered with our credentials
                    exc.close()
                    break
                if exc.code in expect:
                    return exc
                raise self._error(exc, method, what) from None
            except HeadersTooSlow as exc:
                raise RegistryTooSlow(f"registry {self.repo.registry} is too slow while {what}: {exc}",
                                      code="TOO_SLOW", fix=_TOO_SLOW_FIX) from None
            except (urllib.error.URLError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                raise RegistryError(f"registry {self.repo.registry} is unreachable while {what} ({reason})",
                                    fix="check the registry address and that it is running") from None
            if resp.status not in expect:
                resp.close()
                raise RegistryError(f"registry {self.repo.registry} answered {resp.status} while {what}",
                                    status=resp.status, fix="check the registry's logs")
            return resp
        raise RegistryError(f"registry {self.repo.registry} refused the credentials while {what}",
                            status=401, code="UNAUTHORIZED",
                            fix="check the registry credentials (they are never logged)")

    def _same_origin(self, url: str) -> bool:
        return _origin(url) == _origin(self.base)

    def _answer_challenge(self, headers: Any, scope: str) -> bool:
        challenge = headers.get("WWW-Authenticate") if headers else None
        if not challenge:
            return False
        scheme, params = _parse_challenge(challenge)
        user, password = self._auth.get("username"), self._auth.get("password")
        if scheme == "basic":
            if not (user and password):
                return False
            self._authorization = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
            return True
        if scheme != "bearer" or "realm" not in params:
            return False
        direct = self._auth.get("registrytoken") or self._auth.get("token")
        if direct:
            self._authorization = f"Bearer {direct}"
            return True
        realm = urllib.parse.urlsplit(params["realm"])
        if realm.scheme not in ("http", "https") or (realm.scheme == "http" and self.base.startswith("https:")):
            return False  # credentials never go to a realm over plain http from an https registry
        query = {"service": params.get("service", "")}
        wanted = params.get("scope") or f"repository:{self.repo.name}:{scope}"
        query["scope"] = wanted
        req = urllib.request.Request(params["realm"] + "?" + urllib.parse.urlencode(query))
        req.add_header("User-Agent", USER_AGENT)
        if user and password:
            req.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
        elif self._auth.get("identitytoken"):
            req = urllib.request.Request(params["realm"], method="POST", data=urllib.parse.urlencode({
                "grant_type": "refresh_token", "refresh_token": self._auth["identitytoken"],
                "service": query["service"], "scope": wanted, "client_id": "coldsnap"}).encode())
        try:
            # A redirect of the realm keeps the credentials only within its scheme, host and port (_NoRedirect).
            with self._opener.open(req, timeout=self.timeout) as resp:
                doc = json.loads(resp.read(1 << 20))
        except (urllib.error.URLError, OSError, ValueError):
            return False
        token = doc.get("token") or doc.get("access_token")
        if not token:
            return False
        self._authorization = f"Bearer {token}"
        return True

    def _error(self, exc: urllib.error.HTTPError, method: str, what: str) -> RegistryError:
        code = message = None
        try:
            doc = json.loads(exc.read(ERROR_BODY_LIMIT) or b"{}")
            first = (doc.get("errors") or [{}])[0]
            code, message = first.get("code"), first.get("message")
        except (ValueError, AttributeError, OSError):
            pass
        finally:
            exc.close()
        detail = f"{exc.code} {code or exc.reason}" + (f": {message}" if message else "")
        if exc.code in (401, 403):
            fix = "supply credentials that may push/pull this repository (registry auth options; never logged)"
        elif exc.code == 405 or code == "UNSUPPORTED":
            fix = "the registry does not accept this operation (read-only or maintenance mode?); ask its operator"
        elif exc.code == 404:
            fix = "check the repository name and that the capsule was published there"
        else:
            fix = "check the registry's logs and retry"
        return RegistryError(f"registry {self.repo.registry} refused {method} while {what}: {detail}",
                             status=exc.code, code=code, fix=fix)

    # ------------------------------------------------------------------ operations
    def blob_exists(self, digest: str, size: int | None = None) -> bool:
        ids.parse_digest(digest, what="blob digest")
        resp = self.request("HEAD", f"/v2/{self.repo.name}/blobs/{digest}", expect=(200, 404),
                            what=f"checking blob {digest}")
        with resp:
            if resp.status == 404:
                return False
            length = resp.headers.get("Content-Length")
            # a length that is no number proves nothing about the blob: it is uploaded again (and verified)
            return size is None or length is None or (length.strip().isdigit() and int(length) == size)

    def upload_blob(self, digest: str, size: int, opener: Callable[[], IO[bytes] | bytes], *, what: str) -> None:
        """Monolithic upload: POST an upload session, then PUT the whole blob with ``?digest=``."""
        ids.parse_digest(digest, what="blob digest")
        resp = self.request("POST", f"/v2/{self.repo.name}/blobs/uploads/", expect=(202,),
                            headers={"Content-Length": "0"}, body=lambda: b"", what=f"starting upload of {what}",
                            scope="pull,push")
        with resp:
            location = resp.headers.get("Location")
        if not location:
            raise RegistryError(f"registry {self.repo.registry} gave no upload location for {what}",
                                fix="the registry does not speak the OCI distribution API")
        location = urllib.parse.urljoin(self.base + "/", location)
        sep = "&" if "?" in location else "?"
        resp = self.request("PUT", f"{location}{sep}digest={urllib.parse.quote(digest)}", expect=(201,),
                            headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
                            body=opener, what=f"uploading {what}", scope="pull,push")
        with resp:
            got = resp.headers.get("Docker-Content-Digest")
        if got and got != digest:
            raise RegistryError(f"registry {self.repo.registry} stored {what} as {got}, expected {digest}",
                                fix="the registry altered the bytes; do not use it")

    def put_manifest(self, reference: str, data: bytes, media_type: str, *, what: str) -> str:
        resp = self.request("PUT", f"/v2/{self.repo.name}/manifests/{urllib.parse.quote(reference, safe=':')}",
                            expect=(201,), headers={"Content-Type": media_type, "Content-Length": str(len(data))},
                            body=lambda: data, what=f"storing the manifest of {what}", scope="pull,push")
        with resp:
            return resp.headers.get("Docker-Content-Digest") or ""

    def get_manifest(self, reference: str, accept: tuple[str, ...], *, what: str, limit: int = 4 << 20) -> bytes:
        resp = self.request("GET", f"/v2/{self.repo.name}/manifests/{urllib.parse.quote(reference, safe=':')}",
                            headers={"Accept": ", ".join(accept)}, what=f"fetching the manifest of {what}")
        with self._body(resp, f"fetching the manifest of {what}") as body:
            data = body.read(limit + 1)
        if len(data) > limit:
            raise RegistryError(f"manifest of {what} is larger than {limit} bytes", fix="this is not a capsule")
        return data

    def manifest_exists(self, digest: str, accept: tuple[str, ...]) -> bool:
        resp = self.request("HEAD", f"/v2/{self.repo.name}/manifests/{digest}", headers={"Accept": ", ".join(accept)},
                            expect=(200, 404), what=f"checking manifest {digest}")
        with resp:
            return resp.status == 200

    def open_blob(self, digest: str, *, what: str) -> Any:
        ids.parse_digest(digest, what="blob digest")
        resp = self.request("GET", f"/v2/{self.repo.name}/blobs/{digest}", what=f"downloading {what}")
        return self._body(resp, f"downloading {what}")

    def _body(self, resp: Any, what: str) -> _Body:
        return _Body(resp, self.repo.registry, what, window=self.timeout, min_rate=self.min_rate)
