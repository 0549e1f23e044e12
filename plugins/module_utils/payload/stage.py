"""Staging: put exactly one worker's payload into its host's node cache, then verify it.

Sources: a local file (a path on the data-owning host), a Hugging Face
repository through ``huggingface_hub.hf_hub_download`` with ``revision``
pinned to an immutable commit id, or the peer transfer server of the host that
has the payload (:mod:`..transfer`: authenticated, resumable across runs,
hashed as it arrives). Either way the bytes reach the final name
only after their SHA-256 matched, under the per-digest lock, so duplicate
workers on one host converge on one object and never see torn bytes.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common import fsutil
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
    space_error,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.seconds import is_seconds
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import identifiers as ids
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.identifiers import parse_digest
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import (
    DEFAULT_LOCK_TIMEOUT,
    NodeCache,
    remove_tree_quietly,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import pack_relpath
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.streams import (
    Progress,
    _pipelined,
    hash_fd,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import PayloadVerifier
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.writer import (
    PackWriter,
    write_settled_record,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.transfer.client import Peer, fetch_file

SOURCE_KINDS = ("local", "huggingface", "peer")
HF_FILENAME = r"[A-Za-z0-9_][A-Za-z0-9._-]*(?:/[A-Za-z0-9_][A-Za-z0-9._-]*)*"


@dataclass(frozen=True)
class StageSource:
    """Where a payload comes from. ``token`` never appears in repr, results or messages."""

    kind: str
    path: Path | None = None
    repository: str | None = None
    revision: str | None = None
    filename: str | None = None
    token: str | None = field(default=None, repr=False)
    endpoint: str | None = None
    address: str | None = None
    port: int | None = None

    @classmethod
    def from_dict(cls, d: dict, *, check_mode: bool = False) -> StageSource:
        """Build and check a source from module/CLI options."""
        kind = d.get("kind")
        if kind not in SOURCE_KINDS:
            raise ColdSnapError(f"payload source kind {kind!r} is not one of {', '.join(SOURCE_KINDS)}",
                                fix="set source.kind to 'local', 'huggingface' or 'peer'")
        src = cls(kind, Path(d["path"]) if d.get("path") else None, d.get("repository"), d.get("revision"),
                  d.get("filename"), d.get("token"), d.get("endpoint"), d.get("address"), d.get("port"))
        src.check(check_mode=check_mode)
        return src

    def check(self, *, check_mode: bool = False) -> None:
        """Refuse a source that no run could use. In check mode a peer on port 0 is taken: transfer_serve
        starts no server in check mode and reports port 0, so there is nothing to ask (see :func:`_probe_peer`)."""
        if self.kind == "local":
            if self.path is None:
                raise ColdSnapError("a local payload source needs 'path'", fix="set source.path to the pack file")
            return
        if self.kind == "peer":
            if not self.address or isinstance(self.port, bool) or not isinstance(self.port, int) \
                    or not (0 if check_mode else 1) <= self.port < 65536 or not self.token:
                raise ColdSnapError("a peer payload source needs 'address', 'port' (1..65535) and 'token'",
                                    fix="give the transfer server's address, port and this transfer's token")
            if self.filename is not None and "/" in self.filename:
                raise ColdSnapError(f"peer filename {self.filename!r} is not a plain file name",
                                    fix="leave it unset: the server serves <hex>.pack")
            return
        if not self.repository or not re.fullmatch(ids.MODEL_ID, self.repository):
            raise ColdSnapError(f"Hugging Face repository {self.repository!r} is not 'org/name'",
                                fix="set source.repository to the repository that holds the payloads")
        if not self.revision or not re.fullmatch(ids.COMMIT, self.revision):
            raise ColdSnapError(f"Hugging Face revision {self.revision!r} is not an immutable commit id",
                                fix=ids.COMMIT_FIX)
        if self.filename is not None and (not re.fullmatch(HF_FILENAME, self.filename) or any(
                p in (".", "..") for p in self.filename.split("/"))):
            raise ColdSnapError(f"Hugging Face filename {self.filename!r} is not a relative path",
                                fix="leave it unset: payloads live at model-payloads/sha256/<hex>.pack")

    def describe(self) -> str:
        if self.kind == "local":
            return f"local file {self.path}"
        if self.kind == "peer":
            return f"peer {self.address}:{self.port}"
        return f"huggingface {self.repository}@{self.revision}"

    def stage(self, state_root: Path | str, sha256: str, size: int, *,
              progress: Progress | None = None) -> StageResult:
        """:func:`stage_payload` from this source (what the provider calls, without importing staging)."""
        return stage_payload(state_root, sha256, size, self, progress=progress)


@dataclass(frozen=True)
class StageResult:
    """Outcome of staging one payload."""

    changed: bool
    path: Path
    sha256: str
    size: int
    record_reused: bool
    bytes_hashed: int
    bytes_copied: int
    source: str
    quarantined: str | None = None

    def as_result(self) -> dict:
        return {"changed": self.changed, "path": str(self.path), "sha256": self.sha256, "size": self.size,
                "verified": True, "record_reused": self.record_reused, "bytes_hashed": self.bytes_hashed,
                "bytes_copied": self.bytes_copied, "source": self.source, "quarantined": self.quarantined}


def stage_payload(state_root: Path | str, sha256: str, size: int, source: StageSource, *, check_mode: bool = False,
                  progress: Progress | None = None,
                  lock_timeout: float | None = DEFAULT_LOCK_TIMEOUT) -> StageResult:
    """Make ``<state_root>/model-payloads/sha256/<hex>.pack`` present and verified; idempotent.

    Already present and verified -> ``changed=False``. In check mode nothing is
    written (no lock, record, quarantine or copy) and ``changed`` says whether
    a real run would stage.
    """
    hexd = parse_digest(sha256, what="model payload digest")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ColdSnapError(f"payload size {size!r} is not a non-negative integer", fix="give the size in bytes")
    if lock_timeout is not None and not is_seconds(lock_timeout, zero=True):
        # nan would wait for ever on a held lock, a negative number time out at once
        raise ColdSnapError(f"lock_timeout is {lock_timeout!r}", fix="give a finite number of seconds >= 0")
    source.check(check_mode=check_mode)
    cache = NodeCache(state_root)
    final = cache.path_for(sha256)
    verifier = PayloadVerifier(lock_timeout=lock_timeout)
    if check_mode:
        if os.path.lexists(final):
            try:
                with verifier.verify(final, sha256, size, write_record=False) as v:
                    return StageResult(False, final, sha256, size, v.reused_record, v.bytes_hashed, 0, source.describe())
            except IntegrityError:
                pass
        _probe(cache, hexd, size, source)  # what the real run would refuse, asked read-only
        _refuse_unwritable(cache)
        return StageResult(True, final, sha256, size, False, 0, 0, source.describe())

    if source.kind == "local" and not os.path.lexists(final):
        # A source that cannot be used is refused before the digest's lock is taken (every other stager
        # of the digest on this host waits on it); a staged pack is reused below whatever the source is.
        os.close(_open_local(source, hexd, size))
    _writable_cache(cache)
    with cache.lock(sha256, timeout=lock_timeout):
        cache.clean_stale_temps(sha256)
        _clean_downloads(cache, hexd)
        quarantined = None
        if os.path.lexists(final):
            try:
                with verifier.verify_locked(final, sha256, size, progress=progress) as v:
                    _drop_peer_partial(cache, sha256)
                    return StageResult(False, final, sha256, size, v.reused_record, v.bytes_hashed, 0,
                                       source.describe())
            except IntegrityError as exc:
                quarantined = exc.details.get("quarantined")
        try:
            if source.kind == "local":
                copied = _stage_local(cache, hexd, size, source, progress)
            elif source.kind == "peer":
                copied = _stage_peer(cache, hexd, size, source, progress)
            else:
                copied = _stage_huggingface(cache, hexd, size, source, progress)
        except ColdSnapError as exc:
            if not quarantined or exc.details.get("quarantined"):
                raise
            # The corrupt copy was moved aside before the source failed: a change on the host, said so (the
            # error keeps its type).
            exc.problem += (f" (the copy that was in the node cache failed verification and was moved to "
                            f"quarantine as {quarantined})")
            exc.details = {**exc.details, "quarantined": quarantined}
            exc.args = (exc.problem if not exc.fix else f"{exc.problem}; {exc.fix}",)
            raise
        _drop_peer_partial(cache, sha256)  # committed from another source: a peer pull's bytes are not needed
        return StageResult(True, final, sha256, size, False, size, copied, source.describe(), quarantined)


def _writable_cache(cache: NodeCache) -> None:
    """The node cache's directories exist and this user may write them: those another user made (a run
    with sudo, then one without) are named with their owners, not left to a bare permission error."""
    try:
        cache.ensure_dirs()
    except PermissionError as exc:
        _refuse_foreign_cache(cache, [Path(exc.filename) if exc.filename else cache.root])
    _refuse_unwritable(cache)


def _refuse_unwritable(cache: NodeCache) -> None:
    """Those of the cache's directories that exist can be written (check mode asks this alone)."""
    # the state root itself only matters while the cache's own directory is still to be made in it
    parent = () if os.path.isdir(cache.root) else (cache.state_root,)
    theirs = [d for d in (*parent, cache.root, cache.objects, cache.locks, cache.downloads, cache.quarantine_dir)
              if os.path.isdir(d) and not os.access(d, os.W_OK | os.X_OK)]
    if theirs and os.statvfs(theirs[0]).f_flag & os.ST_RDONLY:
        raise ColdSnapError(f"node cache directory {theirs[0]} lies on a read-only file system",
                            fix="point state_root (coldsnap_state_root) at a writable file system")
    if theirs:
        _refuse_foreign_cache(cache, theirs)


