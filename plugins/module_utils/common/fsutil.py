"""Crash-safe file primitives: temp name -> fsync -> rename -> directory fsync.

Nothing half-written ever appears under a final name: writers create
``.<name>.tmp-<random>`` beside the target, fsync it, rename it over the final
name and fsync the directory so the rename itself survives a crash.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

TEMP_MARKER = ".tmp-"


def temp_path_for(final: Path) -> Path:
    """A unique temporary name in the same directory as ``final`` (same filesystem)."""
    return final.with_name(f".{final.name}{TEMP_MARKER}{secrets.token_hex(6)}")


def is_temp_name(name: str) -> bool:
    """True for names produced by :func:`temp_path_for`."""
    return name.startswith(".") and TEMP_MARKER in name


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename/creation inside it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class NotRegularFile(OSError):
    """What is at a path is not a regular file; ``args[0]`` says what it is ("a directory", ...)."""


def read_regular_file(path: Path | str, limit: int, *, follow_links: bool = True) -> bytes | None:
    """The bytes of the regular file at ``path``, or None when it holds more than ``limit`` (never read past
    it). Opened without blocking, so a FIFO never waits; a directory, FIFO or device is NotRegularFile; the
    open's own OSError propagates (FileNotFoundError; ELOOP for a link when ``follow_links`` is false)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile("a directory" if stat.S_ISDIR(mode) else "not a regular file")
        return read_at_most(fd, limit)
    finally:
        os.close(fd)


def read_at_most(fd: int, limit: int) -> bytes | None:
    """All of what ``fd`` reads (to its end), or None when that is more than ``limit`` bytes (a file that grew,
    a device such as ``/dev/zero``: never read past the limit)."""
    chunks, size = [], 0
    while size <= limit:
        chunk = os.read(fd, min(1 << 20, limit + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return None if size > limit else b"".join(chunks)


def make_private_dirs(path: Path | str) -> None:
    """Create ``path`` and every missing directory above it with mode 0700 (``mkdir(parents=True)`` gives
    the parents the default mode: a state root made that way would be world-readable)."""
    _make_missing_dirs(Path(path), 0o700)


def make_dirs_unwritable_by_others(path: Path | str) -> None:
    """Create ``path`` and every missing directory above it with the umask's mode less group and other write
    (umask 000 would give 0777: another user could swap the file ColdSnap writes there for one of theirs).
    Existing directories are left as they are."""
    _make_missing_dirs(Path(path), 0o755)


def _make_missing_dirs(path: Path, mode: int) -> None:
    """mkdir ``path`` and its missing parents, top down, each with ``mode`` (the kernel applies the umask on top:
    never a moment with more). A name already taken (a link, a file, a racing mkdir) is left as it is."""
    missing = []
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=mode)


def remove_if_abandoned(path: Path | str) -> bool:
    """Remove the temporary file ``path`` when no writer holds its flock (writers lock their temp for its
    whole life: a killed one's is free); True when it was removed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, OSError):
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # a live writer holds it
        try:
            st_path = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        st_fd = os.fstat(fd)
        if (st_path.st_dev, st_path.st_ino) != (st_fd.st_dev, st_fd.st_ino):
            return False
        os.unlink(path)
        return True
    finally:
        os.close(fd)


def fsync_file(path: Path | str) -> None:
    """Flush a file's bytes to disk (before it gets a name that readers trust)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(final: Path, *, mode: int = 0o600, binary: bool = True) -> Iterator[IO[Any]]:
    """Write ``final`` atomically. On any exception the temp file is removed. Whatever is at ``final`` is
    replaced (in the state root, a FIFO planted at a record's name gives way to the record): a path a user
    names for output goes through :func:`write_output`, which writes to a device or FIFO instead."""
    final = Path(final)
    make_dirs_unwritable_by_others(final.parent)
    tmp = temp_path_for(final)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)  # not subject to umask
        with os.fdopen(fd, "wb" if binary else "w", closefd=True) as fh:
            fd = -1
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(final: Path, data: bytes, *, mode: int = 0o600) -> None:
    """Write bytes atomically with the given mode."""
    with atomic_writer(final, mode=mode) as fh:
        fh.write(data)


