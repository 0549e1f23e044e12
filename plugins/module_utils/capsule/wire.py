"""OCI capsule layers on the wire: gzip-compressed for a registry, verified twice when pulled.

A local OCI-layout capsule keeps its layer uncompressed: a restore reads the CRIU
image straight from the unpacked layer, and the layer's digest is its diff id. What
goes to a registry is a second manifest over the same config whose layers are
``application/vnd.oci.image.layer.v1.tar+gzip``: the tar cut into fixed-size
pieces, each compressed as one gzip member on its own core (a multi-member gzip
stream, which gzip, Docker and containerd read as one). The wire manifest carries
the local manifest digest (:data:`ANN_IMAGE_ID`), each layer its uncompressed size
(:data:`ANN_LAYER_SIZE`) and the compressed size of each member
(:data:`ANN_LAYER_MEMBERS`), so that a pull inflates the members on every core too.

A pull checks the compressed bytes against the wire digest as they arrive and the
decompressed bytes against the config's diff id. Before any layer is fetched, the
local manifest is rebuilt from the config's diff ids and the announced sizes
(:func:`rebuilt_manifest`) and its digest must be the capsule id the descriptor
records: every size a pull writes up to is one that id vouches for. A member holds at
most :data:`MEMBER` bytes inflated and :data:`MEMBER_WIRE_MAX` compressed; at most a
few members per thread are in memory.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import zlib
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import oci
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import IntegrityError, space_error

ANN_IMAGE_ID = "io.coldsnap.capsule.image-id"
ANN_LAYER_SIZE = "io.coldsnap.layer.size"
ANN_LAYER_MEMBERS = "io.coldsnap.layer.gzip-members"  # compressed bytes of each member, comma-separated
COMPRESSIONS = ("gzip", "none")
LEVEL = 3  # zlib level: CRIU page images of heaps and arenas compress to ~0.2-0.3 at 1-6 alike; 3 is ~2x level 6's speed
MEMBER = 8 << 20  # bytes of tar per gzip member (one task for one core); no member inflates to more
OUT_CHUNK = 4 << 20  # most bytes one decompression step may produce (bounds memory on a hostile stream)
GZIP_WBITS = 31  # zlib's gzip container

MAX_WORKERS = 8  # inflating 8 members at once outruns a disk; more would only hold more memory
MEMBER_WIRE_MAX = MEMBER + (MEMBER >> 10) + 64  # a member of MEMBER bytes never deflates to more (zlib's bound)
DAMAGED_FIX = "the registry holds other bytes than were published; publish the capture again"

Progress = Callable[[int], None]


def _workers(workers: int | None) -> int:
    """Threads for compressing or inflating: the CPUs this process may run on (not the host's), at most
    :data:`MAX_WORKERS`; at most ``workers + 2`` members are held at once."""
    if workers:
        return max(1, workers)
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = os.cpu_count() or 1
    return max(1, min(allowed, MAX_WORKERS))


def _digits(raw: Any) -> bool:
    return isinstance(raw, str) and raw.isascii() and raw.isdigit() and 0 < len(raw) <= 18


def _gzip_member(data: bytes, level: int) -> bytes:
    # zlib releases the GIL while it deflates: members compress on every core at once.
    comp = zlib.compressobj(level, zlib.DEFLATED, GZIP_WBITS)
    return comp.compress(data) + comp.flush()


@dataclass(frozen=True)
class Compressed:
    """What :func:`compress` wrote (``digest``, ``size``, each member's compressed size) and read
    (``source_digest``, ``source_size``)."""

    digest: str
    size: int
    members: list[int]
    source_digest: str
    source_size: int


def compress(src: IO[bytes], out: IO[bytes], *, level: int = LEVEL, workers: int | None = None,
             progress: Progress | None = None) -> Compressed:
    """gzip ``src`` into ``out`` as independent members compressed in parallel, hashing both sides. The
    output depends only on the input, the level and zlib's version."""
    workers = _workers(workers)
    sha = hashlib.sha256()
    source = hashlib.sha256()
    members: list[int] = []
    read = 0
    pending: deque = deque()

    def emit() -> None:
        data = pending.popleft().result()
        out.write(data)
        sha.update(data)
        members.append(len(data))

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="coldsnap-gzip") as pool:
        while True:
            piece = src.read(MEMBER)
            if not piece and (members or pending):
                break  # (an empty layer is still one empty gzip member)
            read += len(piece)
            pending.append(pool.submit(_gzip_member, piece, level))
            source.update(piece)  # while the workers deflate it
            while len(pending) > workers + 1:
                emit()
                if progress is not None:
                    progress(read)
            if not piece:
                break
        while pending:
            emit()
    if progress is not None:
        progress(read)
    return Compressed("sha256:" + sha.hexdigest(), sum(members), members, "sha256:" + source.hexdigest(), read)


def compress_blob(layout: Path, desc: oci.Descriptor, *, spool_dir: Path, level: int = LEVEL,
                  progress: Progress | None = None) -> tuple[oci.Descriptor, IO[bytes]]:
    """The wire descriptor of one local layer and an anonymous spool file holding its gzip bytes (gone
    when closed, or when the process dies: nothing to clean up after a killed publish). The layer's bytes
    are checked against its digest as they are read: what goes out is what was captured."""
    spool = tempfile.TemporaryFile(dir=spool_dir)  # handed to the caller, who closes it
    try:
        with oci.open_blob(layout, desc, what=f"layer {desc.digest}") as src:
            try:
                done = compress(src, spool, level=level, progress=progress)
            except OSError as exc:  # the spool needs up to the layer's size free beside the capsules
                raise space_error(exc, what=f"the compressed copy of layer {desc.digest}", path=spool_dir,
                                  needed=desc.size) from exc
        if (done.source_digest, done.source_size) != (desc.digest, desc.size):
            raise IntegrityError(f"layer {desc.digest} of the capsule at {layout} changed while it was compressed "
                                 f"({done.source_size} bytes hashing to {done.source_digest})",
                                 fix="the local copy is corrupt; remove the layout directory and capture again")
        spool.flush()
    except BaseException:
        spool.close()
        raise
    wire = oci.Descriptor(oci.MEDIA_LAYER_GZIP, done.digest, done.size,
                          {ANN_LAYER_SIZE: str(desc.size), ANN_LAYER_MEMBERS: ",".join(map(str, done.members))})
    return wire, spool


def wire_manifest(img: oci.Image, layers: list[oci.Descriptor]) -> bytes:
    """The manifest pushed for ``img`` with ``layers`` in place of its own, naming the local capsule id."""
    manifest = oci.image_manifest(img.config_desc, layers)
    manifest["annotations"] = {ANN_IMAGE_ID: img.manifest_desc.digest}
    return oci.json_bytes(manifest)


def announced_size(desc: oci.Descriptor, *, what: str) -> int:
    """The uncompressed size a wire layer announces (the most a pull will write for it)."""
    raw = desc.annotations.get(ANN_LAYER_SIZE)
    if not _digits(raw):
        raise IntegrityError(f"{what} is compressed but does not announce its uncompressed size ({ANN_LAYER_SIZE})",
                             fix="this is not a ColdSnap capsule publication; publish the capture again with "
                                 "coldsnap publish")
    return int(raw)


def announced_members(desc: oci.Descriptor, *, what: str) -> list[int] | None:
    """The compressed size of each gzip member a wire layer announces (they add up to its size), or None
    when it announces none (a layer compressed elsewhere: inflated as one stream)."""
    raw = desc.annotations.get(ANN_LAYER_MEMBERS)
    if raw is None:
        return None
    parts = raw.split(",") if isinstance(raw, str) else []
    if not parts or len(parts) > desc.size // 18 + 1 or not all(map(_digits, parts)) \
            or sum(map(int, parts)) != desc.size:
        raise IntegrityError(f"{what} announces gzip members ({ANN_LAYER_MEMBERS}) that are not its {desc.size} bytes",
                             fix=DAMAGED_FIX)
    sizes = [int(p) for p in parts]
    if max(sizes) > MEMBER_WIRE_MAX:
        raise IntegrityError(f"{what} announces a gzip member of {max(sizes)} bytes, more than a member of "
                             f"{MEMBER} bytes deflates to", fix=DAMAGED_FIX)
    return sizes


def rebuilt_manifest(config: oci.Descriptor, diff_ids: Any, layers: tuple[oci.Descriptor, ...] | list[oci.Descriptor],
                     *, what: str) -> bytes:
    """The local manifest a pull of these wire layers lands (config, then each layer as the uncompressed tar
    its config's diff id and its announced size say): its digest must be the recorded capsule id before a
    byte of a layer is fetched, so that every size a pull will write up to is one the id vouches for."""
    if not isinstance(diff_ids, list) or len(diff_ids) != len(layers):
        raise IntegrityError(f"the config of {what} does not name one diff id per layer",
                             fix="this is not a ColdSnap capsule publication; publish the capture again")
    local = []
    for i, (diff_id, d) in enumerate(zip(diff_ids, layers, strict=True)):
        if d.media_type not in oci.COMPRESSED_LAYER_TYPES:
            raise IntegrityError(f"layer {i} of {what} is not gzip ({d.media_type!r}) among gzip layers",
                                 fix="this is not a ColdSnap capsule publication; publish the capture again")
        local.append(oci.Descriptor(oci.MEDIA_LAYER_TAR, diff_id, announced_size(d, what=f"layer {i} of {what}")))
    return oci.json_bytes(oci.image_manifest(config, local))


def _inflate_member(data: bytes) -> bytes:
    inflater = zlib.decompressobj(GZIP_WBITS)
    out = inflater.decompress(data, MEMBER + 1)
    if len(out) > MEMBER:
        raise _MemberTooLarge
    if not inflater.eof or inflater.unused_data or inflater.unconsumed_tail:
        raise zlib.error("a gzip member does not end where the layer announces")
    return out


class _MemberTooLarge(Exception):
    pass


def _read_exactly(src: IO[bytes], n: int) -> bytes:
    parts, left = [], n
    while left:
        part = src.read(left)
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def gunzip(src: IO[bytes], out: IO[bytes], *, limit: int, what: str, members: list[int] | None = None,
           workers: int | None = None) -> tuple[str, int]:
    """Decompress a (multi-member) gzip stream into ``out``; (digest, size) of the decompressed bytes.

    With ``members`` (the compressed size of each member), the members are inflated on ``workers`` threads
    (all cores by default) and written in order; each must end exactly there and inflate to at most
    :data:`MEMBER` bytes. Raises IntegrityError for a stream that is not gzip, is truncated, has trailing
    bytes, or would decompress to more than ``limit`` bytes (written output stops there)."""
    if members is not None:
        return _gunzip_members(src, out, limit=limit, what=what, members=members, workers=workers)
    sink = _Sink(out, limit, what)
    take = sink.take
    inflater: Any = None
    count = 0

    def feed(buf: bytes) -> None:
        nonlocal inflater, count
        while True:
            if inflater is None:
                if not buf:
                    return
                inflater = zlib.decompressobj(GZIP_WBITS)
                count += 1
            got = inflater.decompress(buf, OUT_CHUNK)
            take(got)
            if inflater.eof:
                buf, inflater = inflater.unused_data, None  # the next member starts here
            elif inflater.unconsumed_tail:
                buf = inflater.unconsumed_tail
            elif buf or got:
                buf = b""  # input all taken; zlib may still hold output that OUT_CHUNK cut off
            else:
                return

    try:
        while chunk := src.read(oci.CHUNK):
            feed(chunk)
        feed(b"")
    except zlib.error as exc:
        raise IntegrityError(f"{what} is not a valid gzip stream ({exc})", fix=DAMAGED_FIX) from None
    if count == 0 or (inflater is not None and not inflater.eof):
        raise IntegrityError(f"{what} ends inside a gzip member (truncated)", fix=DAMAGED_FIX)
    return sink.result()


def _gunzip_members(src: IO[bytes], out: IO[bytes], *, limit: int, what: str, members: list[int],
                    workers: int | None) -> tuple[str, int]:
    workers = _workers(workers)
    sink = _Sink(out, limit, what)
    pending: deque = deque()

    def emit() -> None:
        try:
            sink.take(pending.popleft().result())
        except _MemberTooLarge:
            raise IntegrityError(f"{what} has a gzip member that inflates to more than {MEMBER} bytes",
                                 fix=DAMAGED_FIX) from None
        except zlib.error as exc:
            raise IntegrityError(f"{what} is not a valid gzip stream ({exc})", fix=DAMAGED_FIX) from None

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="coldsnap-gunzip") as pool:
        try:
            for n in members:
                data = _read_exactly(src, n)
                if len(data) != n:
                    raise IntegrityError(f"{what} ends inside a gzip member (truncated)", fix=DAMAGED_FIX)
                pending.append(pool.submit(_inflate_member, data))
                while len(pending) > workers + 1:
                    emit()
            while pending:
                emit()
        finally:
            for job in pending:
                job.cancel()
    return sink.result()


class _Sink:
    """Writes and hashes decompressed bytes, refusing any beyond the announced size."""

    def __init__(self, out: IO[bytes], limit: int, what: str) -> None:
        self.out, self.limit, self.what = out, limit, what
        self.sha = hashlib.sha256()
        self.size = 0

    def take(self, data: bytes) -> None:
        if self.size + len(data) > self.limit:
            raise IntegrityError(f"{self.what} decompresses to more than the {self.limit} bytes it announces",
                                 fix=DAMAGED_FIX)
        self.out.write(data)
        self.sha.update(data)
        self.size += len(data)

    def result(self) -> tuple[str, int]:
        return "sha256:" + self.sha.hexdigest(), self.size
