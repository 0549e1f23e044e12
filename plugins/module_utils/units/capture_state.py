"""Every file of a unit's captured state, bound to a digest at capture and checked before a
restore evicts anything.

At capture, once the unit's activation runtime has written its state (CRIU images,
the workers' residual / manifest / replay plan, control endpoints, logs, evidence),
:func:`seal` writes ``state-digests.json`` into the unit directory: the size and
SHA-256 of each file. The artifact records that list's own digest and the evidence's
(``capsule.units[].state``), so neither the list nor the evidence can be edited
without the artifact noticing, and the artifact is pinned by the restore request.

At restore, :func:`verify` runs in prepare, on the capture directory or on the state
extracted from the capsule: the list and the evidence must have their recorded
digests, every listed file must be a regular file (no link) of its recorded size and
digest, and no unlisted file may sit among the CRIU images or the workers' files
(CRIU reads its images by name; a planted file is refused). A full verification
writes a validation record (0600) binding each file to its inode, size, mtime and
ctime, as the payload verifier does for packs; the next prepare on a warm host
re-hashes only the files whose identity changed (a record observed within one
timestamp tick of a change is racy and proves nothing).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import atomic_write_bytes
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import EVIDENCE_FILE
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.records import (
    FileIdentity,
    is_racy,
)

DIGESTS_FILE = "state-digests.json"
RECORD_FILE = ".coldsnap-state-validation.json"
DIGESTS_KIND = "coldsnap-capture-state"
RECORD_KIND = "coldsnap-capture-state-validation"
FORMAT = 1
# Directories whose every file must be listed (what CRIU and the engine read back).
SEALED_DIRS = ("criu", "workers", "control")
# Checked by their own digests, or written later and never read by a restore (CRIU writes
# ``stats-restore`` into the image directory of every restore).
IGNORED = (RECORD_FILE, DIGESTS_FILE, EVIDENCE_FILE)
IGNORED_NAMES = ("stats-restore",)
CHUNK = 1 << 20
RECOVER = "recapture (or restore another generation); the captured state cannot be trusted"


@dataclass(frozen=True)
class Seal:
    """What the artifact records of a unit's captured state."""

    sha256: str
    size: int
    files: int
    bytes: int
    evidence_sha256: str

    def to_json(self) -> dict:
        return {"sha256": self.sha256, "size": self.size, "files": self.files, "bytes": self.bytes,
                "evidence_sha256": self.evidence_sha256}


def _sha256_file(path: Path) -> tuple[str, int]:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        h = hashlib.sha256()
        n = 0
        while True:
            data = os.read(fd, CHUNK)
            if not data:
                break
            h.update(data)
            n += len(data)
        return "sha256:" + h.hexdigest(), n
    finally:
        os.close(fd)


def _walk(unit_dir: Path) -> list[str]:
    """Relative names of every file below ``unit_dir`` (sorted), refusing links and special files."""
    out = []
    for dirpath, dirnames, filenames in os.walk(unit_dir):
        for name in list(dirnames):
            p = Path(dirpath) / name
            if p.is_symlink():
                raise IntegrityError(f"captured state holds a symbolic link {p}", fix=RECOVER)
        for name in filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            if not stat.S_ISREG(st.st_mode):
                raise IntegrityError(f"captured state holds {p}, which is not a regular file", fix=RECOVER)
            out.append(p.relative_to(unit_dir).as_posix())
    return sorted(out)


def seal(unit_dir: Path | str) -> Seal:
    """Write ``state-digests.json`` for ``unit_dir`` (after the capture wrote everything) and return
    what the artifact records."""
    unit_dir = Path(unit_dir)
    files: dict[str, dict] = {}
    total = 0
    for rel in _walk(unit_dir):
        if rel in IGNORED or rel.rsplit("/", 1)[-1] in IGNORED_NAMES:
            continue
        digest, size = _sha256_file(unit_dir / rel)
        files[rel] = {"size": size, "sha256": digest}
        total += size
    doc = {"format": FORMAT, "kind": DIGESTS_KIND, "files": files}
    data = (json.dumps(doc, sort_keys=True, indent=1) + "\n").encode()
    atomic_write_bytes(unit_dir / DIGESTS_FILE, data, mode=0o600)
    owner = unit_dir.stat()
    if os.geteuid() == 0 and (owner.st_uid, owner.st_gid) != (0, 0):
        # The unit directory belongs to the workload's owner (coldsnap_owner): so does its seal.
        os.chown(unit_dir / DIGESTS_FILE, owner.st_uid, owner.st_gid)
    evidence_sha, _n = _sha256_file(unit_dir / EVIDENCE_FILE)
    return Seal(sha256="sha256:" + hashlib.sha256(data).hexdigest(), size=len(data), files=len(files),
                bytes=total, evidence_sha256=evidence_sha)