def write_output(path: Path | str, data: bytes, *, mode: int = 0o600) -> None:
    """Write a file a user named for output (``--receipt-json``, ``timeline -o``): a regular file (or a link)
    is replaced atomically; a device, FIFO or socket there (``/dev/stdout``, ``/dev/null``, a named pipe) is
    written to, never replaced."""
    try:
        st = os.stat(path)  # what a link leads to: /dev/stdout is a link to the process's own stdout
    except OSError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
        require_not_planted_output(path)
        with open(os.open(path, os.O_WRONLY | os.O_CLOEXEC), "wb") as fh:
            require_not_planted_output(path, fd=fh.fileno())  # what was opened, not what was looked at
            fh.write(data)
        return
    atomic_write_bytes(Path(path), data, mode=mode)


def require_not_planted_output(path: Path | str, *, fd: int | None = None) -> None:
    """An output path that is written to in place (a FIFO, socket or device) must not be one another user put
    in a directory anyone may write to (``/tmp/receipt.json`` made a named pipe by someone else would read
    this user's receipt, or hang the command): ColdSnapError naming it. A regular file there is replaced,
    never written through, so it needs no check. ``fd``: the file as opened, checked too (another user may
    have made the path between the look and the open)."""
    planted = planted_by_another(path)
    if planted is None and fd is not None:
        st = os.fstat(fd)
        parent = Path(os.path.realpath(Path(path).absolute().parent))
        if st.st_uid not in (os.geteuid(), 0) and os.stat(parent).st_mode & stat.S_IWOTH:
            planted = (Path(path), parent, st.st_uid)
    if planted is not None:
        from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError

        cur, parent, uid = planted
        raise ColdSnapError(f"{path}: {cur} belongs to uid {uid} in {parent}, which anyone may write to; this "
                            "user would write its output into what that user made (a named pipe they read)",
                            fix="write the output to a directory of your own, or remove it first")


def atomic_write_json(final: Path, obj: Any, *, mode: int = 0o600) -> None:
    """Write a JSON document (sorted keys, trailing newline) atomically."""
    data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
    atomic_write_bytes(final, data, mode=mode)


