"""Byte streaming for payloads: pipelined SHA-256 of a file descriptor, copy-and-hash, full writes.

SHA-256 of one stream cannot be split across cores, so the fastest verifier of
one file is one hashing thread that never waits for I/O: a reader thread
``preadv``s the next chunks into a small ring of buffers while the caller hashes
the current one (hashlib and preadv both release the GIL). Measured at ~0.99 of
hashlib's in-memory speed for a file in the page cache when a second core is free.

When every core already hashes a file of its own (several packs verified at
once, ``PayloadVerifier.verify_many``), a reader thread per file only competes with the hashers
for the CPU: each file is then read and hashed in one thread, through one
reused buffer small enough to stay in the core's cache (``pipelined=False``).
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import space_error

# progress(done_bytes, total_bytes); called from the thread doing the work.
Progress = Callable[[int, int], None]

CHUNK = 8 << 20
_RING = 4
# Hashing through the reader thread: buffers small enough that a chunk is still in the shared cache when the
# hashing thread reads it (8 MiB x 4 spilled out of a 32 MiB L3 shared with other tenants: ~0.85 of hashlib).
HASH_CHUNK = 1 << 20
_HASH_RING = 6
# One thread reading and hashing: a buffer that stays in a core's L2 cache between the copy out of the page
# cache and the hash, and large enough that the per-call overhead is noise.
INLINE_CHUNK = 256 << 10


def read_exact_into(fd: int, view: memoryview, offset: int, *, what: str) -> None:
    """Fill ``view`` from ``fd`` at ``offset``; a short file is an integrity problem, not a partial read."""
    done = 0
    total = len(view)
    while done < total:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise truncated(what, offset + done, total, offset)
        done += n


def truncated(what: str, end: int, total: int, offset: int) -> Exception:
    """The error for a file that ended at byte ``end`` while ``total`` bytes were read at ``offset``."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import IntegrityError

    return IntegrityError(f"{what} ended after {end} bytes while reading {total} bytes at {offset}",
                          fix="the file was truncated; re-stage it or recapture")


def write_all(fd: int, data: bytes | bytearray | memoryview, *, what: str, path: Path | str) -> None:
    """Write every byte (os.write may write less); ENOSPC/EDQUOT become one clear error."""
    view = memoryview(data).cast("B")
    try:
        while view:
            n = os.write(fd, view)
            view = view[n:]
    except OSError as exc:
        raise space_error(exc, what=what, path=path) from None


def _pipelined(fd: int, size: int, offset: int, consume: Callable[[memoryview], None],
               progress: Progress | None, *, what: str, chunk: int = CHUNK, ring: int = _RING) -> None:
    """Read ``size`` bytes from ``fd`` in a reader thread; call ``consume`` on each chunk in order."""
    if size == 0:
        if progress:
            progress(0, 0)
        return
    # SimpleQueue: a lock-free hand-off in C (queue.Queue takes a Condition per put and get).
    free: queue.SimpleQueue = queue.SimpleQueue()
    full: queue.SimpleQueue = queue.SimpleQueue()
    for _i in range(min(ring, -(-size // chunk))):
        free.put(bytearray(min(chunk, size)))
    stop = threading.Event()

    def reader() -> None:
        pos = 0
        try:
            while pos < size and not stop.is_set():
                buf = free.get()
                if buf is None:
                    return
                n = min(len(buf), size - pos)
                view = memoryview(buf)[:n]
                read_exact_into(fd, view, offset + pos, what=what)
                full.put((view, buf))
                pos += n
            full.put(None)
        except BaseException as exc:  # handed to the consumer thread, which re-raises it
            full.put(exc)

    thread = threading.Thread(target=reader, name="coldsnap-payload-reader", daemon=True)
    thread.start()
    done = 0
    try:
        while True:
            item = full.get()
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            view, buf = item
            consume(view)
            done += len(view)
            view.release()
            free.put(buf)
            if progress:
                progress(done, size)
    finally:
        stop.set()
        free.put(None)
        thread.join()


def _inline(fd: int, size: int, offset: int, consume: Callable[[memoryview], None],
            progress: Progress | None, *, what: str, chunk: int = INLINE_CHUNK,
            progress_every: int = CHUNK) -> None:
    """Like :func:`_pipelined` in the calling thread: one reused buffer, no thread, no queue.

    ``progress`` is called about every ``progress_every`` bytes (and at the end), not per chunk.
    """
    if size == 0:
        if progress:
            progress(0, 0)
        return
    buf = bytearray(min(chunk, size))
    whole = memoryview(buf)
    full = len(buf)
    pos = 0
    reported = 0
    try:
        while pos < size:
            n = min(full, size - pos)
            view = whole if n == full else whole[:n]
            read_exact_into(fd, view, offset + pos, what=what)
            consume(view)
            pos += n
            if progress and (pos - reported >= progress_every or pos == size):
                reported = pos
                progress(pos, size)
    finally:
        whole.release()


def hash_fd(fd: int, size: int, *, offset: int = 0, progress: Progress | None = None,
            what: str = "payload", pipelined: bool = True) -> str:
    """Lower-case hex SHA-256 of ``size`` bytes of ``fd`` starting at ``offset``.

    ``pipelined=False`` reads and hashes in the calling thread (see the module doc: for callers that
    already keep every core busy). Both read every byte; a file shorter than ``offset + size`` raises
    the same IntegrityError.
    """
    h = hashlib.sha256()
    if pipelined:
        _pipelined(fd, size, offset, h.update, progress, what=what, chunk=HASH_CHUNK, ring=_HASH_RING)
    else:
        _inline(fd, size, offset, h.update, progress, what=what)
    return h.hexdigest()


def default_jobs() -> int:
    """How many files to hash at once by default: the CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def copy_and_hash(src_fd: int, dst_fd: int, size: int, *, progress: Progress | None = None,
                  what: str = "payload", dst_path: Path | str = "") -> str:
    """Copy ``size`` bytes from ``src_fd`` to the current position of ``dst_fd``; return their SHA-256 hex."""
    h = hashlib.sha256()

    def consume(view: memoryview) -> None:
        h.update(view)
        write_all(dst_fd, view, what=what, path=dst_path)

    _pipelined(src_fd, size, 0, consume, progress, what=what)
    return h.hexdigest()
