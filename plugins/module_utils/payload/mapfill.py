"""CPU hydration without copying the model bytes: the verified pack mapped over the arenas.

A CPU engine's weight arenas are private anonymous mappings at fixed addresses
(``coldsnap_engines.common.arena.CpuArena``). The pack stores every model extent at a
4 KiB-aligned offset, so wherever an extent's destination address and its pack offset
agree modulo the page size, the whole pages inside the extent can be replaced by a
``mmap(MAP_PRIVATE | MAP_FIXED)`` of the pack itself: the pages come from the page cache
on first touch, copy-on-write, and the pack file is never written. What cannot be mapped
(an extent whose address and offset disagree, the partial pages at an extent's ends,
extents with a digest to check, any failed ``mmap``) is copied as before, and the
residual is always verified and copied.

Legality, decided per extent before anything is mapped: the destination is an
allocation the engine declared a private CPU mapping it owns
(``LiveAllocation.private_mapping``), ``/proc/self/maps`` confirms the whole range is
private memory, and destination address, file offset and length are page multiples.

Integrity: the copy path reads the pack once, between the verifier's identity check
(validation record or full SHA-256) and the re-check after the fill. A mapping reads the
pack later, page by page, for as long as the engine serves. So the mapped bytes are
bound to the same identity for that whole time: a :class:`Lease` keeps a descriptor of
the verified inode and the identity (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)
recorded at verification; it is re-checked right after mapping (a mismatch undoes the
mappings and fails the hydration) and before every export of the arenas (a changed pack
is never captured again). The lease also holds a shared ``flock`` on the pack, which the
node cache's delete path honours (:meth:`NodeCache.pack_in_use`).

Lifecycle: releasing an arena (sleep, capture) maps fresh anonymous memory over it at
the same address and drops the lease, so no later CRIU image holds a mapping or a
descriptor of the pack; :func:`pack_references` is the guard the integrations run after
a release.

``COLDSNAP_CPU_MAP=0`` in the engine's environment turns mapping off (every byte copied).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import functools
import mmap
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import IntegrityError
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import PACK_DIR
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.records import FileIdentity
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.streams import hash_fd

PAGE = mmap.PAGESIZE
ENV_SWITCH = "COLDSNAP_CPU_MAP"
MAX_MAPPINGS = 16384  # well under vm.max_map_count (65530): beyond it the hydration copies instead
PACK_MARK = f"/{PACK_DIR}/"


def enabled() -> bool:
    """Mapping is on unless ``COLDSNAP_CPU_MAP`` is 0/off/false/no."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "off", "false", "no")


@functools.cache
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    return libc


_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)


