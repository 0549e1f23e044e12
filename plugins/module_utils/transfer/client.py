"""The receiving side of a peer transfer: authenticated, resumable, digest-verified on arrival.

Bytes land in a partial file next to their final name and reach the final name only after
their size and SHA-256 matched. A dropped connection resumes where it stopped (``Range``);
a partial file left by an earlier, interrupted run is hashed and continued, so a re-run
after a failure moves only what is missing; a partial that turns out not to be a prefix of
the file (the digest differs at the end) is thrown away and the file fetched once more from
its first byte.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import re
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common import fsutil, http_deadline
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.rate import RateFloor
from ansible_collections.coldsnap.fleet.plugins.module_utils.transfer import auth
from ansible_collections.coldsnap.fleet.plugins.module_utils.transfer.server import (
    LIST_PATH,
    digest_in_name,
    file_url_path,
)

PARTIAL_SUFFIX = ".peer-partial"
CHUNK = 4 << 20
MAX_LISTING = 16 << 20  # a capsule's layout lists a few dozen files
_HEX64 = re.compile(r"[0-9a-f]{64}")  # a listed SHA-256 (transfer sits below formats: its own pattern)
Progress = Callable[[int, int], None]


class PeerUnreachable(ColdSnapError):
    """No transfer server answered at the peer's address and port."""


@dataclass(frozen=True)
class Peer:
    """Where a transfer server listens, and the token of this transfer (never shown)."""

    address: str
    port: int
    token: str = field(repr=False)
    timeout: float = 60.0
    attempts: int = 5

    def __post_init__(self) -> None:
        if not self.address or isinstance(self.port, bool) or not isinstance(self.port, int) \
                or not 0 < self.port < 65536:
            raise ColdSnapError(f"transfer server {self.address!r}:{self.port!r} is not an address and a port "
                                "1..65535", fix="give the address and port transfer_serve returned")

    def describe(self) -> str:
        return f"peer {self.address}:{self.port}"

    def _connect(self) -> http.client.HTTPConnection:
        # The response's headers within twice the timeout (common.http_deadline), its body above a rate floor.
        return http_deadline.HTTPConnection(self.address, self.port, timeout=self.timeout)

    def request(self, path: str, range_header: str = "") -> tuple[Any, Any]:
        """Send one signed GET; returns ``(connection, response)`` (the caller closes the connection)."""
        conn = self._connect()
        try:
            conn.request("GET", path, headers=auth.request_headers(self.token, "GET", path, range_header))
            resp = conn.getresponse()
        except OSError as exc:
            conn.close()
            raise ConnectionError(f"{self.describe()}: {exc.strerror or exc}") from None
        except http.client.HTTPException as exc:
            conn.close()
            raise ConnectionError(f"{self.describe()}: {type(exc).__name__}: {exc}") from None
        if resp.status == 403:
            conn.close()
            raise ColdSnapError(f"{self.describe()} refused the transfer (authentication failed)",
                                fix="the server was started for another transfer; run the operation again")
        return conn, resp

    def listing(self) -> list[dict[str, Any]]:
        conn, resp = self._retrying(lambda: self.request(LIST_PATH))
        try:
            body = resp.read(MAX_LISTING + 1)
        finally:
            conn.close()
        if len(body) > MAX_LISTING:
            raise ColdSnapError(f"{self.describe()} sent a file listing larger than {MAX_LISTING >> 20} MiB",
                                fix="the source is not a ColdSnap transfer server")
        if resp.status != 200:
            raise ColdSnapError(f"{self.describe()} answered {resp.status} to the file listing",
                                fix="read the transfer server's log on the source host")
        try:
            files = json.loads(body)["files"]
        except (ValueError, TypeError, KeyError, RecursionError):
            files = None
        if not isinstance(files, list):
            raise ColdSnapError(f"{self.describe()} sent a file listing that is not a JSON list of files",
                                fix="the source is not a ColdSnap transfer server")
        return [f for f in files if isinstance(f, dict)]

    def _retrying(self, call):
        delay = 0.5
        for attempt in range(1, self.attempts + 1):
            try:
                return call()
            except ConnectionError as exc:
                if attempt == self.attempts:
                    raise PeerUnreachable(
                        f"cannot reach {exc} (after {attempt} attempt{'s' if attempt > 1 else ''})",
                        fix="let the destination reach the source host's transfer address and port (set "
                            "coldsnap_transfer_address / coldsnap_transfer_port), or restore with weights mode "
                            "'auto' to fall back to the pinned safetensors") from None
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")


@dataclass(frozen=True)
class Fetched:
    path: Path
    size: int
    sha256: str
    bytes_received: int
    resumed_from: int


def partial_path(final: Path) -> Path:
    return final.with_name(f".{final.name}{PARTIAL_SUFFIX}")


