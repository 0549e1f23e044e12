"""The node-local content-addressed payload cache: ``<state_root>/model-payloads/sha256/<hex>.pack``.

Rules the code below keeps:

* an object appears under its final name only complete, fsynced and with the
  digest of its name (temp name -> fsync -> rename -> directory fsync);
* one per-digest lock file (``model-payloads/locks/<hex>.lock``) serializes
  writers, stagers and verifiers of a digest on this host, so duplicate
  workers converge on one object;
* every writer holds an flock on its own temp file, so a leftover temp whose
  lock can be taken belongs to a killed writer and is removed by the next write;
* a pack that fails verification is moved to ``model-payloads/quarantine/``,
  never deleted silently;
* an engine whose CPU weights are mapped from a pack (``mapfill``) holds a shared
  flock on the pack for as long as it maps it; deleting packs skips one that is
  so held (:meth:`NodeCache.pack_in_use`). Packs are never rewritten in place.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common import fsutil
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    space_error,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import StateLayout
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.identifiers import parse_digest
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import records

PAYLOAD_ROOT = "model-payloads"
INCOMING = "incoming.pack"
PEER_PARTIAL = ".peer-partial"
DEFAULT_LOCK_TIMEOUT = 1800.0


class NodeCache:
    """One host's payload cache under ``state_root``."""

    def __init__(self, state_root: Path | str) -> None:
        self.state_root = StateLayout(state_root).root  # refuses an empty or relative state root
        self.root = self.state_root / PAYLOAD_ROOT
        self.objects = self.root / "sha256"
        self.locks = self.root / "locks"
        self.quarantine_dir = self.root / "quarantine"
        self.downloads = self.root / "downloads"

    @classmethod
    def for_pack_path(cls, path: Path | str) -> NodeCache:
        """The cache that holds ``<state_root>/model-payloads/sha256/<hex>.pack``."""
        return cls(Path(path).parent.parent.parent)

    def __repr__(self) -> str:
        return f"NodeCache({str(self.state_root)!r})"

    def path_for(self, sha256: str) -> Path:
        """Final path of the object with digest ``sha256`` (refused before any path is built when malformed)."""
        return self.objects / f"{parse_digest(sha256, what='model payload digest')}.pack"

    def record_path_for(self, sha256: str) -> Path:
        return records.record_path_for(self.path_for(sha256))

    def peer_partial(self, sha256: str) -> Path:
        """Where a peer transfer of ``sha256`` keeps its bytes until they are verified (kept across runs)."""
        return self.downloads / f"{parse_digest(sha256, what='model payload digest')}{PEER_PARTIAL}"

    def drop_peer_partial(self, sha256: str) -> bool:
        """Remove what an interrupted peer transfer of ``sha256`` left, once its pack is committed under its
        final name (from whatever source): nothing resumes it any more. The caller holds the digest's lock,
        under which alone a peer transfer writes it. True when something was removed."""
        try:
            self.peer_partial(sha256).unlink()
        except FileNotFoundError:
            return False
        except IsADirectoryError:
            remove_tree_quietly(self.peer_partial(sha256))
        fsutil.fsync_dir(self.downloads)
        return True

    def contains(self, sha256: str) -> bool:
        """An object exists under the final name (not verified: use PayloadVerifier)."""
        return self.path_for(sha256).is_file()

    def ensure_dirs(self) -> None:
        """The cache's directories, below a state root that is private (0700, created so when absent) and
        not another user's planted in a world-writable directory (refused: they could redirect every write)."""
        try:
            StateLayout(self.state_root).ensure_private_root()
            # Private like everything below the state root: names of packs and locks tell what this host serves.
            for d in (self.root, self.objects, self.locks):
                d.mkdir(exist_ok=True, mode=0o700)
        except OSError as exc:
            raise no_space_error(exc, what="the node cache's directories", path=self.root) from None

    @contextlib.contextmanager
    def lock(self, sha256: str, *, timeout: float | None = DEFAULT_LOCK_TIMEOUT,
             create: bool = True) -> Iterator[None]:
        """Hold the per-digest lock (exclusive flock on ``locks/<hex>.lock``) for the block.

        ``create=False`` creates no directory and changes no permission (for a pack given by its path,
        which may lie in a directory of the user's that is no state root): without a ``locks`` directory
        it raises FileNotFoundError.
        """
        hexd = parse_digest(sha256, what="model payload digest")
        with contextlib.ExitStack() as stack:
            dir_fd = None
            if create:
                self.ensure_dirs()
            else:
                # The directory of a pack given by its path may be another user's: a link planted at
                # ``locks`` is never followed (that would make this user create files where it points).
                try:
                    dir_fd = os.open(self.locks, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
                except OSError as exc:
                    if exc.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                        raise
                    raise FileNotFoundError(errno.ENOENT, "no lock directory", str(self.locks)) from None
                stack.callback(os.close, dir_fd)
            try:
                stack.enter_context(fsutil.file_lock(self.locks / f"{hexd}.lock", timeout=timeout, dir_fd=dir_fd))
            except TimeoutError as exc:
                raise ColdSnapError(f"model payload sha256:{hexd}: {exc}",
                                    fix="another worker on this host is writing or verifying it; wait for it or "
                                        "stop that process") from None
            except OSError as exc:
                raise no_space_error(exc, what=f"the lock file of model payload sha256:{hexd}",
                                     path=self.locks) from None
            yield

    def clean_stale_temps(self, sha256: str | None = None) -> list[Path]:
        """Remove temp files of killed writers; returns what was removed.

        A pack temp is removed only when its flock can be taken (its writer is
        gone). Record temps of ``sha256`` are removed outright: the caller holds
        that digest's lock, so no live writer can own them.
        """
        removed: list[Path] = []
        if not self.objects.is_dir():
            return removed
        record_prefix = None
        if sha256 is not None:
            hexd = parse_digest(sha256, what="model payload digest")
            record_prefix = f".{hexd}.pack{records.RECORD_SUFFIX}{fsutil.TEMP_MARKER}"
        for entry in os.scandir(self.objects):
            name = entry.name
            if not fsutil.is_temp_name(name):
                continue
            path = Path(entry.path)
            if record_prefix is not None and name.startswith(record_prefix):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed.append(path)
                continue
            if ".pack" + fsutil.TEMP_MARKER not in name:
                continue
            if fsutil.remove_if_abandoned(path):
                removed.append(path)
        if removed:
            fsutil.fsync_dir(self.objects)
        return removed

    @staticmethod
    def pack_in_use(path: Path | str) -> bool:
        """True when a running engine maps the pack at ``path`` (it holds a shared flock on it)."""
        return fsutil.lock_held(path, exclusive=True)

    def quarantine(self, path: Path, identity: records.FileIdentity) -> Path | None:
        """Move the pack at ``path`` aside when it still is the inode ``identity`` names; drop its record.

        The move goes through directory descriptors opened without following links: a link planted at
        ``quarantine`` (or at the pack's directory) of a pack given by its path, in a directory of another
        user's, never makes this user move the file into a directory the link names (OSError ELOOP or
        ENOTDIR: the caller removes the wrong object instead)."""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        with contextlib.ExitStack() as stack:
            root_fd = os.open(path.parent.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            stack.callback(os.close, root_fd)
            src_fd = os.open(path.parent.name, flags, dir_fd=root_fd)
            stack.callback(os.close, src_fd)
            try:
                st = os.stat(path.name, dir_fd=src_fd, follow_symlinks=False)
            except FileNotFoundError:
                return None
            if (st.st_dev, st.st_ino) != (identity.st_dev, identity.st_ino):
                return None
            with contextlib.suppress(FileExistsError):
                os.mkdir(self.quarantine_dir.name, 0o700, dir_fd=root_fd)
            try:
                dst_fd = os.open(self.quarantine_dir.name, flags, dir_fd=root_fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise OSError(exc.errno, "a link or a file where a directory of its own belongs",
                                  str(self.quarantine_dir)) from None
                raise
            stack.callback(os.close, dst_fd)
            stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
            name = f"{path.name}.{stamp}-{secrets.token_hex(4)}"
            try:
                os.rename(path.name, name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
            except OSError as exc:
                if exc.errno == errno.EXDEV:
                    return None
                raise
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path.name + records.RECORD_SUFFIX, dir_fd=src_fd)
            os.fsync(src_fd)
            os.fsync(dst_fd)
        return self.quarantine_dir / name

    def quarantined(self, sha256: str | None = None) -> list[Path]:
        """Files currently held in quarantine (only those of ``sha256`` when given), oldest name first."""
        if not self.quarantine_dir.is_dir():
            return []
        prefix = f"{parse_digest(sha256, what='model payload digest')}.pack." if sha256 else ""
        return sorted(p for p in self.quarantine_dir.iterdir() if p.name.startswith(prefix))

    def absence_reason(self, sha256: str) -> str:
        """Why a payload is not in the cache: never there, or its last copy refused and quarantined."""
        held = self.quarantined(sha256)
        if not held:
            return "not in the node cache"
        last = held[-1]
        return (f"its copy in the node cache was refused (corrupt or truncated: {last.stat().st_size} bytes) and "
                f"moved to quarantine as {last}")


def no_space_error(exc: OSError, *, what: str, path: Path | str, needed: int | None = None) -> Exception:
    """:func:`space_error` (ENOSPC or EDQUOT: no space or no inodes left), with the errno kept in its
    ``details`` so a caller that can go on without writing (a read-only verification) tells it apart;
    any other error is returned as it is."""
    err = space_error(exc, what=what, path=path, needed=needed)
    if isinstance(err, ColdSnapError):
        err.details["errno"] = exc.errno
    return err


def remove_tree_quietly(path: Path) -> None:
    """Remove a download staging directory; missing is fine."""
    shutil.rmtree(path, ignore_errors=True)