def seal_of(unit_dir: Path | str) -> dict:
    """The seal of an already sealed unit directory (a repeated capture converges on it)."""
    unit_dir = Path(unit_dir)
    data = (unit_dir / DIGESTS_FILE).read_bytes()
    listed = json.loads(data)["files"]
    evidence_sha, _n = _sha256_file(unit_dir / EVIDENCE_FILE)
    return Seal(sha256="sha256:" + hashlib.sha256(data).hexdigest(), size=len(data), files=len(listed),
                bytes=sum(f["size"] for f in listed.values()), evidence_sha256=evidence_sha).to_json()


def _load_record(unit_dir: Path, seal_sha: str) -> dict:
    try:
        doc = json.loads((unit_dir / RECORD_FILE).read_text())
        st = os.lstat(unit_dir / RECORD_FILE)
    except (OSError, ValueError):
        return {}
    # Trusted only when private to the user verifying (or root) and about this very list.
    if (not isinstance(doc, dict) or doc.get("kind") != RECORD_KIND or doc.get("state_sha256") != seal_sha
            or st.st_mode & 0o077 or st.st_uid not in (os.geteuid(), 0)):
        return {}
    files = doc.get("files")
    return files if isinstance(files, dict) else {}


def verify(unit_dir: Path | str, recorded: dict | None, *, unit: str, write_record: bool = True,
           written: dict[str, str] | None = None) -> dict:
    """Check the unit's captured state against what the artifact recorded (``capsule.units[].state``).

    ``written`` maps names below ``unit_dir`` to the SHA-256 of the bytes this process has just
    written there (an extraction from a capsule whose layer digest it checked): those files are not
    read again. Raises IntegrityError naming the first file that differs; returns
    ``{"files", "bytes", "rehashed_files", "rehashed_bytes"}`` (files hashed while written count as
    rehashed).
    """
    unit_dir = Path(unit_dir)
    if not recorded:
        raise IntegrityError(f"unit {unit}: the artifact records no digest of the captured state",
                             fix="recapture with this version of ColdSnap (it seals every captured file)")
    lst = unit_dir / DIGESTS_FILE
    try:
        data = lst.read_bytes()
    except OSError as exc:
        raise IntegrityError(f"unit {unit}: {lst} cannot be read ({exc.strerror})", fix=RECOVER) from None
    if "sha256:" + hashlib.sha256(data).hexdigest() != recorded["sha256"]:
        raise IntegrityError(f"unit {unit}: {lst} is not the list of files the capture sealed", fix=RECOVER)
    evidence_sha, _n = _sha256_file(unit_dir / EVIDENCE_FILE)
    if evidence_sha != recorded["evidence_sha256"]:
        raise IntegrityError(f"unit {unit}: {unit_dir / EVIDENCE_FILE} differs from the captured evidence",
                             fix=RECOVER)
    listed = json.loads(data)["files"]
    present = [r for r in _walk(unit_dir) if r not in IGNORED and r.rsplit("/", 1)[-1] not in IGNORED_NAMES]
    for rel in present:
        if rel not in listed and rel.split("/", 1)[0] in SEALED_DIRS:
            raise IntegrityError(f"unit {unit}: {unit_dir / rel} was not captured (an unlisted file among the "
                                 "captured state)", fix=RECOVER)
    known = _load_record(unit_dir, recorded["sha256"])
    fresh: dict[str, list[int]] = {}
    rehashed = rehashed_bytes = total = 0
    for rel, want in sorted(listed.items()):
        path = unit_dir / rel
        try:
            st = os.lstat(path)
        except OSError:
            raise IntegrityError(f"unit {unit}: captured file {path} is missing", fix=RECOVER) from None
        if not stat.S_ISREG(st.st_mode):
            raise IntegrityError(f"unit {unit}: captured file {path} is not a regular file", fix=RECOVER)
        if st.st_size != want["size"]:
            raise IntegrityError(f"unit {unit}: captured file {path} has {st.st_size} bytes, the capture wrote "
                                 f"{want['size']}", fix=RECOVER)
        ident = FileIdentity.of(st)
        total += st.st_size
        seen = known.get(rel)
        if (isinstance(seen, dict) and seen.get("identity") == list(ident.as_dict().values())
                and not is_racy(ident, int(seen.get("observed_at_ns", 0)))):
            fresh[rel] = seen
            continue
        observed = time.time_ns()
        got = (written or {}).get(rel) or _sha256_file(path)[0]
        rehashed += 1
        rehashed_bytes += st.st_size
        if got != want["sha256"]:
            raise IntegrityError(f"unit {unit}: captured file {path} does not hold the bytes the capture wrote "
                                 f"(sha256 {got}, sealed {want['sha256']})", fix=RECOVER)
        after = FileIdentity.of(os.lstat(path))
        if after == ident:
            fresh[rel] = {"identity": list(ident.as_dict().values()), "observed_at_ns": observed}
    if write_record and rehashed:
        doc = {"format": FORMAT, "kind": RECORD_KIND, "state_sha256": recorded["sha256"], "files": fresh}
        try:
            atomic_write_bytes(unit_dir / RECORD_FILE, json.dumps(doc).encode(), mode=0o600)
        except OSError:
            pass  # a read-only state copy: the next prepare hashes again
    return {"files": len(listed), "bytes": total, "rehashed_files": rehashed, "rehashed_bytes": rehashed_bytes}