def _mmap_fixed(address: int, length: int, flags: int, fd: int, offset: int, *, what: str) -> None:
    got = _libc().mmap(address, length, mmap.PROT_READ | mmap.PROT_WRITE, flags | mmap.MAP_PRIVATE | _MAP_FIXED,
                       fd, offset)
    if got == _MAP_FAILED or got != address:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap({what}, {length} bytes at {address:#x}) failed: {os.strerror(err)}")


def map_file(address: int, length: int, fd: int, offset: int) -> None:
    """Map ``fd[offset : offset + length]`` copy-on-write over ``[address, address + length)``."""
    _mmap_fixed(address, length, 0, fd, offset, what="file")


def anonymize(address: int, length: int) -> None:
    """Replace ``[address, address + length)`` by fresh private anonymous memory (zeros), same address."""
    _mmap_fixed(address, length, mmap.MAP_ANONYMOUS, -1, 0, what="anonymous")


def page_span(size: int) -> int:
    return (size + PAGE - 1) // PAGE * PAGE


def _maps() -> list[tuple[int, int, str, str]]:
    """(start, end, perms, path) of every VMA of this process."""
    out = []
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            parts = line.split(None, 5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi, parts[1], parts[5].strip() if len(parts) > 5 else ""))
    return out


def is_private_mapping(address: int, size: int, maps: Sequence[tuple[int, int, str, str]] | None = None) -> bool:
    """True when ``[address, address + size)`` (page-rounded) lies in private, writable VMAs without holes."""
    if address % PAGE or size <= 0:
        return False
    pos, end = address, address + page_span(size)
    for lo, hi, perms, _path in sorted(maps if maps is not None else _maps()):
        if hi <= pos or lo > pos:
            continue
        if perms[1] != "w" or perms[3] != "p":
            return False
        pos = hi
        if pos >= end:
            return True
    return False


def pack_references() -> list[str]:
    """Mappings and open descriptors of node-cache packs in this process (must be none after a release)."""
    found = [f"mapping {lo:#x}-{hi:#x} {path}" for lo, hi, _p, path in _maps() if PACK_MARK in path]
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{name}")
                if PACK_MARK in target and target.split("/")[-1].endswith((".pack", ".pack (deleted)")):
                    found.append(f"descriptor {name} {target}")
    return found


# ------------------------------------------------------------------------- leases

@dataclass
class Lease:
    """A verified pack some arena pages map: a descriptor of the inode, the identity it was verified
    with, a shared flock, and the mapped ranges ``(address, length)``."""

    path: str
    sha256: str
    size: int
    fd: int
    identity: FileIdentity
    ranges: list[tuple[int, int]] = field(default_factory=list)

    @property
    def mapped_bytes(self) -> int:
        return sum(n for _a, n in self.ranges)

    def recheck(self) -> None:
        """Raise IntegrityError when the mapped pack changed since it was verified (a ctime-only change,
        such as an unlink or rename of the name, is settled by re-hashing the mapped inode)."""
        now = FileIdentity.of_fd(self.fd)
        if now == self.identity:
            return
        changed = [k for k, v in self.identity.as_dict().items() if now.as_dict()[k] != v]
        if changed == ["st_ctime_ns"]:
            if "sha256:" + hash_fd(self.fd, self.size, what=f"model payload {self.path}") == self.sha256 \
                    and FileIdentity.of_fd(self.fd) == now:
                self.identity = now
                return
        raise IntegrityError(f"model payload {self.path}, mapped into the engine's weights, changed after it was "
                             f"verified ({', '.join(changed)} differ)",
                             fix="the served weights may differ from the capture: restore again from a verified pack; "
                                 "nothing may write the node cache's packs in place")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # also drops the flock
            self.fd = -1

    def as_dict(self) -> dict:
        return {"path": self.path, "sha256": self.sha256, "mapped_bytes": self.mapped_bytes, "ranges": len(self.ranges)}


_LOCK = threading.Lock()
_LEASES: list[Lease] = []


def hold(payload, ranges: Sequence[tuple[int, int]]) -> Lease:
    """Register ``ranges`` as mapped from the verified ``payload`` (a VerifiedPayload)."""
    fd = os.dup(payload.fd)  # non-inheritable, like the original
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    lease = Lease(str(payload.path), payload.sha256, payload.size, fd, payload.identity, list(ranges))
    with _LOCK:
        _LEASES.append(lease)
    return lease


def forget_range(address: int, length: int) -> int:
    """Drop the lease ranges inside ``[address, address + length)`` (the caller replaced that memory);
    a lease with no range left closes its descriptor. Returns the bytes forgotten."""
    end = address + length
    dropped = 0
    with _LOCK:
        for lease in list(_LEASES):
            keep = []
            for a, n in lease.ranges:
                if address <= a and a + n <= end:
                    dropped += n
                else:
                    keep.append((a, n))
            lease.ranges = keep
            if not keep:
                lease.close()
                _LEASES.remove(lease)
    return dropped


def leases() -> list[Lease]:
    with _LOCK:
        return list(_LEASES)


def check_leases() -> None:
    """Re-check every mapped pack against its verified identity (IntegrityError on a change)."""
    for lease in leases():
        lease.recheck()


def in_range(address: int, length: int) -> bool:
    """Some lease maps memory inside ``[address, address + length)``."""
    return any(address < a + n and a < address + length for lease in leases() for a, n in lease.ranges)


# ------------------------------------------------------------------------- planning

@dataclass(frozen=True)
class Run:
    """``size`` bytes of the pack at ``file_offset`` mapped at ``address`` (allocation ``allocation`` + ``offset``)."""

    allocation: str
    offset: int
    address: int
    size: int
    file_offset: int


def plan(jobs, regions: dict[str, tuple[int, int]], fd: int, *, limit: int = MAX_MAPPINGS):
    """Split fill jobs into (runs to map, jobs to copy, {reason model bytes are copied: bytes}).

    A job is a candidate when it writes one piece of ``fd`` into a region, without a digest
    to check. Its whole pages are mapped when destination address and file offset agree modulo
    the page size; the partial pages at its ends are copied. Adjacent runs that continue each
    other in memory and in the file become one mapping; more than ``limit`` mappings and
    every byte is copied.
    """
    runs: list[Run] = []
    whole: list = []  # jobs copied as they are
    parts: list = []  # the partial pages at the ends of mapped jobs
    mapped_jobs: list = []
    reasons: dict[str, int] = {}

    def why(reason: str, n: int) -> None:
        reasons[reason] = reasons.get(reason, 0) + n

    for job in jobs:
        p = job.pieces[0] if len(job.pieces) == 1 else None
        reason = None
        region = regions.get(job.allocation)
        if p is None or p.fd != fd:
            whole.append(job)  # not pack bytes (the residual): always copied
            continue
        if job.sha256 is not None:
            reason = "hash-checked extent"
        elif region is None:
            reason = f"allocation {job.allocation} is not a private CPU mapping"
        elif (region[0] + job.offset - p.offset) % PAGE:
            reason = "extent address and pack offset not page-aligned together"
        elif (region[0] + job.offset + job.size) // PAGE * PAGE <= page_span(region[0] + job.offset):
            reason = "extent smaller than a page"
        if reason is not None:
            whole.append(job)
            why(reason, job.size)
            continue
        dst = region[0] + job.offset
        lo, hi = page_span(dst), (dst + job.size) // PAGE * PAGE
        head, tail = lo - dst, dst + job.size - hi
        mapped_jobs.append(job)
        if head:
            parts.append(_part(job, 0, head))
        if tail:
            parts.append(_part(job, job.size - tail, tail))
        runs.append(Run(job.allocation, job.offset + head, lo, hi - lo, p.offset + head))
    runs.sort(key=lambda r: r.address)
    merged: list[Run] = []
    for r in runs:
        prev = merged[-1] if merged else None
        if prev and prev.allocation == r.allocation and prev.address + prev.size == r.address \
                and prev.file_offset + prev.size == r.file_offset:
            merged[-1] = Run(prev.allocation, prev.offset, prev.address, prev.size + r.size, prev.file_offset)
        else:
            merged.append(r)
    if len(merged) > limit:
        why(f"more than {limit} mappings", sum(j.size for j in mapped_jobs))
        return [], whole + mapped_jobs, reasons
    if parts:
        why("partial pages at extent ends", sum(j.size for j in parts))
    return merged, whole + parts, reasons


def _part(job, start: int, size: int):
    """``job`` cut to ``size`` destination bytes from ``start`` (a one-piece job)."""
    p = job.pieces[0]
    return dataclasses.replace(job, offset=job.offset + start, size=size,
                               pieces=(dataclasses.replace(p, offset=p.offset + start, size=size),))


def describe_errno(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return f"mmap of the pack failed ({name})"
