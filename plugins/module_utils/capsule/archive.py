"""Layer archives: deterministic tar writing and extraction that cannot escape its root.

Writing: a capsule layer is a plain tar of the unit's state and its declared
cache seeds, with names in sorted order, owner 0:0, no user/group names and the
files' own mode bits and mtimes, so the same inputs give the same bytes (and so
the same digest: an unchanged rebuild is a no-op).

Extraction (FAULTS.md 10): every member is checked before anything is written:
absolute names, ``..`` components, symlinks whose target leaves the root, hard
links to anything but an already extracted regular file inside the root,
device nodes, FIFOs and any other special member are refused; no member may
pass through a symlink. Members are written under a temporary directory beside
the destination that is renamed into place only when the whole archive (and its
digest, when one is expected) checked out, so a refused archive leaves nothing
behind, inside or outside.

A layer in a local regular file (a capsule's blob) is read once, in file order, with
``pread`` in large chunks: tarfile parses only the headers, every byte goes into the layer
digest on this thread while each extracted file's own SHA-256 and its write run on a
second one (two cores hash at once). A stream (Docker's archive API) goes through
tarfile's streaming reader. Either way each extracted file's digest is reported, so a
caller that checks the files against a sealed list need not read them again.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import os
import posixpath
import shutil
import stat
import tarfile
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
    space_error,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import fsync_dir, temp_path_for

CHUNK = 1 << 20
NAME_MAX, PATH_MAX = 255, 4096  # Linux's limits for one name and a whole path
MTIME_MAX = 1 << 34  # seconds (year 2514): an archive's mtime beyond it, or negative or not finite, is refused


class ArchiveError(ColdSnapError):
    """An archive member that would write outside its root or create something unsafe."""


@dataclass(frozen=True)
class LayerEntry:
    """One member of a layer: ``arcname`` (relative posix path) from ``source``.

    ``source=None`` is a synthesized directory with ``mode`` and ``mtime``.
    """

    arcname: str
    source: Path | None
    mode: int = 0o755
    mtime: int = 0


# ----------------------------------------------------------------------------- names

def normalize_member_name(name: str, *, what: str = "archive member") -> str:
    """A member name as a clean relative posix path; refuse absolute names and ``..``."""
    if not name or "\x00" in name:
        raise ArchiveError(f"{what} {name!r} has an empty or NUL-bearing name",
                           fix="rebuild the archive; member names must be plain relative paths")
    if name.startswith("/"):
        raise ArchiveError(f"{what} {name!r} is an absolute path",
                           fix="archives extracted by ColdSnap may hold relative names only; rebuild it")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise ArchiveError(f"{what} {name!r} contains '..' and would write outside the extraction root",
                           fix="this archive is unsafe; rebuild the capsule from its source state")
    if any(len(p.encode("utf-8", "surrogateescape")) > NAME_MAX for p in parts) or len(name) > PATH_MAX:
        raise ArchiveError(f"{what} {name[:60]!r}... has a name longer than a file system allows",
                           fix="this archive is malformed; rebuild the capsule")
    return "/".join(parts)


def _link_target_inside(member_name: str, linkname: str) -> bool:
    """True when a symlink at ``member_name`` pointing to ``linkname`` stays inside the root as text.

    Not enough alone: a target may pass through another symlink of the same archive
    (``a/up -> ..``, then ``b -> a/up/..``); :func:`_links_stay_inside` checks the extracted
    tree for that before anything is moved into place.
    """
    if not linkname or linkname.startswith("/") or "\x00" in linkname:
        return False
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(member_name), linkname))
    return joined != ".." and not joined.startswith("../")


# Extracted files and directories never keep set-user-ID, set-group-ID, sticky or
# world-write bits, whatever the archive says.
SAFE_MODE_MASK = 0o0775


# ----------------------------------------------------------------------------- collecting

def collect_tree(src: Path, arc_prefix: str, *, exclude: Callable[[str], bool] | None = None,
                 what: str = "directory") -> tuple[list[LayerEntry], list[str]]:
    """List a directory for a layer: (entries under ``arc_prefix``, excluded relative paths).

    Symlinks are kept as links but must stay inside ``src``; device nodes, FIFOs
    and sockets are refused (a capsule carries regular state only).
    """
    src = Path(src)
    st = os.lstat(src)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ArchiveError(f"{what} {src} is not a directory",
                           fix="give the directory itself (not a symlink or file)")
    prefix = normalize_member_name(arc_prefix, what="layer path") if arc_prefix.strip("/") else ""
    entries: list[LayerEntry] = []
    excluded: list[str] = []
    if prefix:
        entries.append(LayerEntry(prefix, src))
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, src)
        kept_dirs = []
        for name in dirnames + sorted(filenames):
            full = os.path.join(dirpath, name)
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            rel = rel.replace(os.sep, "/")
            if exclude is not None and exclude(rel):
                excluded.append(rel)
                continue
            mode = os.lstat(full).st_mode
            if stat.S_ISLNK(mode):
                target = os.readlink(full)
                if not _link_target_inside(rel, target):
                    raise ArchiveError(
                        f"{what} {src} holds symlink {rel} -> {target}, which points outside it",
                        fix="capsule state may only link inside itself; replace the link with the file it names")
            elif not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise ArchiveError(f"{what} {src} holds special file {rel} (not a regular file, directory or link)",
                                   fix="remove device nodes, FIFOs and sockets from the state before building")
            if name in dirnames and stat.S_ISDIR(mode):
                kept_dirs.append(name)
            arc = f"{prefix}/{rel}" if prefix else rel
            entries.append(LayerEntry(arc, Path(full)))
        dirnames[:] = kept_dirs
    entries.sort(key=lambda e: e.arcname)
    return entries, sorted(excluded)


def parent_dirs(arcnames: Iterable[str]) -> list[str]:
    """Every proper parent directory of the given names (for synthesized directory members)."""
    out: set[str] = set()
    for name in arcnames:
        parts = name.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            out.add("/".join(parts[:i]))
    return sorted(out)


# ----------------------------------------------------------------------------- writing

class HashingWriter:
    """A write-only file object that hashes and counts what passes through (to ``sink`` when given)."""

    def __init__(self, sink: IO[bytes] | None = None) -> None:
        self.sink = sink
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        if self.sink is not None:
            self.sink.write(data)
        return len(data)

    def flush(self) -> None:
        if self.sink is not None:
            self.sink.flush()

    @property
    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()


def write_layer(entries: list[LayerEntry], out: IO[bytes] | None, *,
                synthesize_parents: bool = False) -> tuple[str, int]:
    """Write a deterministic tar of ``entries`` to ``out`` (None: only hash it); return (digest, size).

    Parent directories are not synthesized by default: a layer applied over a
    base must not reset the modes of directories the base already has (such as
    /root); whoever applies it creates missing parents as 0755.
    """
    writer = HashingWriter(out)
    with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        add_entries(tar, entries, synthesize_parents=synthesize_parents)
    return writer.digest, writer.size


def add_entries(tar: tarfile.TarFile, entries: list[LayerEntry], *, synthesize_parents: bool = True) -> None:
    """Append ``entries`` (sorted, parents synthesized as 0755 directories) to an open tar."""
    names = {e.arcname for e in entries}
    synthesized = [LayerEntry(d, None) for d in parent_dirs(names) if d not in names] if synthesize_parents else []
    seen_inodes: dict[tuple[int, int], str] = {}
    for entry in sorted(entries + synthesized, key=lambda e: e.arcname):
        info = _tarinfo(entry, seen_inodes)
        if info.isreg():
            with open(entry.source, "rb") as fh:  # type: ignore[arg-type]
                tar.addfile(info, _ExactReader(fh, info.size, entry.source))
        else:
            tar.addfile(info)


def entry_fingerprint(entries: list[LayerEntry]) -> list[list]:
    """A cheap identity of the inputs (name, type, mode, size, mtime_ns, link) for rebuild decisions."""
    out: list[list] = []
    for e in sorted(entries, key=lambda e: e.arcname):
        if e.source is None:
            out.append([e.arcname, "d", e.mode, 0, e.mtime, ""])
            continue
        st = os.lstat(e.source)
        kind = "l" if stat.S_ISLNK(st.st_mode) else "d" if stat.S_ISDIR(st.st_mode) else "f"
        link = os.readlink(e.source) if kind == "l" else ""
        out.append([e.arcname, kind, stat.S_IMODE(st.st_mode), st.st_size if kind == "f" else 0,
                    st.st_mtime_ns, link])
    return out


def _tarinfo(entry: LayerEntry, seen_inodes: dict[tuple[int, int], str]) -> tarfile.TarInfo:
    info = tarfile.TarInfo(entry.arcname)
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if entry.source is None:
        info.type = tarfile.DIRTYPE
        info.mode = entry.mode
        info.mtime = entry.mtime
        return info
    st = os.lstat(entry.source)
    info.mode = stat.S_IMODE(st.st_mode)
    info.mtime = min(max(int(st.st_mtime), 0), MTIME_MAX - 1)  # what extraction accepts (a file dated 1969 too)
    if stat.S_ISDIR(st.st_mode):
        info.type = tarfile.DIRTYPE
    elif stat.S_ISLNK(st.st_mode):
        info.type = tarfile.SYMTYPE
        info.linkname = os.readlink(entry.source)
    elif stat.S_ISREG(st.st_mode):
        key = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and key in seen_inodes:
            info.type = tarfile.LNKTYPE
            info.linkname = seen_inodes[key]
        else:
            seen_inodes[key] = entry.arcname
            info.type = tarfile.REGTYPE
            info.size = st.st_size
    else:
        raise ArchiveError(f"{entry.source} is a special file", fix="remove it from the capsule inputs")
    return info


class _ExactReader:
    """Reads exactly ``size`` bytes; a file that changes size while archived is an error, not a torn layer."""

    def __init__(self, fh: IO[bytes], size: int, path: Path | None) -> None:
        self.fh, self.left, self.path = fh, size, path

    def read(self, n: int = -1) -> bytes:
        want = self.left if n is None or n < 0 else min(n, self.left)
        data = self.fh.read(want)
        if len(data) < want:
            raise ArchiveError(f"{self.path} shrank while it was being archived",
                               fix="build the capsule only after the captured process has stopped")
        self.left -= len(data)
        return data


# ----------------------------------------------------------------------------- reading

class HashingReader:
    """A read-only file object that hashes what is read through it."""

    def __init__(self, fh: IO[bytes]) -> None:
        self.fh = fh
        self.sha = hashlib.sha256()
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        data = self.fh.read(n)
        self.sha.update(data)
        self.size += len(data)
        return data

    def drain(self) -> None:
        while self.read(CHUNK):
            pass

    @property
    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()


COPY_CHUNK = 4 << 20  # one pread of a local layer: large enough that Python's per-call cost vanishes
COPY_AHEAD = 3  # chunks handed to the file thread and not yet written: bounds the memory to ~16 MiB


def _is_local_file(fileobj: IO[bytes]) -> bool:
    """True for a regular file opened at its start (a capsule blob): the fast path may read it by offset."""
    try:
        return stat.S_ISREG(os.fstat(fileobj.fileno()).st_mode) and fileobj.seekable() and fileobj.tell() == 0
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return False


def _short(what: str, info: tarfile.TarInfo) -> ArchiveError:
    return ArchiveError(f"{what} member {info.name!r} ends before its {info.size} bytes",
                        fix="the stored bytes are truncated or corrupt; pull or rebuild the capsule")


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _hash_and_write(sha: Any, fd: int, data: bytes | memoryview) -> None:
    sha.update(data)
    _write_all(fd, data)


class _StreamLayer:
    """A layer read as a stream (tarfile's streaming reader over a hashing reader)."""

    def __init__(self, fileobj: IO[bytes]) -> None:
        self.reader = HashingReader(fileobj)
        self.tar: tarfile.TarFile | None = None

    def __enter__(self) -> _StreamLayer:
        self.tar = tarfile.open(fileobj=self.reader, mode="r|")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.tar is not None:
            self.tar.close()

    def _open(self) -> tarfile.TarFile:
        if self.tar is None:
            raise AssertionError("a layer is read inside its with block")
        return self.tar

    def members(self) -> Iterator[tarfile.TarInfo]:
        yield from self._open()

    def copy(self, info: tarfile.TarInfo, fd: int, *, what: str) -> str:
        """Write the member's bytes to ``fd``; return their digest."""
        src = self._open().extractfile(info)
        if src is None:  # a regular file member always has a reader
            raise AssertionError(f"tar member {info.name} has no data reader")
        sha = hashlib.sha256()
        left = info.size
        while left:
            data = src.read(min(CHUNK, left))
            if not data:
                raise _short(what, info)
            _hash_and_write(sha, fd, data)
            left -= len(data)
        return "sha256:" + sha.hexdigest()

    def finish(self) -> str:
        """Read to the end of the stream; return the layer's digest."""
        self.reader.drain()
        return self.reader.digest


class _LocalLayer:
    """A layer in a local regular file: tarfile parses the headers (random access, no data read);
    every byte is read once, in file order, into the layer digest; a member's bytes are hashed and
    written on a second thread while the next chunk is read and hashed here. The reads land in a
    small ring of buffers allocated once (fresh memory for every chunk costs page faults)."""

    def __init__(self, fileobj: IO[bytes]) -> None:
        self.fileobj = fileobj
        self.fd = fileobj.fileno()
        self.size = os.fstat(self.fd).st_size
        self.pos = 0
        self.sha = hashlib.sha256()
        self.tar: tarfile.TarFile | None = None
        self.pool: ThreadPoolExecutor | None = None
        # A chunk is handed to the file thread; before its buffer comes round again, at most
        # COPY_AHEAD later chunks are pending, so COPY_AHEAD + 1 buffers never overlap a pending one.
        self.ring = [memoryview(bytearray(COPY_CHUNK)) for _slot in range(COPY_AHEAD + 1)]
        self.turn = 0

    def __enter__(self) -> _LocalLayer:
        self.tar = tarfile.open(fileobj=self.fileobj, mode="r:")
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="coldsnap-extract")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        if self.tar is not None:
            self.tar.close()

    def members(self) -> Iterator[tarfile.TarInfo]:
        if self.tar is None:
            raise AssertionError("a layer is read inside its with block")
        end = 0  # where the previous member's data ended: headers only ever move forward
        for info in self.tar:
            if info.size < 0 or info.offset < end or info.offset_data + info.size > self.size:
                raise ArchiveError(f"layer member {info.name!r} claims {info.size} bytes at offset "
                                   f"{info.offset_data}, outside the {self.size}-byte layer or before the "
                                   "previous member", fix="the stored bytes are corrupt; pull or rebuild the capsule")
            end = info.offset_data + info.size
            yield info

    def _read(self, size: int) -> memoryview:
        buf = self.ring[self.turn]
        self.turn = (self.turn + 1) % len(self.ring)
        n = os.preadv(self.fd, [buf[:size]], self.pos)
        data = buf[:n]
        self.sha.update(data)
        self.pos += n
        return data

    def _hash_to(self, offset: int) -> None:
        while self.pos < offset:
            if not self._read(min(COPY_CHUNK, offset - self.pos)):
                return  # the end of the file: the digest check names the damage

    def copy(self, info: tarfile.TarInfo, fd: int, *, what: str) -> str:
        if self.pool is None:
            raise AssertionError("a layer is read inside its with block")
        self._hash_to(info.offset_data)
        if self.pos != info.offset_data:
            raise _short(what, info)
        sha = hashlib.sha256()
        end = info.offset_data + info.size
        if info.size <= COPY_CHUNK:  # one chunk: handing it to the thread costs more than it saves
            data = self._read(info.size)
            if len(data) != info.size:
                raise _short(what, info)
            _hash_and_write(sha, fd, data)
            return "sha256:" + sha.hexdigest()
        pending: collections.deque[Future[None]] = collections.deque()
        try:
            while self.pos < end:
                data = self._read(min(COPY_CHUNK, end - self.pos))
                if not data:
                    raise _short(what, info)
                pending.append(self.pool.submit(_hash_and_write, sha, fd, data))
                while len(pending) > COPY_AHEAD:
                    pending.popleft().result()
        finally:
            # Every queued write ends (lands or fails) before a buffer is reused or ``fd`` closed, the
            # failed ones too: only then is the first failure raised.
            futures.wait(pending)
            for fut in pending:
                fut.result()
        return "sha256:" + sha.hexdigest()

    def finish(self) -> str:
        self._hash_to(self.size)
        return "sha256:" + self.sha.hexdigest()