def fetch_file(peer: Peer, name: str, partial: Path, *, size: int | None, sha256: str | None,
               progress: Progress | None = None) -> Fetched:
    """Fetch ``name`` into ``partial`` (resuming it) and check it; the caller renames it into place.

    ``sha256`` (hex) and ``size`` are what the file must be; without them the file's name
    states its digest or the server's listing gave one.
    """
    for restart in (False, True):
        resumed_from = _existing(partial, size)
        hasher = hashlib.sha256()
        if resumed_from:
            with open(partial, "rb") as f:
                while chunk := f.read(CHUNK):
                    hasher.update(chunk)
        try:
            received = _download(peer, name, partial, offset=resumed_from, size=size, hasher=hasher,
                                 progress=progress)
        except IntegrityError:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()  # what an answer that is not this file left is not kept for a resume
            raise
        total = resumed_from + received
        if size is not None and total != size:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()
            raise IntegrityError(f"{name} from {peer.describe()} has {total} bytes, expected {size}",
                                 fix="the source host's copy is not this file; capture again")
        actual = hasher.hexdigest()
        if sha256 is None or actual == sha256:
            return Fetched(partial, total, actual, received, resumed_from)
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
        if resumed_from and not restart:
            continue  # the partial was not a prefix of this file: fetch it once more from byte 0
        raise IntegrityError(f"{name} from {peer.describe()} hashes to sha256:{actual}, expected sha256:{sha256}",
                             fix="the source host's copy is corrupt; verify it there (coldsnap payload verify) "
                                 "or capture again")
    raise AssertionError("unreachable")


def _existing(partial: Path, size: int | None) -> int:
    try:
        st = os.lstat(partial)
    except FileNotFoundError:
        return 0
    if not os.path.isfile(partial) or os.path.islink(partial) or (size is not None and st.st_size > size):
        partial.unlink()
        return 0
    return st.st_size


def _download(peer: Peer, name: str, partial: Path, *, offset: int, size: int | None, hasher,
              progress: Progress | None) -> int:
    """Append the file's bytes from ``offset``; reconnects and resumes on a dropped connection."""
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    received = 0
    try:
        for attempt in range(1, peer.attempts + 1):
            position = offset + received
            if size is not None and position == size and size > 0:
                break
            try:
                received += _one_response(peer, name, fd, position=position, hasher=hasher, progress=progress,
                                          size=size)
                break
            except ConnectionError as exc:
                received += getattr(exc, "got", 0)  # what arrived before the drop is kept and hashed
                if attempt == peer.attempts:
                    raise ColdSnapError(
                        f"transfer of {name} from {exc} failed after {attempt} attempts "
                        f"({offset + received} bytes are kept in {partial}; the next run resumes there)",
                        fix="make the source host reachable from this host (a stalled or trickling source: check "
                            "its load and the network path) and run the operation again") from None
                time.sleep(min(0.5 * 2 ** (attempt - 1), 5.0))
        os.fsync(fd)
    finally:
        os.close(fd)
    return received


def _one_response(peer: Peer, name: str, fd: int, *, position: int, hasher, progress: Progress | None,
                  size: int | None) -> int:
    range_header = f"bytes={position}-" if position else ""
    conn, resp = peer.request(file_url_path(name), range_header)
    got = 0
    try:
        if resp.status == 404:
            raise ColdSnapError(f"{peer.describe()} does not serve {name}",
                                fix="the source host lacks the file; capture again or restore elsewhere")
        if resp.status not in (200, 206) or (position and resp.status != 206):
            raise ColdSnapError(f"{peer.describe()} answered {resp.status} for {name}: "
                                f"{resp.read(200).decode(errors='replace').strip()}",
                                fix="read the transfer server's log on the source host")
        length = resp.getheader("Content-Length")
        if length is not None and not (length.isascii() and length.isdigit() and len(length) <= 20):
            raise IntegrityError(f"{peer.describe()} answered for {name} with Content-Length {length[:40]!r}, "
                                 "not a byte count", fix="the source is not a ColdSnap transfer server; check "
                                 "the transfer address and port")
        expected = -1 if length is None else int(length)
        if size is not None and expected != size - position:
            # Never more than the listing said: an answer that does not match is refused unread (whoever
            # answers at that address could otherwise fill the disk).
            raise IntegrityError(f"{peer.describe()} offered {expected} bytes of {name} from byte {position}; "
                                 f"the file has {size}", fix="the source is not serving this file; capture again")
        total = size if size is not None else position + max(expected, 0)
        floor = RateFloor(peer.timeout)  # a source trickling below it is a stalled one (common.rate)
        while True:
            want = CHUNK if expected < 0 else min(CHUNK, expected - got)
            if want <= 0:
                break
            try:
                chunk = resp.read1(want)  # what one read brings: a trickle is seen, not waited for in full
            except (OSError, http.client.HTTPException) as exc:
                raise ConnectionError(f"{peer.describe()}: {exc}") from None
            if not chunk:
                break
            _write_all(fd, chunk)  # kept and hashed even when too slow, as a dropped connection's bytes are
            hasher.update(chunk)
            got += len(chunk)
            slow = floor.count(len(chunk))
            if slow is not None:
                raise ConnectionError(f"{peer.describe()}: {name} came too slowly: {slow}")
            if progress is not None:
                progress(position + got, total)
        if expected >= 0 and got != expected:
            raise ConnectionError(f"{peer.describe()}: the connection ended after {got} of {expected} bytes")
        return got
    except ConnectionError as exc:
        # what arrived is kept (it is appended and hashed): the caller resumes after it
        raise _Dropped(str(exc), got) from None
    finally:
        conn.close()


