"""OCI image layouts on disk (image-spec v1.1), written and verified with the standard library only.

A ColdSnap OCI capsule is a layout directory::

    <root>/sha256/<manifest hex>/
        oci-layout                {"imageLayoutVersion": "1.0.0"}
        index.json                one manifest descriptor, annotated with the capsule's name
        blobs/sha256/<hex>        the layer tar, the image config, the manifest

The directory is named after the manifest digest (the capsule's id), so a
rebuild or a pull of the same capsule lands on the same path and a present,
verified directory means "nothing to do". Blobs are written under temporary
names and renamed to their digest only after their bytes were hashed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    FormatError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import (
    atomic_write_bytes,
    file_lock,
    temp_path_for,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.canonical import canonical_json
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.identifiers import parse_digest
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.strictjson import strict_loads

MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
MEDIA_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER_TAR = "application/vnd.docker.image.rootfs.diff.tar"
MANIFEST_TYPES = (MEDIA_MANIFEST, DOCKER_MANIFEST)
COMPRESSED_LAYER_TYPES = (MEDIA_LAYER_GZIP, "application/vnd.docker.image.rootfs.diff.tar.gzip")
LAYER_TYPES = (MEDIA_LAYER_TAR, DOCKER_LAYER_TAR)
REF_NAME = "org.opencontainers.image.ref.name"
LAYOUT_FILE = {"imageLayoutVersion": "1.0.0"}
CHUNK = 1 << 20


@dataclass(frozen=True)
class Descriptor:
    """An OCI content descriptor."""

    media_type: str
    digest: str
    size: int
    annotations: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.annotations:
            d["annotations"] = dict(self.annotations)
        return d

    @classmethod
    def from_dict(cls, d: Any, *, what: str) -> Descriptor:
        if not isinstance(d, dict) or not isinstance(d.get("mediaType"), str) or not isinstance(d.get("size"), int):
            raise IntegrityError(f"{what} is not a valid OCI descriptor", fix="rebuild or re-pull the capsule")
        parse_digest(d.get("digest"), what=f"{what} digest")
        if d["size"] < 0:
            raise IntegrityError(f"{what} has a negative size", fix="rebuild or re-pull the capsule")
        ann = d.get("annotations") or {}
        return cls(d["mediaType"], d["digest"], d["size"], dict(ann) if isinstance(ann, dict) else {})


@dataclass(frozen=True)
class Image:
    """A verified image inside a layout: its manifest descriptor, manifest, config and layers."""

    layout: Path
    manifest_desc: Descriptor
    manifest: dict[str, Any]
    config_desc: Descriptor
    config: dict[str, Any]
    layers: tuple[Descriptor, ...]

    @property
    def labels(self) -> dict[str, str]:
        return dict((self.config.get("config") or {}).get("Labels") or {})

    @property
    def bytes(self) -> int:
        return self.manifest_desc.size + self.config_desc.size + sum(d.size for d in self.layers)


def json_bytes(value: Any) -> bytes:
    """The bytes ColdSnap writes for a manifest or config: canonical JSON (stable digest)."""
    return canonical_json(value)


def image_manifest(config: Descriptor, layers: list[Descriptor] | tuple[Descriptor, ...]) -> dict[str, Any]:
    """The image manifest of a local capsule: its config and layers, nothing else (its bytes are the
    capsule's id, so a pull that rebuilds it from compressed wire layers lands on the same digest)."""
    return {"schemaVersion": 2, "mediaType": MEDIA_MANIFEST, "config": config.as_dict(),
            "layers": [d.as_dict() for d in layers]}


def digest_bytes(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def blob_path(layout: Path, digest: str) -> Path:
    """Where a blob lives; the digest is parsed strictly before it becomes a path (FAULTS.md 7)."""
    return Path(layout) / "blobs" / "sha256" / parse_digest(digest, what="blob digest")


def layout_dir(root: Path, manifest_digest: str) -> Path:
    """The content-addressed layout directory of a capsule below ``root``."""
    return Path(root) / "sha256" / parse_digest(manifest_digest, what="capsule manifest digest")


@contextlib.contextmanager
def layout_lock(root: Path, manifest_digest: str) -> Iterator[Path]:
    """Hold the lock of one capsule's layout directory (yielded) while it is checked, replaced or renamed
    into place: without it, a build or pull that found the layout damaged (or absent) could remove the
    whole copy another one had just renamed there, under a reader that was told it is in place."""
    final = layout_dir(root, manifest_digest)
    final.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = final.parent / f".{final.name}.lock"
    while True:
        with file_lock(lock) as fd:
            try:
                current = os.stat(lock, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if not current:
                continue  # its holder removed it on release: lock the one there now
            try:
                yield final
            finally:
                # Removed while held, so the directory lists only layouts; a waiter on the removed file
                # sees that above and takes the next one.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock)
            return


def blob_dir(layout: Path) -> Path:
    """A layout's ``blobs/sha256`` directory, made private (capsule blobs hold process memory)."""
    blobs = Path(layout) / "blobs"
    for d in (blobs, blobs / "sha256"):
        d.mkdir(parents=True, mode=0o700, exist_ok=True)
    return blobs / "sha256"


def write_blob_bytes(layout: Path, data: bytes, media_type: str) -> Descriptor:
    """Store ``data`` as a blob; return its descriptor."""
    digest = digest_bytes(data)
    path = blob_path(layout, digest)
    if not path.exists():
        blob_dir(layout)
        atomic_write_bytes(path, data, mode=0o600)
    return Descriptor(media_type, digest, len(data))


def write_blob_stream(layout: Path, media_type: str, produce: Callable[[IO[bytes]], object]) -> Descriptor:
    """Store a blob whose bytes ``produce(fileobj)`` writes; hashed on the way, renamed to its digest."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.archive import HashingWriter

    tmp = temp_path_for(blob_dir(layout) / "blob")
    try:
        with open(tmp, "xb") as fh:
            writer = HashingWriter(fh)
            produce(writer)
            fh.flush()
            os.fsync(fh.fileno())
        final = blob_path(layout, writer.digest)
        os.chmod(tmp, 0o600)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return Descriptor(media_type, writer.digest, writer.size)


def hash_file(path: Path) -> tuple[str, int]:
    """(``sha256:`` digest, size) of a file."""
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return "sha256:" + sha.hexdigest(), size


def open_blob(layout: Path, desc: Descriptor, *, what: str) -> IO[bytes]:
    """The blob of ``desc`` opened for reading: a regular file of the descriptor's size, never read through
    a symbolic link (a link to ``/dev/zero`` or to a file elsewhere would be read without end, or be
    someone else's bytes). IntegrityError otherwise; the caller still checks the digest."""
    path = blob_path(layout, desc.digest)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise IntegrityError(f"{what}: blob {desc.digest} is missing from {layout}",
                             fix="the OCI layout is incomplete; rebuild or re-pull the capsule") from None
    except OSError as exc:
        raise IntegrityError(f"{what}: blob {path} cannot be opened ({exc.strerror}; a symbolic link is refused)",
                             fix="the local copy is damaged; remove the layout directory and rebuild or re-pull "
                                 "it") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size != desc.size:
        os.close(fd)
        raise IntegrityError(f"{what}: blob {path} is not a regular file of {desc.size} bytes",
                             fix="the local copy is damaged; remove the layout directory and rebuild or re-pull it")
    return os.fdopen(fd, "rb")


def verify_blob(layout: Path, desc: Descriptor, *, what: str) -> None:
    """Re-hash a blob; raise IntegrityError when it is missing or its bytes differ from the descriptor."""
    path = blob_path(layout, desc.digest)
    sha = hashlib.sha256()
    size = 0
    with open_blob(layout, desc, what=what) as fh:
        while chunk := fh.read(min(CHUNK, desc.size + 1 - size)):
            sha.update(chunk)
            size += len(chunk)
    digest = "sha256:" + sha.hexdigest()
    if digest != desc.digest or size != desc.size:
        raise IntegrityError(f"{what}: blob {path} holds {digest} ({size} bytes), expected {desc.digest} "
                             f"({desc.size} bytes)",
                             fix="the local copy is corrupt; remove the layout directory and rebuild or re-pull it")


def write_layout_files(layout: Path, manifest_desc: Descriptor) -> None:
    """Write ``oci-layout`` and an ``index.json`` naming the one manifest."""
    atomic_write_bytes(Path(layout) / "oci-layout", json_bytes(LAYOUT_FILE), mode=0o600)
    index = {"schemaVersion": 2, "mediaType": MEDIA_INDEX, "manifests": [manifest_desc.as_dict()]}
    atomic_write_bytes(Path(layout) / "index.json", json_bytes(index), mode=0o600)


LAYOUT_FILE_MAX = 1 << 20  # index.json and oci-layout of a one-manifest layout are a few hundred bytes


def _read_layout_json(layout: Path, name: str, *, what: str) -> Any:
    """One of a layout's own JSON files: a regular file (never read through a symbolic link, nor a FIFO
    or device, which would be read without end), at most LAYOUT_FILE_MAX bytes, strict JSON."""
    path = layout / name
    damaged = "remove the directory and rebuild or re-pull the capsule"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ColdSnapError(f"{what} at {layout} is not an OCI layout ({path} is missing)",
                            fix="build or pull the capsule first") from None
    except OSError as exc:
        raise IntegrityError(f"{what} at {layout}: {name} cannot be opened ({exc.strerror}; a symbolic link is "
                             "refused)", fix=damaged) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > LAYOUT_FILE_MAX:
            raise IntegrityError(f"{what} at {layout}: {name} is not a regular file of at most {LAYOUT_FILE_MAX} "
                                 "bytes", fix=damaged)
        data = os.pread(fd, LAYOUT_FILE_MAX + 1, 0)
    except OSError as exc:
        raise IntegrityError(f"{what} at {layout}: {name} cannot be read ({exc.strerror})", fix=damaged) from None
    finally:
        os.close(fd)
    try:
        return strict_loads(data, document=f"{name} of {what}")
    except FormatError as exc:
        raise IntegrityError(f"{what} at {layout} has a malformed {name} ({exc.issues[0].message})",
                             fix=damaged) from None


def load_json_blob(layout: Path, desc: Descriptor, *, what: str) -> dict[str, Any]:
    """A JSON-object blob (manifest, config) read whole and checked against its descriptor."""
    path = blob_path(layout, desc.digest)
    with open_blob(layout, desc, what=what) as fh:
        data = fh.read(desc.size + 1)
    if digest_bytes(data) != desc.digest or len(data) != desc.size:
        raise IntegrityError(f"{what}: blob {path} does not match its digest {desc.digest}",
                             fix="the local copy is corrupt; remove the layout directory and rebuild or re-pull it")
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise IntegrityError(f"{what}: blob {desc.digest} is not JSON ({exc})", fix="rebuild or re-pull") from exc
    if not isinstance(value, dict):
        raise IntegrityError(f"{what}: blob {desc.digest} is not a JSON object", fix="rebuild or re-pull")
    return value


def parse_manifest(manifest: dict[str, Any], *, what: str,
                   compressed_ok: bool = False) -> tuple[Descriptor, tuple[Descriptor, ...]]:
    """(config, layers) of an image manifest; refuse indexes and unknown layer types.

    OCI-layout capsules use uncompressed layers (their digest is the diff id);
    ``compressed_ok`` admits the gzip layers Docker pushes for docker capsules.
    """
    media = manifest.get("mediaType", MEDIA_MANIFEST)
    if manifest.get("schemaVersion") != 2 or media not in MANIFEST_TYPES:
        raise IntegrityError(f"{what} is not an image manifest (mediaType {media!r})",
                             fix="a capsule is one single-platform image manifest; rebuild or re-pull it")
    config = Descriptor.from_dict(manifest.get("config"), what=f"{what} config")
    raw_layers = manifest.get("layers")
    if not isinstance(raw_layers, list):
        raise IntegrityError(f"{what} has no layer list", fix="rebuild or re-pull the capsule")
    layers = tuple(Descriptor.from_dict(d, what=f"{what} layer {i}") for i, d in enumerate(raw_layers))
    for i, d in enumerate(layers):
        if d.media_type not in LAYER_TYPES and not (compressed_ok and d.media_type in COMPRESSED_LAYER_TYPES):
            raise IntegrityError(f"{what} layer {i} has media type {d.media_type!r}",
                                 fix="ColdSnap capsules use uncompressed tar layers; rebuild the capsule")
    return config, layers


def open_layout(layout: Path, *, expected_manifest: str | None = None, verify_layers: bool = True,
                what: str = "OCI capsule") -> Image:
    """Read and verify a layout: index -> manifest -> config (and layers unless told otherwise)."""
    layout = Path(layout)
    index = _read_layout_json(layout, "index.json", what=what)
    marker = _read_layout_json(layout, "oci-layout", what=what)
    if not isinstance(marker, dict) or marker.get("imageLayoutVersion") != "1.0.0":
        raise IntegrityError(f"{what} at {layout} has an unsupported oci-layout file",
                             fix="remove the directory and rebuild or re-pull the capsule")
    manifests = index.get("manifests") if isinstance(index, dict) else None
    if not isinstance(manifests, list) or len(manifests) != 1:
        raise IntegrityError(f"{what} at {layout} must index exactly one manifest",
                             fix="remove the directory and rebuild or re-pull the capsule")
    mdesc = Descriptor.from_dict(manifests[0], what=f"{what} index entry")
    if expected_manifest is not None and mdesc.digest != expected_manifest:
        raise IntegrityError(f"{what} at {layout} indexes manifest {mdesc.digest}, expected {expected_manifest}",
                             fix="the layout does not hold the recorded capsule; rebuild or re-pull it")
    manifest = load_json_blob(layout, mdesc, what=f"{what} manifest")
    cdesc, layers = parse_manifest(manifest, what=f"{what} manifest")
    config = load_json_blob(layout, cdesc, what=f"{what} config")
    diff_ids = (config.get("rootfs") or {}).get("diff_ids")
    if diff_ids != [d.digest for d in layers]:
        raise IntegrityError(f"{what} config diff_ids do not match its layers",
                             fix="ColdSnap capsules use uncompressed layers whose digest is the diff id; rebuild")
    if verify_layers:
        for i, d in enumerate(layers):
            verify_blob(layout, d, what=f"{what} layer {i}")
    return Image(layout, mdesc, manifest, cdesc, config, layers)
