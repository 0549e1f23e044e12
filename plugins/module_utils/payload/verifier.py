"""The one payload verifier: used by ``coldsnap.fleet.payload_verify``, ``coldsnap payload verify`` and the
in-unit runtime, so the admission rules cannot drift between them.

Rules, in order:

1. the digest must be ``sha256:<64 lower-case hex>`` (refused before any path is built);
2. the pack must live at ``.../model-payloads/sha256/<hex>.pack`` (a path that
   does not match its digest is refused);
3. the file is opened once (no symlinks) and everything after uses that fd;
4. size first: a wrong size fails without hashing;
5. a private, well-formed validation record whose identity matches the open
   file and that is not racy skips the hash;
6. otherwise a full SHA-256; a mismatch quarantines the file and names it;
   a match writes a fresh record (not in check mode).

The returned :class:`VerifiedPayload` keeps the verified fd open: hydration
reads from it (never from the path again) and calls :meth:`~VerifiedPayload.recheck`
before and after use.

:meth:`PayloadVerifier.verify_many` applies the same rules to several packs at
once, one file per thread (SHA-256 of one file is sequential; hashlib releases
the GIL, so files hash on separate cores), ``jobs`` at a time (default: the CPUs
this process may use).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.identifiers import parse_digest
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import records
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import (
    DEFAULT_LOCK_TIMEOUT,
    NodeCache,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import PACK_DIR
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.streams import (
    Progress,
    default_jobs,
    hash_fd,
)

STAGE_FIX = "stage it again (coldsnap.fleet.payload_stage) or restore with weights mode 'recovery'"


@dataclass
class VerifiedPayload:
    """A pack that passed verification, held open by ``fd`` with the identity that was verified."""

    path: Path
    sha256: str
    size: int
    fd: int
    identity: records.FileIdentity
    reused_record: bool
    bytes_hashed: int
    record_written: bool
    record_status: str
    seconds: float = 0.0
    _closed: bool = field(default=False, repr=False)

    def fileno(self) -> int:
        return self.fd

    def recheck(self, *, progress: Progress | None = None) -> None:
        """Raise IntegrityError when the open file changed since it was verified.

        A different inode, size or mtime is refused at once. A change of ctime
        alone (a rename or unlink of the verified name changes the inode's link
        count and so its ctime, but so does a rewrite whose mtime was put back)
        is settled by re-hashing the open fd.
        """
        if self._closed:
            raise ColdSnapError(f"model payload {self.sha256} was closed", fix="verify it again before use")
        now = records.FileIdentity.of_fd(self.fd)
        if now == self.identity:
            return
        changed = [k for k, v in self.identity.as_dict().items() if now.as_dict()[k] != v]
        if changed == ["st_ctime_ns"]:
            actual = hash_fd(self.fd, self.size, progress=progress, what=f"model payload {self.path}")
            if "sha256:" + actual == self.sha256 and records.FileIdentity.of_fd(self.fd) == now:
                self.identity = now
                self.bytes_hashed += self.size
                return
        raise IntegrityError(
            f"model payload {self.path} changed after it was verified ({', '.join(changed)} differ)",
            fix="something modified the pack in place; verify it again (the old record is stale)")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self.fd)

    def __enter__(self) -> VerifiedPayload:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def as_result(self) -> dict:
        """The facts a module or the CLI reports."""
        return {"verified": True, "path": str(self.path), "sha256": self.sha256, "size": self.size,
                "record_reused": self.reused_record, "bytes_hashed": self.bytes_hashed,
                "record_written": self.record_written, "record_status": self.record_status}


def first_look(state_root: Path | str, payloads: Sequence[dict], *, check_mode: bool) -> dict[str, dict]:
    """What the node cache under ``state_root`` holds of each payload (``{"sha256", "size"}``), by digest.

    Each is verified as :meth:`PayloadVerifier.verify` does (a valid record spares the hash; a pack that
    fails is quarantined; check mode records and moves nothing, and reports as changed what a real run
    would record, like ``payload_verify``). A missing or refused pack is an entry with ``verified: False``
    and the reason, never an exception: the caller stages what is not here.
    """
    cache = NodeCache(state_root)
    out: dict[str, dict] = {}
    for payload in payloads:
        try:
            with PayloadVerifier().verify(cache, payload["sha256"], payload["size"],
                                          write_record=not check_mode) as found:
                entry = found.as_result()
            entry["changed"] = found.record_written or (check_mode and not found.reused_record)
        except ColdSnapError as exc:
            quarantined = exc.details.get("quarantined")
            # Check mode moves nothing but reports the quarantine a real run would make.
            changed = bool(quarantined) or (check_mode and bool(exc.details.get("wrong_object")))
            entry = {"verified": False, "msg": str(exc), "quarantined": quarantined, "changed": changed}
        out[payload["sha256"]] = entry
    return out


def check_pack_path(path: Path, hexd: str) -> None:
    """The pack's path must end in ``model-payloads/sha256/<hex>.pack`` for its own digest."""
    expected = f"{PACK_DIR}/{hexd}.pack"
    tail = "/".join(path.parts[-3:])
    if tail != expected:
        raise IntegrityError(f"payload path {path} does not match its digest sha256:{hexd}",
                             fix=f"a pack must live at <state_root>/{expected}")