class _Dropped(ConnectionError):
    """The connection ended early; ``got`` bytes of this response were written."""

    def __init__(self, message: str, got: int) -> None:
        super().__init__(message)
        self.got = got


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def fetch_tree(peer: Peer, dest: Path | str, *, progress: Progress | None = None) -> dict[str, Any]:
    """Bring every file the server lists into ``dest`` (same relative names); resumable, verified.

    The files gather in a private sibling (``.<dest>.peer-partial``, kept across runs: what arrived and
    verified stays) that becomes ``dest`` only once every file is in: a pull cut short never leaves half a
    tree under the final name. Files already verified at ``dest`` are linked in, not fetched again. No
    path is created or written through a symbolic link.
    """
    dest = Path(dest)
    files = _checked_listing(peer)
    total = sum(int(f["size"]) for f in files)
    if dest.is_dir() and not dest.is_symlink() and all(
            _is_verified(dest / str(f["name"]), int(f["size"]), _digest_of(f)) for f in files):  # stops at the first
        return {"files": len(files), "fetched": [], "bytes_received": 0, "bytes": total, "changed": False}
    stage = dest.with_name(f".{dest.name}{PARTIAL_SUFFIX}")
    _real_dir(stage)
    done = 0
    fetched: list[str] = []
    received = 0
    for entry in files:
        name, size = str(entry["name"]), int(entry["size"])
        digest = _digest_of(entry)
        final = stage / name
        _real_dirs_below(stage, name)
        if not _is_verified(final, size, digest) and _is_verified(dest / name, size, digest):
            with contextlib.suppress(OSError):
                final.unlink(missing_ok=True)
                os.link(dest / name, final, follow_symlinks=False)
        if _is_verified(final, size, digest):
            done += size
            continue
        base = done

        def step(d: int, _t: int, base: int = base) -> None:
            if progress is not None:
                progress(base + d, total)

        got = fetch_file(peer, name, partial_path(final), size=size, sha256=digest, progress=step)
        os.chmod(got.path, 0o600)
        os.replace(got.path, final)
        fsutil.fsync_dir(final.parent)
        fetched.append(name)
        received += got.bytes_received
        done += size
    old = None
    kept: list[str] = []
    mode = None
    if dest.is_dir() and not dest.is_symlink():
        kept = _carry_over(dest, stage, {str(f["name"]) for f in files})
        mode = stat.S_IMODE(dest.stat().st_mode)
    if dest.exists() or dest.is_symlink():
        old = dest.with_name(f".{dest.name}.replaced-{os.getpid()}")
        os.rename(dest, old)
    os.rename(stage, dest)
    if mode is not None:
        os.chmod(dest, mode)
    fsutil.fsync_dir(dest.parent)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    # ``dest`` was created or replaced, even when every file had arrived before (a pull cut short at the end)
    return {"files": len(files), "fetched": fetched, "bytes_received": received, "bytes": total, "kept": kept,
            "changed": True}