def _refuse_foreign_cache(cache: NodeCache, dirs: list[Path]) -> None:
    def owned(d: Path) -> str:
        try:
            return f"{d} (uid {os.stat(d).st_uid})"
        except OSError:
            return str(d)

    top = cache.root if all(cache.root in (d, *d.parents) for d in dirs) else cache.state_root
    raise ColdSnapError(f"node cache director{'y' if len(dirs) == 1 else 'ies'} {', '.join(map(owned, dirs))} "
                        f"cannot be written by this user (uid {os.geteuid()}): permission denied",
                        fix=f"run as the state root's owner (or root), or give this user the node cache "
                            f"(chown -R {os.geteuid()} {top})")


def _drop_peer_partial(cache: NodeCache, sha256: str) -> None:
    with contextlib.suppress(OSError):  # only disk space is at stake; the pack is staged
        cache.drop_peer_partial(sha256)


def _probe(cache: NodeCache, hexd: str, size: int, source: StageSource) -> None:
    """Check mode: ask the source whether it can deliver the payload, as cheaply as it allows and writing
    nothing anywhere; raise what the real run would."""
    if source.kind == "local":
        os.close(_open_local(source, hexd, size))
    elif source.kind == "peer":
        _probe_peer(cache, hexd, size, source)
    else:
        _probe_huggingface(hexd, size, source)


