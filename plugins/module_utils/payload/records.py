"""Validation records: the evidence that lets a verified pack skip its next full SHA-256.

``<hex>.pack.coldsnap-validation.json`` sits beside the pack, mode 0600, and
binds the digest to the pack's st_dev, st_ino, st_size, st_mtime_ns and
st_ctime_ns as observed at ``observed_at_ns``. ctime catches a rewrite whose
mtime was put back (``touch -r``): the kernel sets ctime on every change and
no unprivileged call can set it back.

A record is *racy* when it was observed within one timestamp tick of the
file's last change: a write in that same tick would leave every stat field
unchanged, so such a record proves nothing and the pack is re-hashed.
"""

from __future__ import annotations

import datetime
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common import fsutil
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.schema import (
    INT64_MAX,
    UINT64_MAX,
    Const,
    Field,
    Int,
    Obj,
    Str,
    validate_document,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.strictjson import strict_loads
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.versions import (
    COLDSNAP_VERSION,
    VALIDATION_RECORD_FORMAT,
    VALIDATION_RECORD_KIND,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import pack_relpath

RECORD_SUFFIX = ".coldsnap-validation.json"
RECORD_MAX_BYTES = 64 << 10
# Linux file timestamps come from the coarse real-time clock (one jiffy: 1-10 ms);
# twice the slowest jiffy is a safe tick. File systems with whole-second stamps get 2 s.
FINE_TICK_NS = 20_000_000
COARSE_TICK_NS = 2_000_000_000

RECORD_SCHEMA = Obj({
    "format": Field(Const(VALIDATION_RECORD_FORMAT)),
    "kind": Field(Const(VALIDATION_RECORD_KIND)),
    "sha256": Field(Str(pattern=r"sha256:[0-9a-f]{64}")),
    "size": Field(Int(minimum=0)),
    "path": Field(Str(pattern=r"model-payloads/sha256/[0-9a-f]{64}\.pack")),
    "identity": Field(Obj({
        "st_dev": Field(Int(minimum=0, maximum=UINT64_MAX)),
        "st_ino": Field(Int(minimum=0, maximum=UINT64_MAX)),
        "st_size": Field(Int(minimum=0)),
        "st_mtime_ns": Field(Int(minimum=-INT64_MAX, maximum=INT64_MAX)),
        "st_ctime_ns": Field(Int(minimum=-INT64_MAX, maximum=INT64_MAX)),
    })),
    "observed_at_ns": Field(Int(minimum=0, maximum=INT64_MAX), description="wall clock just before the identity was taken"),
    "verified_at": Field(Str(min_len=1)),
    "method": Field(Str(enum=("full-sha256", "writer-sha256"))),
    "coldsnap_version": Field(Str(min_len=1)),
})


@dataclass(frozen=True)
class FileIdentity:
    """The stat fields a validation record binds."""

    st_dev: int
    st_ino: int
    st_size: int
    st_mtime_ns: int
    st_ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    @classmethod
    def of_fd(cls, fd: int) -> FileIdentity:
        return cls.of(os.fstat(fd))

    def as_dict(self) -> dict:
        return {"st_dev": self.st_dev, "st_ino": self.st_ino, "st_size": self.st_size,
                "st_mtime_ns": self.st_mtime_ns, "st_ctime_ns": self.st_ctime_ns}

    def last_change_ns(self) -> int:
        return max(self.st_mtime_ns, self.st_ctime_ns)


def record_path_for(pack: Path) -> Path:
    """``<hex>.pack.coldsnap-validation.json`` beside ``pack``."""
    return pack.with_name(pack.name + RECORD_SUFFIX)


def timestamp_tick_ns(identity: FileIdentity) -> int:
    """The timestamp granularity to assume for the file system that holds the file."""
    if identity.st_mtime_ns % 1_000_000_000 == 0 and identity.st_ctime_ns % 1_000_000_000 == 0:
        return COARSE_TICK_NS
    return FINE_TICK_NS


def is_racy(identity: FileIdentity, observed_at_ns: int) -> bool:
    """True when an identity observed at ``observed_at_ns`` lies within one tick of the file's last change."""
    return observed_at_ns - identity.last_change_ns() < timestamp_tick_ns(identity)


@dataclass(frozen=True)
class RecordCheck:
    """Outcome of checking a record against the open pack: ``valid`` or why not."""

    status: str  # valid | absent | untrusted | malformed | stale | racy
    reason: str = ""

    @property
    def valid(self) -> bool:
        return self.status == "valid"


def check_record(record: Path, hexdigest: str, size: int, current: FileIdentity) -> RecordCheck:
    """Accept a record only when it is private, well-formed, for this digest/size and not stale or racy."""
    try:
        fd = os.open(record, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO never blocks
    except FileNotFoundError:
        return RecordCheck("absent", "no validation record")
    except OSError as exc:
        return RecordCheck("untrusted", f"cannot open the record ({exc.strerror})")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return RecordCheck("untrusted", "the record is not a regular file")
        if stat.S_IMODE(st.st_mode) & 0o077 or st.st_uid not in (os.geteuid(), 0):
            return RecordCheck("untrusted", f"the record is not private (mode {stat.S_IMODE(st.st_mode):04o}, "
                                            f"owner uid {st.st_uid})")
        if st.st_size > RECORD_MAX_BYTES:
            return RecordCheck("malformed", "the record is too large")
        data = os.pread(fd, RECORD_MAX_BYTES, 0)
    finally:
        os.close(fd)
    try:
        doc = validate_document(RECORD_SCHEMA, strict_loads(data, document="validation record"),
                                document=f"validation record {record}")
    except ColdSnapError as exc:
        return RecordCheck("malformed", str(exc).splitlines()[0])
    if doc["sha256"] != f"sha256:{hexdigest}" or doc["size"] != size or doc["path"] != pack_relpath(hexdigest):
        return RecordCheck("stale", "the record is for another digest, size or path")
    recorded = FileIdentity(**doc["identity"])
    if recorded != current:
        changed = [k for k, v in recorded.as_dict().items() if current.as_dict()[k] != v]
        return RecordCheck("stale", f"the pack changed since it was verified ({', '.join(changed)} differ)")
    if is_racy(recorded, doc["observed_at_ns"]):
        return RecordCheck("racy", "the record was taken within one timestamp tick of the pack's last change")
    return RecordCheck("valid")


def write_record(record: Path, hexdigest: str, size: int, identity: FileIdentity, observed_at_ns: int,
                 *, method: str) -> None:
    """Write the record atomically (temp -> fsync -> rename -> dir fsync), mode 0600."""
    doc = {
        "format": VALIDATION_RECORD_FORMAT,
        "kind": VALIDATION_RECORD_KIND,
        "sha256": f"sha256:{hexdigest}",
        "size": size,
        "path": pack_relpath(hexdigest),
        "identity": identity.as_dict(),
        "observed_at_ns": observed_at_ns,
        "verified_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "method": method,
        "coldsnap_version": COLDSNAP_VERSION,
    }
    fsutil.atomic_write_json(record, doc, mode=0o600)