def _carry_over(dest: Path, stage: Path, served: set[str]) -> list[str]:
    """Bring what ``dest`` holds besides the served files into ``stage`` (hard links, symbolic links as
    they are), so the swap loses nothing of it; their names. Refused before anything is swapped when
    something cannot be carried over."""
    kept = []
    for root, dirs, names in os.walk(dest):
        rel_root = Path(root).relative_to(dest)
        for name in sorted(names + [d for d in dirs if (Path(root) / d).is_symlink()]):
            rel = (rel_root / name).as_posix()
            if rel in served:
                continue
            src, target = Path(root) / name, stage / rel
            st = os.lstat(src)
            try:
                if target.exists() or target.is_symlink():
                    there = os.lstat(target)
                    if (there.st_dev, there.st_ino) == (st.st_dev, st.st_ino) or (
                            stat.S_ISLNK(st.st_mode) and stat.S_ISLNK(there.st_mode)
                            and os.readlink(src) == os.readlink(target)):
                        continue  # carried over by an earlier pull that was cut short
                    if stat.S_ISLNK(st.st_mode):
                        continue  # a link where the served tree has a directory: the served tree wins
                    raise OSError(0, "the served files use that path")
                _real_dirs_below(stage, rel)
                if stat.S_ISLNK(st.st_mode):
                    os.symlink(os.readlink(src), target)
                elif stat.S_ISREG(st.st_mode):
                    os.link(src, target, follow_symlinks=False)
                else:
                    raise OSError(0, "not a regular file or a link")
            except OSError as exc:
                raise ColdSnapError(f"{src} is not part of what the source serves and cannot be kept "
                                    f"({exc.strerror or exc})", fix=f"move it out of {dest}, or fetch into a "
                                    "directory of its own") from None
            kept.append(rel)
        dirs[:] = [d for d in dirs if not (Path(root) / d).is_symlink()]
    return kept


def _checked_listing(peer: Peer) -> list[dict[str, Any]]:
    """The server's listing, each entry checked: a plain relative name with its size and digest."""
    files = peer.listing()
    for entry in files:
        name = str(entry.get("name"))
        if Path(name).is_absolute() or any(p in ("", ".", "..") for p in name.split("/")) or "\x00" in name \
                or not _utf8(name):
            raise ColdSnapError(f"{peer.describe()} listed {name!r}, which is not a plain relative path",
                                fix="the source is not a ColdSnap transfer server")
        size = entry.get("size")
        if not (entry.get("sha256") or digest_in_name(name)) or isinstance(size, bool) \
                or not isinstance(size, int) or size < 0:
            raise ColdSnapError(f"{peer.describe()} listed {name!r} without its size and digest; every file is "
                                "verified on arrival", fix="the source is not a ColdSnap transfer server")
        named, listed = digest_in_name(name), entry.get("sha256")
        if listed is not None and not (isinstance(listed, str) and _HEX64.fullmatch(listed)):
            raise ColdSnapError(f"{peer.describe()} listed {name!r} with the digest {str(listed)[:80]!r}, not 64 "
                                "lower-case hex digits", fix="the source is not a ColdSnap transfer server")
        if named is not None and listed is not None and listed != named:
            # The name is the contract (blobs/sha256/<hex>): a listing cannot make other bytes pass for it.
            raise IntegrityError(f"{peer.describe()} listed {name!r} with sha256:{listed}, not the digest its name "
                                 "states", fix="the source is not serving this capsule's files; capture again")
    return files


def _utf8(name: str) -> bool:
    """Whether ``name`` can be a file name here (a JSON listing may hold lone surrogates)."""
    try:
        name.encode()
    except UnicodeEncodeError:
        return False
    return True


def _digest_of(entry: dict[str, Any]) -> str | None:
    """What a listed file must hash to: the digest its name states, else the listed one."""
    return digest_in_name(str(entry["name"])) or entry.get("sha256")


def missing_files(dest: Path | str, files: list[dict[str, Any]]) -> list[str]:
    """Names of the listed ``files`` not yet verified under ``dest`` (all of them when ``dest`` is a link)."""
    dest = Path(dest)
    if not dest.is_dir() or dest.is_symlink():
        return [str(f["name"]) for f in files]
    return [str(f["name"]) for f in files
            if not _is_verified(dest / str(f["name"]), int(f["size"]), _digest_of(f))]


def plan_tree(peer: Peer, dest: Path | str) -> dict[str, Any]:
    """What ``fetch_tree`` would bring, writing nothing (check mode): ``fetched`` lists those names."""
    files = _checked_listing(peer)
    dest = Path(dest)
    whole = not dest.is_dir() or dest.is_symlink()  # fetch_tree (re)creates the directory then
    missing = missing_files(dest, files)
    return {"files": len(files), "fetched": missing, "bytes_received": 0,
            "bytes": sum(int(f["size"]) for f in files), "changed": whole or bool(missing)}


def _real_dir(path: Path) -> None:
    """``path`` as a private directory of this user's, never a link (created when absent)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.mkdir(mode=0o700)
        return
    if not stat.S_ISDIR(st.st_mode):
        raise ColdSnapError(f"{path} is not a directory (a link or a file is in the way of a transfer)",
                            fix=f"remove {path}; the next run fetches again")


def _real_dirs_below(root: Path, name: str) -> None:
    cur = root
    for part in name.split("/")[:-1]:
        cur = cur / part
        _real_dir(cur)


def _is_verified(path: Path, size: int, digest: str | None) -> bool:
    try:
        if os.path.islink(path) or os.path.getsize(path) != size:
            return False
    except OSError:
        return False
    if digest is None:
        return True
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest() == digest
