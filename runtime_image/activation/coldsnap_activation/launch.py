"""Start a unit's engine in the process context its snapshot needs, then become it (``exec``).

``python launch.py --private-shm -- COMMAND...``: the engine gets a mount namespace of its
own whose ``/dev/shm`` is a fresh tmpfs. Engines with several processes (vLLM: API server,
engine core, workers) share ring buffers, semaphores and IPC sockets there; CRIU then takes
that namespace and the tmpfs's contents into the image, and a restore brings them back
exactly, whatever the host's ``/dev/shm`` holds by then. The host's own ``/dev/shm`` mounts
are detached inside the namespace first, so no other process's files reach the image, and so
are namespace files bind-mounted on the host (``nsfs``: ``ip netns``, dockerd's
``/run/docker/netns``), which CRIU cannot take into an image and the engine never uses.

The launcher execs the command: the engine keeps this process's pid (the root of the tree
CRIU dumps). Standard library only; run with any Python, as root (mounts need
CAP_SYS_ADMIN).
"""

from __future__ import annotations

import ctypes
import os
import sys

CLONE_NEWNS = 0x00020000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
SHM = b"/dev/shm"


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    return libc


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def private_shm(size: str = "50%") -> None:
    """Enter a new mount namespace (mounts private) with a fresh tmpfs at /dev/shm."""
    libc = _libc()
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    for target in reversed(_mounts_of_type("nsfs")):
        libc.umount2(target.encode(), MNT_DETACH)  # best effort: what stays, CRIU names in its error
    for _i in range(16):  # a host may stack several tmpfs on /dev/shm
        if not os.path.ismount("/dev/shm"):
            break
        _check(libc.umount2(SHM, MNT_DETACH), "umount /dev/shm")
    os.makedirs("/dev/shm", exist_ok=True)
    _check(libc.mount(b"coldsnap-shm", SHM, b"tmpfs", 0, f"mode=1777,size={size}".encode()),
           "mount tmpfs /dev/shm")
    _reopen_stdio()


def _reopen_stdio() -> None:
    """Open stdin, stdout and stderr again inside the new namespace: files opened before it (the
    null device, the workload log) sit on the host's mounts, which CRIU cannot find in the
    engine's namespace ("Can't lookup mount ... for fd=0")."""
    import fcntl

    for fd in (0, 1, 2):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if not path.startswith("/") or not os.path.exists(path):
            continue
        flags = fcntl.fcntl(fd, fcntl.F_GETFL) & (os.O_ACCMODE | os.O_APPEND)
        new = os.open(path, flags | os.O_CLOEXEC)
        os.dup2(new, fd)
        os.close(new)


def _mounts_of_type(fstype: str) -> list[str]:
    """Mount points of this namespace whose file system type is ``fstype`` (mountinfo order)."""
    out = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            left, _sep, right = line.partition(" - ")
            fields = left.split()
            if right.split()[:1] == [fstype] and len(fields) > 4:
                out.append(fields[4].replace("\\040", " "))
    return out


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: launch.py [--private-shm] -- COMMAND...", file=sys.stderr)
        return 2
    sep = argv.index("--")
    options, command = argv[:sep], argv[sep + 1:]
    if not command:
        print("launch.py: no command", file=sys.stderr)
        return 2
    try:
        if "--private-shm" in options:
            private_shm()
    except OSError as exc:
        print(f"coldsnap launch: cannot give the engine a private /dev/shm: {exc}", file=sys.stderr, flush=True)
        return 126
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"coldsnap launch: cannot start {command[0]!r}: {exc.strerror}", file=sys.stderr, flush=True)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
