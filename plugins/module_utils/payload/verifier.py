"""The one payload verifier: used by ``coldsnap.fleet.payload_verify``, ``coldsnap payload verify`` and the
in-unit runtime, so the admission rules cannot drift between them.

Rules, in order:

1. the digest must be ``sha256:<64 lower-case hex>`` (refused before any path is built);
2. the pack must live at ``.../model-payloads/sha256/<hex>.pack`` (a path that
   does not match its digest is refused);
3. the file is opened once (no symlinks) and everything after uses that fd;
4. size first: a wrong size fails without hashing;
5. a private, well-formed validation record whose identity matches the open
   file and that is not racy skips the hash;
6. otherwise a full SHA-256; a mismatch quarantines the file and names it;
   a match writes a fresh record (not in check mode).

The returned :class:`VerifiedPayload` keeps the verified fd open: hydration
reads from it (never from the path again) and calls :meth:`~VerifiedPayload.recheck`
before and after use.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.identifiers import parse_digest
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import records
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import (
    DEFAULT_LOCK_TIMEOUT,
    NodeCache,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import PACK_DIR
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.streams import Progress, hash_fd

STAGE_FIX = "stage it again (coldsnap.fleet.payload_stage) or restore with weights mode 'recovery'"


@dataclass
class VerifiedPayload:
    """A pack that passed verification, held open by ``fd`` with the identity that was verified."""

    path: Path
    sha256: str
    size: int
    fd: int
    identity: records.FileIdentity
    reused_record: bool
    bytes_hashed: int
    record_written: bool
    record_status: str
    seconds: float = 0.0
    _closed: bool = field(default=False, repr=False)

    def fileno(self) -> int:
        return self.fd

    def recheck(self, *, progress: Progress | None = None) -> None:
        """Raise IntegrityError when the open file changed since it was verified.

        A different inode, size or mtime is refused at once. A change of ctime
        alone (a rename or unlink of the verified name changes the inode's link
        count and so its ctime, but so does a rewrite whose mtime was put back)
        is settled by re-hashing the open fd.
        """
        if self._closed:
            raise ColdSnapError(f"model payload {self.sha256} was closed", fix="verify it again before use")
        now = records.FileIdentity.of_fd(self.fd)
        if now == self.identity:
            return
        changed = [k for k, v in self.identity.as_dict().items() if now.as_dict()[k] != v]
        if changed == ["st_ctime_ns"]:
            actual = hash_fd(self.fd, self.size, progress=progress, what=f"model payload {self.path}")
            if "sha256:" + actual == self.sha256 and records.FileIdentity.of_fd(self.fd) == now:
                self.identity = now
                self.bytes_hashed += self.size
                return
        raise IntegrityError(
            f"model payload {self.path} changed after it was verified ({', '.join(changed)} differ)",
            fix="something modified the pack in place; verify it again (the old record is stale)")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self.fd)

    def __enter__(self) -> VerifiedPayload:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def as_result(self) -> dict:
        """The facts a module or the CLI reports."""
        return {"verified": True, "path": str(self.path), "sha256": self.sha256, "size": self.size,
                "record_reused": self.reused_record, "bytes_hashed": self.bytes_hashed,
                "record_written": self.record_written, "record_status": self.record_status}


def check_pack_path(path: Path, hexd: str) -> None:
    """The pack's path must end in ``model-payloads/sha256/<hex>.pack`` for its own digest."""
    expected = f"{PACK_DIR}/{hexd}.pack"
    tail = "/".join(path.parts[-3:])
    if tail != expected:
        raise IntegrityError(f"payload path {path} does not match its digest sha256:{hexd}",
                             fix=f"a pack must live at <state_root>/{expected}")