def check_member(info: tarfile.TarInfo, seen_files: set[str], *, what: str) -> str:
    """Validate one member; return its normalized name. Raises ArchiveError when unsafe.

    ``seen_files`` holds the regular members met so far: a hard link may only
    name one of them (so it can never reach a file outside the archive).
    """
    name = normalize_member_name(info.name, what=f"{what} member")
    if info.isdev() or info.isfifo():
        raise ArchiveError(f"{what} member {info.name!r} is a device node or FIFO",
                           fix="capsules hold regular files, directories and internal links only")
    if info.issym():
        if not _link_target_inside(name, info.linkname):
            raise ArchiveError(f"{what} member {info.name!r} is a symlink to {info.linkname!r}, outside the root",
                               fix="this archive is unsafe; rebuild the capsule from its source state")
    elif info.islnk():
        target = normalize_member_name(info.linkname, what=f"{what} hard link target")
        if target not in seen_files:
            raise ArchiveError(
                f"{what} member {info.name!r} is a hard link to {info.linkname!r}, "
                "which is not a regular file extracted earlier from the same archive",
                fix="this archive is unsafe; rebuild the capsule from its source state")
    elif not (info.isreg() or info.isdir()):
        raise ArchiveError(f"{what} member {info.name!r} has unsupported type {info.type!r}",
                           fix="capsules hold regular files, directories and internal links only")
    elif info.size < 0:
        raise ArchiveError(f"{what} member {info.name!r} has a negative size ({info.size})",
                           fix="this archive is malformed; rebuild the capsule")
    elif info.sparse is not None:  # its holes are tarfile's to fill; a layer read by offset would not
        raise ArchiveError(f"{what} member {info.name!r} is a sparse file",
                           fix="capsules hold plain regular files; rebuild the capsule")
    if not name and not info.isdir():
        raise ArchiveError(f"{what} member {info.name!r} names the root itself", fix="rebuild the archive")
    mtime = info.mtime
    if isinstance(mtime, bool) or not isinstance(mtime, (int, float)) or not 0 <= mtime < MTIME_MAX:
        raise ArchiveError(f"{what} member {info.name!r} has modification time {mtime!r}, outside 0..{MTIME_MAX}",
                           fix="this archive is malformed; rebuild the capsule")
    return name