def _stage_local(cache: NodeCache, hexd: str, size: int, source: StageSource, progress: Progress | None) -> int:
    src_fd = _open_local(source, hexd, size)
    try:
        with PackWriter(cache, expected_sha256=f"sha256:{hexd}", size=size, lock_held=True,
                        what=f"model payload sha256:{hexd} from {source.path}") as w:
            _pipelined(src_fd, size, 0, w.write, progress, what=f"payload source {source.path}")
            w.commit()
        return size
    finally:
        os.close(src_fd)


def _open_local(source: StageSource, hexd: str, size: int) -> int:
    """Open a local source that is a regular file of the payload's size, readable by this user.

    Looked at before it is opened, and opened without blocking: a FIFO (or a device) at the path is
    refused, never waited on while the digest's lock is held.
    """
    if source.path is None:
        raise AssertionError("a local stage source has no path")
    _check_local(source, hexd, size)
    try:
        fd = os.open(source.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise _source_error(source, exc) from None
    try:
        _check_local(source, hexd, size, os.fstat(fd))  # the file opened (the path may have changed since)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _source_error(source: StageSource, exc: OSError) -> ColdSnapError:
    if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
        return ColdSnapError(f"payload source {source.path} does not exist",
                             fix="give the path of the pack on this host")
    if isinstance(exc, PermissionError):
        return ColdSnapError(f"payload source {source.path} cannot be read by this user (uid {os.geteuid()}): "
                             "permission denied", fix="make it readable by this user")
    return ColdSnapError(f"payload source {source.path} cannot be opened: {exc.strerror or exc}",
                         fix="give the path of the pack on this host")


def _check_local(source: StageSource, hexd: str, size: int, st: os.stat_result | None = None) -> None:
    """A local source is a regular file of the payload's size (``st``: of the opened file; None: look)."""
    if st is None:
        try:
            st = os.stat(str(source.path))
        except OSError as exc:
            raise _source_error(source, exc) from None
    if not stat.S_ISREG(st.st_mode):
        raise ColdSnapError(f"payload source {source.path} is not a regular file", fix="give the pack file")
    if st.st_size != size:
        raise IntegrityError(f"payload source {source.path} has {st.st_size} bytes, sha256:{hexd} has {size}",
                             fix="the source is not this payload; check the path or the artifact")


def _clean_downloads(cache: NodeCache, hexd: str) -> None:
    if cache.downloads.is_dir():
        for entry in cache.downloads.iterdir():
            if entry.name.startswith(f"{hexd}-"):
                remove_tree_quietly(entry)


def _scrub(text: str, token: str | None) -> str:
    return text.replace(token, "********") if token else text


def _hub_error(filename: str, source: StageSource, exc: Exception) -> ColdSnapError:
    msg = _scrub(f"{type(exc).__name__}: {exc}", source.token).splitlines()[0]
    return ColdSnapError(f"could not download {filename} from {source.describe()}: {msg}",
                         fix="check the repository, the pinned revision, the token and the endpoint, or "
                             "restore with weights mode 'recovery'")


def _probe_huggingface(hexd: str, size: int, source: StageSource) -> None:
    """The file's metadata at the pinned revision (one HEAD request, as the download's first step): the
    Hub answers, the token is accepted, the revision and the file exist, and its size is the payload's."""
    try:
        from huggingface_hub import get_hf_file_metadata, hf_hub_url
    except ImportError:
        raise ColdSnapError("staging from Hugging Face needs the huggingface_hub library on this host",
                            fix="pip install huggingface_hub (or stage from a local path)") from None
    filename = source.filename or pack_relpath(hexd)
    try:
        meta = get_hf_file_metadata(hf_hub_url(source.repository, filename, revision=source.revision,
                                               endpoint=source.endpoint),
                                    token=source.token, endpoint=source.endpoint)
    except Exception as exc:  # the library raises many types; all mean "would not be staged"
        raise _hub_error(filename, source, exc) from None
    if meta.size is not None and meta.size != size:
        raise IntegrityError(f"{filename} from {source.describe()} has {meta.size} bytes, expected {size}",
                             fix="the repository does not hold this payload at that revision")


def _stage_huggingface(cache: NodeCache, hexd: str, size: int, source: StageSource,
                       progress: Progress | None) -> int:
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.utils import disable_progress_bars
    except ImportError:
        raise ColdSnapError("staging from Hugging Face needs the huggingface_hub library on this host",
                            fix="pip install huggingface_hub (or stage from a local path)") from None
    disable_progress_bars()  # module stdout must stay JSON; progress goes through our callback
    filename = source.filename or pack_relpath(hexd)
    where = cache.downloads / f"{hexd}-{secrets.token_hex(4)}"
    where.mkdir(parents=True, mode=0o700)
    try:
        try:
            got = hf_hub_download(repo_id=source.repository, filename=filename, revision=source.revision,
                                  token=source.token, endpoint=source.endpoint, local_dir=where)
        except Exception as exc:  # the library raises many types; all mean "not staged"
            raise _hub_error(filename, source, exc) from None
        fd = os.open(got, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if st.st_size != size:
                raise IntegrityError(f"{filename} from {source.describe()} has {st.st_size} bytes, expected {size}",
                                     fix="the repository does not hold this payload at that revision")
            actual = hash_fd(fd, size, progress=progress, what=f"downloaded {filename}")
            if actual != hexd:
                raise IntegrityError(f"{filename} from {source.describe()} hashes to sha256:{actual}, "
                                     f"expected sha256:{hexd}",
                                     fix="the repository does not hold this payload at that revision")
            _commit_verified(cache, fd, Path(got), hexd, size)
        finally:
            os.close(fd)
        return size
    finally:
        with contextlib.suppress(OSError):
            remove_tree_quietly(where)


def _commit_verified(cache: NodeCache, fd: int, path: Path, hexd: str, size: int) -> None:
    """Give a file whose digest matched its final name in the node cache (read-only, recorded)."""
    os.fsync(fd)
    os.fchmod(fd, 0o400)
    cache.ensure_dirs()
    final = cache.objects / f"{hexd}.pack"
    os.rename(path, final)  # same file system: atomic, and only after the digest matched
    fsutil.fsync_dir(final.parent)
    write_settled_record(fd, final, hexd, size)


def peer_partial(cache: NodeCache, hexd: str) -> Path:
    """Where a peer transfer of ``hexd`` keeps its bytes until they are verified (kept across runs)."""
    return cache.peer_partial(f"sha256:{hexd}")


def _free_bytes(path: Path) -> int | None:
    while not path.exists() and path.parent != path:
        path = path.parent  # made on first use: its file system is its nearest existing parent's
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _peer_space(cache: NodeCache, hexd: str, size: int, source: StageSource) -> None:
    """Room on the download directory's file system for what a peer transfer still has to bring."""
    partial = peer_partial(cache, hexd)
    have = partial.stat().st_size if partial.is_file() and not partial.is_symlink() else 0
    free = _free_bytes(cache.downloads)
    if free is not None and have <= size and free < size - have:
        raise ColdSnapError(f"no space on the file system of {cache.downloads} for model payload sha256:{hexd} "
                            f"from {source.address}: {size - have} bytes needed, {free} free",
                            fix="free space there (or point coldsnap_state_root at a larger file system) "
                                "and run again" + (f"; the {have} bytes already fetched are kept in {partial}"
                                                   if have else ""))


def _probe_peer(cache: NodeCache, hexd: str, size: int, source: StageSource) -> None:
    """The transfer server answers this transfer's token and lists the payload with its size and digest
    (its file listing: no byte of the payload is asked for). Port 0 is a server that transfer_serve did
    not start (check mode starts none): nothing to ask, a real run starts it first."""
    if source.address is None or source.port is None or source.token is None:
        raise AssertionError("a peer stage source lacks its endpoint")
    if source.port == 0:
        _peer_space(cache, hexd, size, source)
        return
    peer = Peer(source.address, source.port, source.token)
    name = source.filename or f"{hexd}.pack"
    entry = next((f for f in peer.listing() if f.get("name") == name), None)
    if entry is None:
        raise ColdSnapError(f"{peer.describe()} does not serve {name}",
                            fix="the source host lacks the file; capture again or restore elsewhere")
    if entry.get("size") != size:
        raise IntegrityError(f"{peer.describe()} serves {name} with {entry.get('size')!r} bytes; "
                             f"sha256:{hexd} has {size}", fix="the source is not serving this payload; capture again")
    if entry.get("sha256") not in (None, hexd):
        raise IntegrityError(f"{peer.describe()} serves {name} as sha256:{entry.get('sha256')}, not sha256:{hexd}",
                             fix="the source host's copy is not this payload; verify it there (coldsnap payload "
                                 "verify) or capture again")
    _peer_space(cache, hexd, size, source)


def _stage_peer(cache: NodeCache, hexd: str, size: int, source: StageSource, progress: Progress | None) -> int:
    if source.address is None or source.port is None or source.token is None:
        raise AssertionError("a peer stage source lacks its endpoint")
    cache.ensure_dirs()
    cache.downloads.mkdir(mode=0o700, exist_ok=True)
    partial = peer_partial(cache, hexd)
    what = f"model payload sha256:{hexd} from {source.address}"
    _peer_space(cache, hexd, size, source)
    try:
        got = fetch_file(Peer(source.address, source.port, source.token), source.filename or f"{hexd}.pack",
                         partial, size=size, sha256=hexd, progress=progress)
    except OSError as exc:
        err = space_error(exc, what=what, path=partial, needed=size)
        if err is exc:
            raise
        with contextlib.suppress(OSError):
            partial.unlink()  # a full disk is not left full by our half file
        raise err from None
    except ColdSnapError:
        with contextlib.suppress(OSError):
            if os.lstat(partial).st_size == 0:
                partial.unlink()  # refused before a byte arrived (token, name): nothing to resume
        raise
    fd = os.open(partial, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _commit_verified(cache, fd, partial, hexd, size)
    finally:
        os.close(fd)
    return got.bytes_received