def exclusive_commit(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final`` only when ``final`` does not exist (link + unlink).

    Used where an existing object must never be replaced (capture output:
    conflict-on-existing-output).
    """
    try:
        os.link(tmp, final)
    except FileExistsError:
        os.unlink(tmp)
        raise
    os.unlink(tmp)
    fsync_dir(final.parent)


@contextlib.contextmanager
def file_lock(path: Path, *, shared: bool = False, timeout: float | None = None,
              dir_fd: int | None = None) -> Iterator[int]:
    """Hold an flock on ``path`` (created 0600 if absent; a symbolic link or any other non-regular
    file there is refused, never followed or written through) for the block. With ``dir_fd`` (an open
    descriptor of ``path``'s directory) the file is opened in that directory and no directory is made."""
    import time

    path = Path(path)
    if dir_fd is None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path if dir_fd is None else path.name,
                     os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        fd = -1
    if fd < 0 or not stat.S_ISREG(os.fstat(fd).st_mode):
        if fd >= 0:
            os.close(fd)
        from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError

        raise ColdSnapError(f"lock file {path} is a symbolic link or not a regular file (not one ColdSnap made)",
                            fix=f"remove {path} and check who can write to {path.parent}")
    try:
        op = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        if timeout is None:
            fcntl.flock(fd, op)
        else:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fd, op | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"timed out after {timeout:.0f}s waiting for lock {path}") from exc
                    time.sleep(0.05)
        yield fd
    finally:
        os.close(fd)


def check_private(path: Path) -> None:
    """Refuse a secret-bearing file that group or others can read."""
    st = os.stat(path)
    if stat.S_IMODE(st.st_mode) & 0o077:
        from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError

        raise ColdSnapError(
            f"{path} is readable by group/others (mode {stat.S_IMODE(st.st_mode):04o})",
            fix=f"run 'chmod 600 {path}'",
        )


def planted_by_another(path: Path | str) -> tuple[Path, Path, int] | None:
    """The first component of ``path`` (of the path as given, then as resolved: a link, a directory, the
    path itself or any directory above it) that a user other than this one and root owns in a directory
    anyone may write to (``/tmp``, ``/var/tmp``): ``(component, that directory, its owner)``, else None.
    Such a component is its owner's to redirect: this user would write and chmod through their links."""
    me = os.geteuid()
    given = Path(path).absolute()
    for candidate in (given, Path(os.path.realpath(given))):
        cur = Path(candidate.anchor)
        for part in candidate.parts[1:]:
            parent, cur = cur, cur / part
            try:
                st = os.lstat(cur)
            except FileNotFoundError:
                break
            if st.st_uid not in (me, 0) and os.stat(parent).st_mode & stat.S_IWOTH:
                return cur, parent, st.st_uid
            if stat.S_ISLNK(st.st_mode):
                break  # where it leads is checked on the resolved path
    return None


def own_directory(path: Path | str, *, what: str, fix: str) -> Path:
    """``path`` as a directory that only this user can change: made 0700 when missing; an existing one
    must be a real directory (no link) of this user (group and others lose write access to it). A directory that
    another user could have made first in ``/tmp`` (and so fill with code this user then loads) is
    refused with ColdSnapError naming it and ``fix``."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError

    path = Path(path)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o022:
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o022)  # this user's own (umask 002): closed, not refused
        st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory" if not stat.S_ISDIR(
            st.st_mode) else f"owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"
        raise ColdSnapError(f"{what} {path} is {kind}: another user could place what this user runs there "
                            f"(this user is uid {os.geteuid()})", fix=fix)
    return path


def chown_tree(root: Path, uid: int, gid: int) -> None:
    """Give ``root`` and everything below it to uid/gid without touching mode bits."""
    root = Path(root)
    if not root.exists():
        return
    os.lchown(root, uid, gid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, gid)


def rmtree_atomically(path: Path) -> None:
    """Take ``path`` out of its directory with one rename, then delete it.

    A crash in the middle leaves a temporary name (cleaned up later), never a
    half-deleted directory under its real name.
    """
    path = Path(path)
    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_dir():
        path.unlink()
        fsync_dir(path.parent)
        return
    doomed = temp_path_for(path)
    os.rename(path, doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def lock_held(path: Path | str, *, exclusive: bool = False) -> bool:
    """True when another open file description holds a flock on ``path`` that conflicts with a
    shared (or, with ``exclusive``, an exclusive) lock; never creates ``path`` nor follows a symlink."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
    finally:
        os.close(fd)  # closing drops the probe's own lock, if it got it
    return False


# The kernel reads at most max(read-ahead window, largest device request) per WILLNEED call
# (128 KiB to a few MiB), so a whole file is asked for in steps no larger than that.
READAHEAD_STEP = 512 << 10


def readahead(path: Path | str) -> bool:
    """Queue reads of all of ``path`` into the page cache (``POSIX_FADV_WILLNEED``, one call per
    :data:`READAHEAD_STEP`) and return without waiting for them: about 0.2 s per GB to queue from
    disk, 15 ms per GB already cached (2-vCPU VM). False when the file cannot be opened or the
    kernel refuses the hint; never follows a symbolic link; a hint, never an error."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        for offset in range(0, st.st_size, READAHEAD_STEP):
            os.posix_fadvise(fd, offset, READAHEAD_STEP, os.POSIX_FADV_WILLNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def file_sha256(path: Path | str) -> str:
    """``sha256:<hex>`` of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def first_link_below(root: Path | str, rel: str) -> Path | None:
    """The first existing directory between ``root`` and ``root/rel`` (``rel``'s parents) that is a
    symbolic link; None when there is none (an absent component ends the walk: nothing beyond it exists)."""
    cur = Path(root)
    for part in [p for p in str(rel).split("/")[:-1] if p not in ("", ".")]:
        cur = cur / part
        try:
            if stat.S_ISLNK(os.lstat(cur).st_mode):
                return cur
        except FileNotFoundError:
            return None
    return None