def _no_symlink_on_path(root: Path, rel: str, what: str) -> None:
    """Refuse when any existing parent of ``root/rel`` is a symlink (a member must not pass through one)."""
    cur = root
    for part in rel.split("/")[:-1]:
        cur = cur / part
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise ArchiveError(f"{what} member {rel!r} passes through symlink {part!r}",
                               fix="this archive is unsafe; rebuild the capsule from its source state")
        if not stat.S_ISDIR(st.st_mode):
            raise ArchiveError(f"{what} member {rel!r} has a non-directory parent {part!r}",
                               fix="this archive is unsafe; rebuild the capsule from its source state")


def _makedirs(root: Path, rel: str) -> None:
    cur = root
    for part in rel.split("/"):
        if not part:
            continue
        cur = cur / part
        try:
            os.mkdir(cur, 0o755)
        except FileExistsError:
            if stat.S_ISLNK(os.lstat(cur).st_mode):
                raise ArchiveError(f"directory {rel!r} would pass through a symlink",
                                   fix="this archive is unsafe; rebuild the capsule") from None


def safe_extract(fileobj: IO[bytes], dest: Path, *, expected_digest: str | None = None,
                 select: Callable[[str], str | None] | None = None, what: str = "archive",
                 replace: bool = False, digests: dict[str, str] | None = None) -> list[str]:
    """Extract a tar stream into ``dest`` atomically; return the written names.

    ``select(name)`` may map a member name to its name below ``dest`` or return
    None to skip the member. ``expected_digest`` checks the whole stream's
    SHA-256 (the layer digest) before the result is moved into place. ``dest``
    must not exist unless ``replace`` is true (then it is replaced as a whole).
    ``digests``, when given, receives ``sha256:<hex>`` of every regular file written
    (hard links included), by its name below ``dest``.
    """
    dest = Path(dest)
    if dest.exists() and not replace:
        raise ArchiveError(f"extraction destination {dest} already exists",
                           fix="remove it or extract into a new directory")
    dest.parent.mkdir(parents=True, exist_ok=True)
    source: _StreamLayer | _LocalLayer = _LocalLayer(fileobj) if _is_local_file(fileobj) else _StreamLayer(fileobj)
    tmp = temp_path_for(dest)
    os.mkdir(tmp, 0o700)
    written: list[str] = []
    files: set[str] = set()  # every regular member seen (hard-link validation)
    extracted: dict[str, str] = {}  # member name -> name below dest, for extracted regular files
    dir_modes: list[tuple[Path, int, int]] = []
    dir_members: set[str] = set()  # directory entries extracted so far (by their name below dest)
    try:
        with source:
            for info in source.members():
                name = check_member(info, files, what=what)
                if info.isreg() or info.islnk():
                    files.add(name)
                target_name = select(name) if select is not None else name
                if target_name is None:
                    continue
                target_name = normalize_member_name(target_name, what=f"{what} member") if target_name else ""
                if not target_name:
                    if info.isdir():
                        # The root stays 0700 whatever its entry says (captured state is process memory).
                        dir_modes.append((tmp, 0o700, int(info.mtime)))
                        continue
                    raise ArchiveError(f"{what} member {info.name!r} maps onto the root", fix="rebuild the archive")
                _no_symlink_on_path(tmp, target_name, what)
                path = tmp / target_name
                parent_rel = target_name.rpartition("/")[0]
                if parent_rel:
                    _makedirs(tmp, parent_rel)
                if info.isdir():
                    if target_name in dir_members:  # which entry's mode would win is the tar's order
                        raise ArchiveError(f"{what} member {info.name!r} appears twice",
                                           fix="this archive is malformed; rebuild the capsule")
                    dir_members.add(target_name)
                    try:
                        os.mkdir(path, 0o700)
                    except FileExistsError:  # made earlier as the parent of a member listed before it
                        if not stat.S_ISDIR(os.lstat(path).st_mode):
                            raise ArchiveError(f"{what} member {info.name!r} appears twice with different types",
                                               fix="rebuild the archive") from None
                    dir_modes.append((path, info.mode & SAFE_MODE_MASK, int(info.mtime)))
                elif os.path.lexists(path):
                    raise ArchiveError(f"{what} member {info.name!r} appears twice",
                                       fix="this archive is malformed; rebuild the capsule")
                elif info.issym():
                    # Checked against the name it gets below ``dest`` (select may strip a prefix).
                    if not _link_target_inside(target_name, info.linkname):
                        raise ArchiveError(f"{what} member {info.name!r} is a symlink to {info.linkname!r}, which "
                                           "would resolve outside the extraction root",
                                           fix="this archive is unsafe; rebuild the capsule from its source state")
                    os.symlink(info.linkname, path)
                elif info.islnk():
                    link_src = normalize_member_name(info.linkname, what=f"{what} hard link target")
                    if link_src not in extracted:
                        raise ArchiveError(f"{what} member {info.name!r} links to {info.linkname!r}, "
                                           "which is outside the extracted selection",
                                           fix="extract the whole layer, or rebuild the capsule without the link")
                    src_path = tmp / extracted[link_src]
                    if not stat.S_ISREG(os.lstat(src_path).st_mode):
                        raise ArchiveError(f"{what} hard link {info.name!r} does not name a regular file",
                                           fix="rebuild the archive")
                    os.link(src_path, path, follow_symlinks=False)
                    extracted[name] = target_name
                    if digests is not None and extracted[link_src] in digests:
                        digests[target_name] = digests[extracted[link_src]]
                else:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                    try:
                        digest = source.copy(info, fd, what=what)
                    finally:
                        os.close(fd)
                    if digests is not None:
                        digests[target_name] = digest
                    os.chmod(path, info.mode & SAFE_MODE_MASK)
                    os.utime(path, (info.mtime, info.mtime), follow_symlinks=False)
                    extracted[name] = target_name
                written.append(target_name)
            layer_digest = source.finish()
        _links_stay_inside(tmp, what)
        if expected_digest is not None and layer_digest != expected_digest:
            raise IntegrityError(f"{what} has digest {layer_digest}, expected {expected_digest}",
                                 fix="the stored bytes are corrupt; pull or rebuild the capsule")
        os.chmod(tmp, 0o700)
        # Directory modes last: a read-only directory must not block its own members.
        for path, mode, mtime in sorted(dir_modes, key=lambda d: len(str(d[0])), reverse=True):
            os.chmod(path, mode)
            os.utime(path, (mtime, mtime))
        if dest.exists():
            old = temp_path_for(dest)
            os.rename(dest, old)
            os.rename(tmp, dest)
            rmtree(old)
        else:
            os.rename(tmp, dest)
        fsync_dir(dest.parent)
    except tarfile.TarError as exc:
        rmtree(tmp)
        raise ArchiveError(f"{what} is not a readable tar archive: {exc}",
                           fix="the stored bytes are corrupt; pull or rebuild the capsule") from exc
    except OSError as exc:
        rmtree(tmp)
        raise space_error(exc, what=f"the files of {what}", path=dest.parent) from None
    except BaseException:
        rmtree(tmp)
        raise
    return written