class PayloadVerifier:
    """Verify packs; see the module docstring for the rules."""

    def __init__(self, *, lock_timeout: float | None = DEFAULT_LOCK_TIMEOUT) -> None:
        self.lock_timeout = lock_timeout

    def verify(self, target: Path | str | NodeCache, sha256: str, size: int, *, write_record: bool = True,
               progress: Progress | None = None, rehash: bool = False, pipelined: bool = True) -> VerifiedPayload:
        """Verify the pack for ``sha256`` (a path, or the entry of a NodeCache) and return it held open.

        ``write_record=False`` is a read-only verification (check mode): no
        lock file, no record, no quarantine. ``rehash`` ignores a valid record.
        ``pipelined=False`` hashes without a reader thread (streams.hash_fd).
        """
        hexd = parse_digest(sha256, what="model payload digest")
        _check_size_arg(size)
        path = target.path_for(sha256) if isinstance(target, NodeCache) else Path(target)
        check_pack_path(path, hexd)
        cache = NodeCache.for_pack_path(path)
        if not write_record:
            # Check mode / read-only verification: no lock file, no record, no quarantine.
            return self._verify(path, hexd, size, cache, write_record=False, progress=progress, read_only=True,
                                rehash=rehash, pipelined=pipelined)
        _check_present(path, hexd)  # said before a lock file (or a mistyped state root) is created for it
        # A pack given by its path may lie in a directory of the user's that is no state root: its
        # directories are neither created nor made private; without a lock directory there, no lock and
        # no record (the read-only verification below).
        explicit = not isinstance(target, NodeCache)
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(cache.lock(sha256, timeout=self.lock_timeout, create=not explicit))
            except (OSError, ColdSnapError) as exc:
                if not _lock_unavailable(exc, explicit):
                    raise
                # A read-only view of the cache (e.g. a unit's bind mount): verify without lock or record.
                return self._verify(path, hexd, size, cache, write_record=False, progress=progress, read_only=True,
                                    rehash=rehash, pipelined=pipelined)
            with contextlib.suppress(OSError):
                cache.clean_stale_temps(sha256)  # a killed verifier's record temp (we hold the digest's lock)
            verified = self._verify(path, hexd, size, cache, write_record=write_record, progress=progress,
                                    rehash=rehash, pipelined=pipelined)
            if write_record and not explicit:
                with contextlib.suppress(OSError):  # the pack is here: a peer pull of it has nothing left to resume
                    cache.drop_peer_partial(sha256)
            return verified

    def verify_many(self, packs: Sequence[tuple[Path | str | NodeCache, str, int]], *, jobs: int | None = None,
                    write_record: bool = True, progress: Progress | None = None,
                    rehash: bool = False) -> list[VerifiedPayload]:
        """Verify several packs at once; every pack held open, in the order given, or an error.

        ``packs`` holds ``(target, sha256, size)`` like :meth:`verify`'s arguments. ``jobs``
        files are hashed at once (default: the usable CPUs). Every pack is verified even when
        another fails (each wrong one is refused and quarantined as :meth:`verify` does);
        then, if any failed, the packs that passed are closed and one error names every
        failed pack (IntegrityError when each failure is an integrity failure).
        ``progress(done, total)`` sums the bytes of all packs (a pack whose record is
        reused counts as done); it may be called from several threads, one at a time.
        """
        if jobs is None:
            jobs = default_jobs()
        if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
            raise ColdSnapError(f"verify jobs {jobs!r} is not a positive integer", fix="give 1 or more, or omit it")
        items = list(packs)
        seen: dict[tuple[str, str], int] = {}
        for i, (target, sha256, size) in enumerate(items):
            parse_digest(sha256, what="model payload digest")
            _check_size_arg(size)
            where = str(target.path_for(sha256) if isinstance(target, NodeCache) else Path(target))
            if (where, sha256) in seen:
                raise ColdSnapError(f"model payload {sha256} at {where} is listed twice (items {seen[where, sha256]} "
                                    f"and {i})", fix="list each pack once")
            seen[where, sha256] = i
        if not items:
            return []
        workers = min(jobs, len(items))
        # A reader thread per file pays only when a core is left for it (streams module doc).
        pipelined = 2 * workers <= default_jobs()
        report = _SummedProgress(progress, [size for _t, _d, size in items])

        def one(i: int) -> VerifiedPayload:
            target, sha256, size = items[i]
            try:
                return self.verify(target, sha256, size, write_record=write_record, rehash=rehash,
                                   progress=report.for_item(i), pipelined=pipelined)
            finally:
                report.finished(i)

        outcomes: list[VerifiedPayload | BaseException] = []
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="coldsnap-verify") as pool:
            futures = [pool.submit(one, i) for i in range(len(items))]
            for future in futures:
                try:
                    outcomes.append(future.result())
                except BaseException as exc:  # collected: every pack gets its verdict first
                    outcomes.append(exc)
        failures = [(i, o) for i, o in enumerate(outcomes) if isinstance(o, BaseException)]
        if not failures:
            return outcomes  # type: ignore[return-value]
        for o in outcomes:
            if isinstance(o, VerifiedPayload):
                o.close()
        for _i, exc in failures:
            if not isinstance(exc, Exception):
                raise exc  # KeyboardInterrupt and the like stay what they are
        if len(failures) == 1:
            raise failures[0][1]
        errors = [exc for _i, exc in failures]
        cls = IntegrityError if all(isinstance(e, IntegrityError) for e in errors) else ColdSnapError
        quarantined = [e.details.get("quarantined") for e in errors if isinstance(e, ColdSnapError)]
        raise cls(f"{len(failures)} of {len(items)} model payloads failed verification: "
                  + "; ".join(f"[{i}] {_problem_of(exc)}" for i, exc in failures),
                  fix=_common_fix(errors), details={"failed": [items[i][1] for i, _e in failures],
                                                    "quarantined": [q for q in quarantined if q]})

    def verify_locked(self, path: Path, sha256: str, size: int, *, write_record: bool = True,
                      progress: Progress | None = None, rehash: bool = False) -> VerifiedPayload:
        """Like :meth:`verify` for a caller that already holds the digest's lock."""
        hexd = parse_digest(sha256, what="model payload digest")
        _check_size_arg(size)
        check_pack_path(Path(path), hexd)
        return self._verify(Path(path), hexd, size, NodeCache.for_pack_path(path), write_record=write_record,
                            progress=progress, rehash=rehash)

    def inspect(self, path: Path, sha256: str, size: int) -> records.RecordCheck:
        """Record status of a pack without hashing it (what the next verify would do)."""
        hexd = parse_digest(sha256, what="model payload digest")
        check_pack_path(path, hexd)
        fd = _open_pack(path, hexd)
        try:
            ident = records.FileIdentity.of_fd(fd)
            if ident.st_size != size:
                return records.RecordCheck("stale", f"size {ident.st_size} != {size}")
            return records.check_record(records.record_path_for(path), hexd, size, ident)
        finally:
            os.close(fd)

    def _verify(self, path: Path, hexd: str, size: int, cache: NodeCache, *, write_record: bool,
                progress: Progress | None, read_only: bool = False, rehash: bool = False,
                pipelined: bool = True) -> VerifiedPayload:
        started = time.monotonic()
        digest = f"sha256:{hexd}"
        fd = _open_pack(path, hexd)
        try:
            st = os.fstat(fd)
            ident = records.FileIdentity.of(st)
            if not stat.S_ISREG(st.st_mode):
                self._refuse(cache, path, ident, read_only, f"model payload {path} is not a regular file")
            record_path = records.record_path_for(path)
            if ident.st_size != size:
                if _matches_its_name(fd, record_path, hexd, ident, progress=progress, pipelined=pipelined):
                    # The object is right and the caller's size is wrong: a shared pack stays in the cache.
                    raise IntegrityError(
                        f"model payload {path} is sha256:{hexd} with {ident.st_size} bytes (verified), but the "
                        f"artifact says {size} bytes; the pack is intact and was left in the cache",
                        fix="the artifact or request gives the wrong size for this digest: use the size the "
                            "capture recorded for it", details={"quarantined": None})
                self._refuse(cache, path, ident, read_only,
                             f"model payload {path} has {ident.st_size} bytes, the artifact says {size}")
            check = records.check_record(record_path, hexd, size, ident)
            if check.valid and not rehash:
                return VerifiedPayload(path, digest, size, fd, ident, True, 0, False, check.status,
                                       time.monotonic() - started)
            _wait_out_tick(ident)
            observed = time.time_ns()
            before = records.FileIdentity.of_fd(fd)
            actual = hash_fd(fd, size, progress=progress, what=f"model payload {path}", pipelined=pipelined)
            after = records.FileIdentity.of_fd(fd)
            if before != after:
                raise IntegrityError(f"model payload {path} changed while it was being hashed",
                                     fix="stop whatever writes to the cache and verify again")
            if actual != hexd:
                self._refuse(cache, path, after, read_only,
                             f"model payload {path} hashes to sha256:{actual}, not {digest}")
            written = False
            if write_record and not read_only:
                try:
                    records.write_record(record_path, hexd, size, after, observed, method="full-sha256")
                    written = True
                except OSError:
                    pass  # the record only spares the next hash (a full or read-only disk): the pack is verified
            return VerifiedPayload(path, digest, size, fd, after, False, size, written, check.status,
                                   time.monotonic() - started)
        except BaseException:
            os.close(fd)
            raise

    def _refuse(self, cache: NodeCache, path: Path, ident: records.FileIdentity, read_only: bool,
                problem: str) -> None:
        moved = None
        failed: OSError | None = None
        if not read_only:
            try:
                moved = cache.quarantine(path, ident)
            except OSError as exc:  # no space or inode for the quarantine directory, no permission
                failed = exc
        if moved:
            where = f"; it was moved to quarantine as {moved}"
        elif read_only:
            where = " (read-only verification: left in place, not quarantined)"
        elif failed is not None:
            why = f"{failed.strerror or failed}{': ' + str(failed.filename) if failed.filename else ''}"
            # A wrong object must not stay under the name of the right one: without room to keep it, drop it.
            where = (f"; it could not be quarantined ({why}) and was removed instead" if _remove_if_same(path, ident)
                     else f"; it could neither be quarantined ({why}) nor removed: remove {path} by hand")
        else:
            where = "; it could not be quarantined (it was replaced or lives on another file system)"
        # "wrong_object": the file is not what its name says (a real run quarantines it when it can).
        raise IntegrityError(problem + where, fix=STAGE_FIX,
                             details={"quarantined": str(moved) if moved else None, "wrong_object": True})