def verify_members(members: dict[str, tuple[str, int, str]], recorded: dict | None, *, unit: str,
                   where: str) -> dict:
    """Check a captured state read as a stream (a capsule image's state directory): ``members`` maps
    each relative name to (kind 'file'|'link'|'other', size, sha256). Same rules as :func:`verify`."""
    if not recorded:
        raise IntegrityError(f"unit {unit}: the artifact records no digest of the captured state",
                             fix="recapture with this version of ColdSnap (it seals every captured file)")
    bad = sorted(rel for rel, (kind, _size, _sha) in members.items() if kind != "file")
    if bad:
        raise IntegrityError(f"unit {unit}: {where} holds {bad[0]}, which is not a regular file", fix=RECOVER)
    lst = members.get(DIGESTS_FILE)
    if lst is None or lst[2] != recorded["sha256"]:
        raise IntegrityError(f"unit {unit}: {where}/{DIGESTS_FILE} is not the list of files the capture sealed",
                             fix=RECOVER)
    ev = members.get(EVIDENCE_FILE)
    if ev is None or ev[2] != recorded["evidence_sha256"]:
        raise IntegrityError(f"unit {unit}: {where}/{EVIDENCE_FILE} differs from the captured evidence", fix=RECOVER)
    return {"files": recorded["files"], "bytes": recorded["bytes"], "rehashed_files": len(members),
            "rehashed_bytes": sum(m[1] for m in members.values())}


def check_listing(members: dict[str, tuple[str, int, str]], listed: dict, *, unit: str, where: str) -> None:
    """Every listed file present with its size and digest; nothing unlisted among the sealed directories."""
    for rel in members:
        if (rel not in listed and rel not in IGNORED and rel.rsplit("/", 1)[-1] not in IGNORED_NAMES
                and rel.split("/", 1)[0] in SEALED_DIRS):
            raise IntegrityError(f"unit {unit}: {where}/{rel} was not captured (an unlisted file among the captured "
                                 "state)", fix=RECOVER)
    for rel, want in listed.items():
        got = members.get(rel)
        if got is None:
            raise IntegrityError(f"unit {unit}: captured file {where}/{rel} is missing", fix=RECOVER)
        if got[1] != want["size"] or got[2] != want["sha256"]:
            raise IntegrityError(f"unit {unit}: captured file {where}/{rel} does not hold the bytes the capture "
                                 f"wrote ({got[1]} bytes, sha256 {got[2]}; sealed {want['size']} bytes, "
                                 f"{want['sha256']})", fix=RECOVER)


def listed_files(unit_dir: Path | str) -> dict:
    """The sealed list of a unit directory: {relative name: {size, sha256}} (verify it first)."""
    return json.loads((Path(unit_dir) / DIGESTS_FILE).read_bytes())["files"]


def check_seal_fields(value: object) -> None:
    """Refuse a malformed ``state`` record before using it."""
    if value is None:
        return
    if not isinstance(value, dict) or not {"sha256", "size", "files", "bytes", "evidence_sha256"} <= set(value):
        raise ColdSnapError("capsule state record is malformed", fix="recapture")
