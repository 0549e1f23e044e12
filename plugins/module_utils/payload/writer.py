"""Writing a pack into the node cache: a temp file (flocked) hashed while it is written, then
committed under its digest name; an object already there is verified and reused.

Apart from :mod:`.cache` (the store and its locks) because committing consults the
verifier, which itself reads the cache.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common import fsutil
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
    space_error,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.identifiers import parse_digest
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import records
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import (
    DEFAULT_LOCK_TIMEOUT,
    INCOMING,
    NodeCache,
    no_space_error,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import PackRef
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.streams import write_all
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import PayloadVerifier


@dataclass(frozen=True)
class CommitResult:
    """What a PackWriter commit produced."""

    pack: PackRef
    path: Path
    reused_existing: bool  # an identical object was already there (converged)
    record_written: bool
    bytes_written: int


class PackWriter:
    """Write one pack into the cache: temp file (flocked) -> hash while writing -> commit.

    Use as a context manager; anything but a successful :meth:`commit` removes
    the temp file. With ``expected_sha256`` the caller must already hold that
    digest's lock (``lock_held=True``) or commit takes it.
    """

    def __init__(self, cache: NodeCache, *, expected_sha256: str | None = None, size: int | None = None,
                 lock_held: bool = False, what: str = "model payload",
                 lock_timeout: float | None = DEFAULT_LOCK_TIMEOUT) -> None:
        self.cache = cache
        self.expected_hex = (parse_digest(expected_sha256, what="model payload digest")
                             if expected_sha256 is not None else None)
        self.size = size
        self.lock_held = lock_held
        self.what = what
        self.lock_timeout = lock_timeout
        self.hasher = hashlib.sha256()
        self.written = 0
        self.fd = -1
        self.tmp: Path | None = None
        self.committed = False

    def __enter__(self) -> PackWriter:
        self.cache.ensure_dirs()
        self.cache.clean_stale_temps()  # a killed writer's temp must not keep the space this one needs
        final = self.cache.objects / (f"{self.expected_hex}.pack" if self.expected_hex else INCOMING)
        for _i in range(5):
            tmp = fsutil.temp_path_for(final)
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except OSError as exc:  # no inode left for the temp: name the cache, not the temp
                raise no_space_error(exc, what=self.what, path=self.cache.objects, needed=self.size) from None
            fcntl.flock(fd, fcntl.LOCK_EX)
            # A cleaner may have taken the flock between create and flock and removed the name: retry.
            try:
                st = os.stat(tmp, follow_symlinks=False)
                if (st.st_dev, st.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino):
                    self.fd, self.tmp = fd, tmp
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        else:
            raise ColdSnapError(f"could not create a temporary file in {self.cache.objects}",
                                fix="check that nothing else removes files there")
        if self.size:
            try:
                os.posix_fallocate(self.fd, 0, self.size)
            except OSError as exc:
                self._discard()
                err = space_error(exc, what=self.what, path=self.cache.objects,
                                  needed=self.size)
                if err is exc and exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                    return self._reopen_without_fallocate()
                raise err from None
        return self

    def _reopen_without_fallocate(self) -> PackWriter:
        size, self.size = self.size, None
        self.__enter__()
        self.size = size
        return self

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append ``data`` to the pack, hashing it."""
        view = memoryview(data).cast("B")
        self.hasher.update(view)
        write_all(self.fd, view, what=self.what, path=self.tmp or self.cache.objects)
        self.written += view.nbytes

    def commit(self) -> CommitResult:
        """fsync, check size/digest, then make the object visible under its digest name."""
        if self.tmp is None:
            raise AssertionError("PackWriter.commit() without an open temp file (use it as a context manager, commit once)")
        if self.size is not None and self.written != self.size:
            raise IntegrityError(f"{self.what}: wrote {self.written} bytes, expected {self.size}",
                                 fix="the source changed size while it was copied; run again")
        try:
            os.fsync(self.fd)
        except OSError as exc:
            raise space_error(exc, what=self.what, path=self.tmp) from None
        hexd = self.hasher.hexdigest()
        if self.expected_hex is not None and hexd != self.expected_hex:
            raise IntegrityError(f"{self.what}: the bytes hash to sha256:{hexd}, expected sha256:{self.expected_hex}",
                                 fix="the source does not hold this payload; check the source or the digest")
        digest = f"sha256:{hexd}"
        lock = contextlib.nullcontext() if self.lock_held else self.cache.lock(digest, timeout=self.lock_timeout)
        with lock:
            self.cache.clean_stale_temps(digest)
            final = self.cache.path_for(digest)
            if os.path.lexists(final):
                try:
                    existing = PayloadVerifier().verify_locked(final, digest, self.written)
                except IntegrityError:
                    existing = None  # quarantined: ours replaces it
                if existing is not None:
                    existing.close()
                    self._discard()
                    self._drop_peer_partial(digest)
                    self.committed = True
                    return CommitResult(PackRef.for_digest(digest, self.written), final, True, False, self.written)
            os.fchmod(self.fd, 0o400)  # content-addressed objects are never edited in place, and private
            os.rename(self.tmp, final)
            fsutil.fsync_dir(final.parent)
            self.tmp = None
            record_written = write_settled_record(self.fd, final, hexd, self.written)
            os.close(self.fd)
            self.fd = -1
            self._drop_peer_partial(digest)
            self.committed = True
            return CommitResult(PackRef.for_digest(digest, self.written), final, False, record_written, self.written)

    def _drop_peer_partial(self, digest: str) -> None:
        """The pack is committed (under the digest's lock): what a peer pull of it left is not needed."""
        with contextlib.suppress(OSError):
            self.cache.drop_peer_partial(digest)

    def _discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp)
            self.tmp = None

    def __exit__(self, *exc_info) -> None:
        self._discard()


def write_settled_record(fd: int, final: Path, hexd: str, size: int) -> bool:
    """Record a pack this process just wrote and hashed, once its timestamps are out of the racy tick.

    Waits (one tick at most, 20 ms normally) until the clock has moved past the
    rename's ctime, then re-reads the identity; if anything changed meanwhile
    no record is written and the next use re-hashes.
    """
    first = records.FileIdentity.of_fd(fd)
    deadline = first.last_change_ns() + records.timestamp_tick_ns(first)
    while (now := time.time_ns()) < deadline:
        time.sleep((deadline - now) / 1e9)
    observed = time.time_ns()
    second = records.FileIdentity.of_fd(fd)
    if second != first:
        return False
    try:
        records.write_record(records.record_path_for(final), hexd, size, second, observed, method="writer-sha256")
    except OSError:
        return False
    return True