def _remove_if_same(path: Path, ident: records.FileIdentity) -> bool:
    """Unlink ``path`` when it still is the inode ``ident`` names (and its record); True when it is gone."""
    try:
        st = os.stat(path, follow_symlinks=False)
        if (st.st_dev, st.st_ino) != (ident.st_dev, ident.st_ino):
            return False
        os.unlink(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    with contextlib.suppress(OSError):
        records.record_path_for(path).unlink()
    return True


def _matches_its_name(fd: int, record_path: Path, hexd: str, ident: records.FileIdentity, *,
                      progress: Progress | None, pipelined: bool) -> bool:
    """Whether the open pack is the object its name says, whatever size a caller expected."""
    if records.check_record(record_path, hexd, ident.st_size, ident).valid:
        return True
    return hash_fd(fd, ident.st_size, progress=progress, what=f"model payload sha256:{hexd}",
                   pipelined=pipelined) == hexd


class _SummedProgress:
    """One progress callback over several packs hashed in several threads."""

    def __init__(self, progress: Progress | None, sizes: list[int]) -> None:
        self._progress = progress
        self._done = [0] * len(sizes)
        self._sizes = sizes
        self._sum = 0
        self._total = sum(sizes)
        self._lock = threading.Lock()

    def for_item(self, i: int) -> Progress | None:
        if self._progress is None:
            return None

        def report(done: int, _total: int) -> None:
            self._set(i, done)

        return report

    def finished(self, i: int) -> None:
        if self._progress is not None:
            self._set(i, self._sizes[i])

    def _set(self, i: int, done: int) -> None:
        with self._lock:
            self._sum += done - self._done[i]
            self._done[i] = done
            self._progress(self._sum, self._total)  # type: ignore[misc]


def _wait_out_tick(ident: records.FileIdentity) -> None:
    """Start hashing only after the file's last-change tick, so the record we write is not racy (<= 20 ms)."""
    deadline = ident.last_change_ns() + records.timestamp_tick_ns(ident)
    now = time.time_ns()
    if now < deadline and deadline - now <= records.FINE_TICK_NS:
        time.sleep((deadline - now) / 1e9)


def _check_size_arg(size: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ColdSnapError(f"payload size {size!r} is not a non-negative integer", fix="give the size in bytes")


def _problem_of(exc: BaseException) -> str:
    """An error's message without its fix (a combined message says each fix once)."""
    return exc.problem if isinstance(exc, ColdSnapError) else str(exc)


def _common_fix(errors: Sequence[BaseException]) -> str:
    """The fixes of several errors, each said once, in order of first appearance."""
    fixes: list[str] = []
    for exc in errors:
        fix = exc.fix if isinstance(exc, ColdSnapError) else None
        if fix and fix not in fixes:
            fixes.append(fix)
    return "; ".join(fixes) if fixes else STAGE_FIX


def _check_present(path: Path, hexd: str) -> None:
    """Something is at ``path`` (what it is, the verification says); absent or unreachable is an error."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise ColdSnapError(f"model payload sha256:{hexd} is not present at {path}", fix=STAGE_FIX) from None
    except PermissionError:
        raise ColdSnapError(f"model payload {path}: permission denied (this user, uid {os.geteuid()}, may not "
                            "look into its directories)",
                            fix="run as the state root's owner (or root)") from None
    except OSError as exc:
        raise ColdSnapError(f"cannot look up model payload {path}: {exc.strerror}",
                            fix="check the state root's file system and permissions") from None


def _lock_unavailable(exc: BaseException, explicit: bool) -> bool:
    """Whether taking the digest's lock failed because the cache cannot be written here (read-only,
    another user's, full) or, for a pack given by its path, has no lock directory: then the pack is
    verified without lock or record."""
    if isinstance(exc, ColdSnapError):
        return exc.details.get("errno") in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(exc, FileNotFoundError) and explicit:
        return True
    return isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC,
                                                      errno.EDQUOT)


def _open_pack(path: Path, hexd: str) -> int:
    try:
        # O_NONBLOCK: a FIFO planted at the name must not hang the verifier (and the digest lock it holds)
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ColdSnapError(f"model payload sha256:{hexd} is not present at {path}", fix=STAGE_FIX) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise IntegrityError(f"model payload {path} is a symbolic link",
                                 fix="the cache holds packs as regular files; remove the link and stage the pack") from None
        if exc.errno == errno.ENXIO:  # a socket (or a device without its driver) where the pack should be
            raise IntegrityError(f"model payload {path} is not a regular file",
                                 fix="the cache holds packs as regular files; remove it and stage the pack") from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise ColdSnapError(f"model payload {path}: permission denied (uid {os.geteuid()} may not read it)",
                                fix="run as the state root's owner (or root)") from None
        raise ColdSnapError(f"cannot open model payload {path}: {exc.strerror}",
                            fix="check the permissions of the state root") from None