def _links_stay_inside(root: Path, what: str) -> None:
    """Every extracted symlink's target walks only real directories of the tree: each component but
    the last must exist below ``root`` as a directory that is not itself a link, and ``..`` never
    climbs above ``root``. A chain through another link (``b -> a/up/..`` with ``a/up -> ..``) is
    refused however its members were ordered."""
    fix = "this archive is unsafe; rebuild the capsule from its source state"
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            link = os.path.join(dirpath, name)
            if not os.path.islink(link):
                continue
            rel_link = os.path.relpath(link, root)
            parts = [p for p in os.path.relpath(dirpath, root).split("/") if p not in ("", ".")]
            target = [p for p in os.readlink(link).split("/") if p not in ("", ".")]
            for i, part in enumerate(target):
                if part == "..":
                    if not parts:
                        raise ArchiveError(f"{what} member {rel_link!r} points above the extraction root", fix=fix)
                    parts.pop()
                    continue
                parts.append(part)
                if i == len(target) - 1:
                    break
                st = os.lstat(os.path.join(root, *parts)) if os.path.lexists(os.path.join(root, *parts)) else None
                if st is None or not stat.S_ISDIR(st.st_mode):
                    raise ArchiveError(f"{what} member {rel_link!r} points through {'/'.join(parts)!r}, which is "
                                       "not a directory of the archive (a link, or missing)", fix=fix)