class PayloadVerifier:
    """Verify packs; see the module docstring for the rules."""

    def __init__(self, *, lock_timeout: float | None = DEFAULT_LOCK_TIMEOUT) -> None:
        self.lock_timeout = lock_timeout

    def verify(self, target: Path | str | NodeCache, sha256: str, size: int, *, write_record: bool = True,
               progress: Progress | None = None, rehash: bool = False) -> VerifiedPayload:
        """Verify the pack for ``sha256`` (a path, or the entry of a NodeCache) and return it held open.

        ``write_record=False`` is a read-only verification (check mode): no
        lock file, no record, no quarantine. ``rehash`` ignores a valid record.
        """
        hexd = parse_digest(sha256, what="model payload digest")
        _check_size_arg(size)
        path = target.path_for(sha256) if isinstance(target, NodeCache) else Path(target)
        check_pack_path(path, hexd)
        cache = NodeCache.for_pack_path(path)
        if not write_record:
            # Check mode / read-only verification: no lock file, no record, no quarantine.
            return self._verify(path, hexd, size, cache, write_record=False, progress=progress, read_only=True,
                                rehash=rehash)
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(cache.lock(sha256, timeout=self.lock_timeout))
            except OSError as exc:
                if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                    raise
                # A read-only view of the cache (e.g. a unit's bind mount): verify without lock or record.
                return self._verify(path, hexd, size, cache, write_record=False, progress=progress, read_only=True,
                                    rehash=rehash)
            return self._verify(path, hexd, size, cache, write_record=write_record, progress=progress, rehash=rehash)

    def verify_locked(self, path: Path, sha256: str, size: int, *, write_record: bool = True,
                      progress: Progress | None = None, rehash: bool = False) -> VerifiedPayload:
        """Like :meth:`verify` for a caller that already holds the digest's lock."""
        hexd = parse_digest(sha256, what="model payload digest")
        _check_size_arg(size)
        check_pack_path(Path(path), hexd)
        return self._verify(Path(path), hexd, size, NodeCache.for_pack_path(path), write_record=write_record,
                            progress=progress, rehash=rehash)

    def inspect(self, path: Path, sha256: str, size: int) -> records.RecordCheck:
        """Record status of a pack without hashing it (what the next verify would do)."""
        hexd = parse_digest(sha256, what="model payload digest")
        check_pack_path(path, hexd)
        fd = _open_pack(path, hexd)
        try:
            ident = records.FileIdentity.of_fd(fd)
            if ident.st_size != size:
                return records.RecordCheck("stale", f"size {ident.st_size} != {size}")
            return records.check_record(records.record_path_for(path), hexd, size, ident)
        finally:
            os.close(fd)

    def _verify(self, path: Path, hexd: str, size: int, cache: NodeCache, *, write_record: bool,
                progress: Progress | None, read_only: bool = False, rehash: bool = False) -> VerifiedPayload:
        started = time.monotonic()
        digest = f"sha256:{hexd}"
        fd = _open_pack(path, hexd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise IntegrityError(f"model payload {path} is not a regular file", fix=STAGE_FIX)
            ident = records.FileIdentity.of(st)
            record_path = records.record_path_for(path)
            if ident.st_size != size:
                self._refuse(cache, path, ident, read_only,
                             f"model payload {path} has {ident.st_size} bytes, the artifact says {size}")
            check = records.check_record(record_path, hexd, size, ident)
            if check.valid and not rehash:
                return VerifiedPayload(path, digest, size, fd, ident, True, 0, False, check.status,
                                       time.monotonic() - started)
            _wait_out_tick(ident)
            observed = time.time_ns()
            before = records.FileIdentity.of_fd(fd)
            actual = hash_fd(fd, size, progress=progress, what=f"model payload {path}")
            after = records.FileIdentity.of_fd(fd)
            if before != after:
                raise IntegrityError(f"model payload {path} changed while it was being hashed",
                                     fix="stop whatever writes to the cache and verify again")
            if actual != hexd:
                self._refuse(cache, path, after, read_only,
                             f"model payload {path} hashes to sha256:{actual}, not {digest}")
            written = False
            if write_record and not read_only:
                try:
                    records.write_record(record_path, hexd, size, after, observed, method="full-sha256")
                    written = True
                except OSError as exc:
                    if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                        raise
            return VerifiedPayload(path, digest, size, fd, after, False, size, written, check.status,
                                   time.monotonic() - started)
        except BaseException:
            os.close(fd)
            raise

    def _refuse(self, cache: NodeCache, path: Path, ident: records.FileIdentity, read_only: bool,
                problem: str) -> None:
        moved = None
        if not read_only:
            with contextlib.suppress(OSError):
                moved = cache.quarantine(path, ident)
        if moved:
            where = f"; it was moved to quarantine as {moved}"
        elif read_only:
            where = " (read-only verification: left in place, not quarantined)"
        else:
            where = "; it could not be quarantined (it was replaced or lives on another file system)"
        raise IntegrityError(problem + where, fix=STAGE_FIX, details={"quarantined": str(moved) if moved else None})


def _wait_out_tick(ident: records.FileIdentity) -> None:
    """Start hashing only after the file's last-change tick, so the record we write is not racy (<= 20 ms)."""
    deadline = ident.last_change_ns() + records.timestamp_tick_ns(ident)
    now = time.time_ns()
    if now < deadline and deadline - now <= records.FINE_TICK_NS:
        time.sleep((deadline - now) / 1e9)


def _check_size_arg(size: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ColdSnapError(f"payload size {size!r} is not a non-negative integer", fix="give the size in bytes")


def _open_pack(path: Path, hexd: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ColdSnapError(f"model payload sha256:{hexd} is not present at {path}", fix=STAGE_FIX) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise IntegrityError(f"model payload {path} is a symbolic link",
                                 fix="the cache holds packs as regular files; remove the link and stage the pack") from None
        raise ColdSnapError(f"cannot open model payload {path}: {exc.strerror}",
                            fix="check the permissions of the state root") from None
