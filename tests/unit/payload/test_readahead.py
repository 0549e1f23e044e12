"""Reading a pack into the page cache ahead of its use: a restore's prepare step queues the reads of
every pack it will hydrate from, so the engine (which maps or reads the pack only after eviction and
the CRIU and CUDA restores) does not fault a pack that left the cache in from disk on its first
request. The whole file is queued, not only the kernel's first read-ahead window."""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common import fsutil
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.weights import read_packs_ahead

SIZE = 48 << 20  # several times the largest read the kernel queues for one hint on common disks


def resident(path: Path) -> float:
    """The share of ``path``'s pages in the page cache (``mincore`` over a read-only mapping of it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            assert libc.mincore(ctypes.c_void_p(addr), size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec) / pages


def wait_resident(path: Path, share: float, timeout: float = 20) -> float:
    deadline = time.monotonic() + timeout
    while (got := resident(path)) < share and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


@pytest.fixture
def evicted_file():
    """A file in a disk-backed directory, written, synced and dropped from the page cache."""
    path = Path("/var/tmp") / f"coldsnap-readahead-{os.getpid()}.bin"
    with open(path, "wb") as fh:
        for i in range(SIZE >> 20):
            fh.write(bytes([i % 251]) * (1 << 20))
        fh.flush()
        os.fsync(fh.fileno())
        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    try:
        if resident(path) > 0.5:
            pytest.fail(f"{path.parent} kept the file cached after POSIX_FADV_DONTNEED (tmpfs?): the test "
                        "needs a disk-backed /var/tmp")
        yield path
    finally:
        path.unlink(missing_ok=True)


def test_the_whole_file_is_read_into_the_page_cache(evicted_file):
    started = time.monotonic()
    assert fsutil.readahead(evicted_file) is True
    queued = time.monotonic() - started
    assert wait_resident(evicted_file, 1.0) == 1.0, "every page, not the first read-ahead window"
    assert queued < 20


def test_a_symbolic_link_or_a_missing_file_is_not_read(tmp_path, evicted_file):
    link = tmp_path / "link.pack"
    link.symlink_to(evicted_file)
    assert fsutil.readahead(link) is False
    assert fsutil.readahead(tmp_path / "missing.pack") is False
    time.sleep(0.2)
    assert resident(evicted_file) < 0.5, "nothing was read through the link"


def test_the_packs_of_native_workers_are_read_ahead_and_no_other(tmp_path, evicted_file):
    plan = {"workers": {
        "worker-0": {"provider": "native", "pack": {"path": str(evicted_file), "size": SIZE, "sha256": "x"}},
        "worker-1": {"provider": "native", "pack": {"path": str(evicted_file), "size": SIZE, "sha256": "x"}},
        "worker-2": {"provider": "recovery", "pack": None},
        "worker-3": {"provider": "native", "pack": {"path": str(tmp_path / "gone.pack"), "size": 1, "sha256": "y"}},
    }}
    assert read_packs_ahead(plan) == [str(evicted_file)], "one queue per pack; a missing one is skipped"
    assert wait_resident(evicted_file, 1.0) == 1.0
    assert read_packs_ahead({"workers": {"worker-0": {"provider": "recovery", "pack": None}}}) == []
    assert read_packs_ahead({}) == []