def rmtree(path: Path) -> None:
    """Remove a tree even when extraction left read-only directories in it (a link or a file: itself;
    nothing when nothing is there)."""
    def onerror(func, p, _exc):
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), 0o700)
            func(p)
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        os.unlink(path)  # a link or a file under a layout's name goes; what a link points at stays
    elif os.path.lexists(path):
        shutil.rmtree(path, onerror=onerror)


def iter_members(fileobj: IO[bytes]) -> Iterator[tarfile.TarInfo]:
    """The members of a tar stream, each checked with :func:`check_member` (names only, no extraction)."""
    files: set[str] = set()
    with tarfile.open(fileobj=fileobj, mode="r|") as tar:
        for info in tar:
            name = check_member(info, files, what="layer")
            if info.isreg() or info.islnk():
                files.add(name)
            yield info


class ChunkReader:
    """A file object over an iterator of byte chunks (Docker's archive stream)."""

    def __init__(self, chunks: Any) -> None:
        self._it = iter(chunks)
        self._buf = b""

    def read(self, n: int = -1) -> bytes:
        while n < 0 or len(self._buf) < n:
            try:
                self._buf += next(self._it)
            except StopIteration:
                break
        if n < 0:
            data, self._buf = self._buf, b""
        else:
            data, self._buf = self._buf[:n], self._buf[n:]
        return data
