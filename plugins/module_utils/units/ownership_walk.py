# Copyright: ColdSnap maintainers
# Apache License 2.0 (see LICENSE)
"""Give a tree to uid:gid on file descriptors only (:func:`give_tree`).

Run in the module's own process (:func:`.ownership.restore_ownership`) and, as a whole file, as the
ownership sidecar's program: so it imports nothing but the standard library. Every entry is opened (or
changed) relative to its directory's descriptor without following links and re-checked by inode, so a user
who owns the tree and renames or swaps entries while it runs cannot make it change anything outside it.
chown(2) clears set-user-ID/set-group-ID bits even for root: they are put back through the entry's own
descriptor.
"""

from __future__ import annotations

import os
import stat


def give_tree(path, uid, gid):
    """Give ``path`` (and, for a directory, everything below it) to uid:gid; return how many changed."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return _give_name(None, path, st, uid, gid)
    fd = os.open(path, flags)
    try:
        if not os.path.samestat(os.fstat(fd), st):
            raise OSError(f"{path} changed while it was being handed over")
        return _give_fd(fd, st, uid, gid)
    finally:
        os.close(fd)


def _give_name(dir_fd, name, st, uid, gid):
    """Change the entry ``name`` of directory ``dir_fd`` itself (a link is never followed)."""
    if st.st_uid == uid and st.st_gid == gid:
        return 0
    os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)
    return 1


def _give_fd(fd, st, uid, gid):
    """Change the open entry ``fd`` (and, for a directory, what it holds, through its descriptor)."""
    n = 0
    if (st.st_uid, st.st_gid) != (uid, gid):
        os.fchown(fd, uid, gid)
        n = 1
        if st.st_mode & (stat.S_ISUID | stat.S_ISGID):
            os.fchmod(fd, stat.S_IMODE(st.st_mode))
    if stat.S_ISDIR(st.st_mode):
        for name in os.listdir(fd):
            try:
                sub = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(sub.st_mode) or stat.S_ISREG(sub.st_mode):
                try:
                    child = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
                except OSError:  # swapped for a link (ELOOP) or gone meanwhile: never followed
                    continue
                try:
                    if os.path.samestat(os.fstat(child), sub):
                        n += _give_fd(child, sub, uid, gid)
                finally:
                    os.close(child)
            else:  # links, sockets, FIFOs, devices: the entry itself, never what it points at
                n += _give_name(fd, name, sub, uid, gid)
    return n
