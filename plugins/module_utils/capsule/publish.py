"""Capsule publication: explicit push after acceptance, and pull-by-digest with full verification.

Push (on the capture host): the local capsule must be exactly the recorded one
(image id / manifest digest), then it goes to ``policy.capsule.repository``:
docker capsules with the Docker SDK, OCI-layout capsules with the stdlib client
in :mod:`.registry`. The result is an immutable ``repo@sha256:<manifest digest>``,
read back from the registry and checked before it is returned.

Pull (on a restore host): only the capsule assigned to the unit, by digest.
Docker verifies every layer digest itself; we then require the local image id to
equal the recorded one. OCI-layout pulls hash every blob as it arrives, write
into a temporary directory and move it into place only when everything matched:
a registry returning wrong bytes fails the pull and leaves nothing cached.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import archive, oci, wire
from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.build import (
    LABEL_CAPTURE,
    LABEL_KIND,
    LABEL_UNIT,
    CapsuleRef,
    inspect_capsule,
    locked_temp_layout,
    remove_abandoned_layouts,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.registry import (
    RegistryClient,
    RegistryError,
    parse_repository,
    split_repository_digest,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
    space_error,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import fsync_dir, temp_path_for
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import identifiers as ids

Progress = Callable[[dict[str, Any]], None]
MANIFEST_ACCEPT = (oci.MEDIA_MANIFEST, oci.DOCKER_MANIFEST)


class PublishError(ColdSnapError):
    """A push or pull that did not complete; nothing was recorded."""


def publish_tag(ref: CapsuleRef, capture_id: str | None) -> str:
    """The human-readable tag a capsule is pushed under (the digest stays the identity)."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.dockerapi import sanitize_tag

    return sanitize_tag(f"{capture_id or 'capsule'}.{ref.unit}")


def _docker_auth(auth: dict[str, Any] | None) -> dict[str, Any] | None:
    if not auth:
        return None
    keys = ("username", "password", "email", "serveraddress", "identitytoken", "registrytoken")
    return {k: v for k, v in auth.items() if k in keys and v}


# ----------------------------------------------------------------------------- push

def push_capsule(ref: CapsuleRef, repository: str, *, auth: dict[str, Any] | None = None,
                 progress: Progress | None = None, client: Any = None, insecure: bool | None = None,
                 compression: str = "gzip") -> str:
    """Push a verified local capsule; return ``repository@sha256:<manifest digest>``.

    OCI-layout capsules travel with gzip layers unless ``compression`` is ``"none"`` (see
    :mod:`.wire`); docker capsules as the daemon pushes them (gzip). Raises PublishError (a registry
    refusal, with the registry's reason) or IntegrityError (the local capsule is not the recorded one).
    """
    if compression not in wire.COMPRESSIONS:
        raise ColdSnapError(f"capsule layer compression {compression!r} is unknown",
                            fix=f"use one of {', '.join(wire.COMPRESSIONS)}")
    parse_repository(repository)
    details = inspect_capsule(ref, verify=True, client=client)
    tag = publish_tag(ref, details.get("capture_id"))
    if ref.layout == "docker":
        digest = _push_docker(ref, repository, tag, auth=auth, progress=progress, client=client, insecure=insecure)
    else:
        digest = _push_oci(ref, repository, tag, auth=auth, progress=progress, insecure=insecure,
                           compression=compression)
    return f"{repository}@{digest}"


def _push_docker(ref: CapsuleRef, repository: str, tag: str, *, auth: dict[str, Any] | None,
                 progress: Progress | None, client: Any, insecure: bool | None = None) -> str:
    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import dockerapi

    docker = dockerapi.docker_module()
    client = dockerapi.docker_client(client)
    image = client.images.get(ref.image_id)
    if not image.tag(repository, tag):
        raise PublishError(f"could not tag capsule {ref.image_id} of unit {ref.unit!r} as {repository}:{tag}",
                           fix="check the Docker daemon")
    digest = None
    error = None
    try:
        for ev in client.api.push(repository, tag=tag, stream=True, decode=True, auth_config=_docker_auth(auth)):
            if progress is not None:
                progress({"unit": ref.unit, "status": ev.get("status"), "id": ev.get("id")})
            if "error" in ev or "errorDetail" in ev:
                error = str(ev.get("error") or (ev.get("errorDetail") or {}).get("message"))
            aux = ev.get("aux")
            if isinstance(aux, dict) and aux.get("Digest"):
                digest = aux["Digest"]
    except docker.errors.APIError as exc:
        error = str(exc.explanation or exc)
    finally:
        # The publish tag is a convenience on the registry side only; keep the local store as it was. Where it
        # is the capsule's only name (another build of its unit and capture took the local name), it stays:
        # removing an image's last name removes the image, the capsule itself.
        try:
            if set(client.images.get(ref.image_id).tags) - {f"{repository}:{tag}"}:
                client.images.remove(f"{repository}:{tag}", noprune=True)
        except docker.errors.APIError:
            pass
    if error:
        raise PublishError(f"registry refused the push of capsule {ref.image_id} (unit {ref.unit!r}) to "
                           f"{repository}: {error}",
                           fix="check that the registry accepts pushes (not read-only) and the credentials; "
                               "nothing was recorded")
    if not digest or not ids.is_digest(digest):
        raise PublishError(f"push of capsule of unit {ref.unit!r} to {repository} reported no manifest digest",
                           fix="check the Docker daemon's logs; nothing was recorded")
    # Read back as the daemon pushed it: over plain HTTP where the publication says the registry is insecure.
    _verify_remote_manifest(repository, digest, auth=auth, what=f"capsule of unit {ref.unit!r}",
                            expected_config=ref.image_id, insecure=insecure)
    return digest


def _push_oci(ref: CapsuleRef, repository: str, tag: str, *, auth: dict[str, Any] | None,
              progress: Progress | None, insecure: bool | None, compression: str) -> str:
    img = oci.open_layout(Path(ref.location), expected_manifest=ref.image_id, verify_layers=False,
                          what=f"capsule of unit {ref.unit!r}")
    reg = RegistryClient(repository, auth=auth, insecure=insecure)
    what = f"capsule of unit {ref.unit!r}"

    def upload(desc: oci.Descriptor, opener: Callable[[], Any]) -> None:
        if reg.blob_exists(desc.digest, desc.size):
            if progress:
                progress({"unit": ref.unit, "status": "exists", "digest": desc.digest})
            return
        reg.upload_blob(desc.digest, desc.size, opener, what=f"blob {desc.digest} of {what}")
        if progress:
            progress({"unit": ref.unit, "status": "pushed", "digest": desc.digest, "bytes": desc.size})

    upload(img.config_desc, lambda: oci.blob_path(img.layout, img.config_desc.digest).read_bytes())
    if compression == "none":
        for desc in img.layers:
            upload(desc, lambda d=desc: oci.open_blob(img.layout, d, what=f"layer of {what}"))
        mbytes, mtype = oci.blob_path(img.layout, ref.image_id).read_bytes(), img.manifest_desc.media_type
    else:
        plain = [oci.Descriptor(oci.MEDIA_LAYER_TAR, d.digest, d.size) for d in img.layers]
        if oci.digest_bytes(oci.json_bytes(oci.image_manifest(img.config_desc, plain))) != ref.image_id:
            raise PublishError(f"{what} at {ref.location} is not a layout a pull can rebuild from gzip layers "
                               "(its manifest is not ColdSnap's own)",
                               fix="publish it with layer_compression: none (coldsnap_capsule_compression=none), "
                                   "or capture again")
        pushed = []
        for desc in img.layers:
            def compressing(done: int, d: oci.Descriptor = desc) -> None:
                if progress:
                    progress({"unit": ref.unit, "status": "compressing", "id": f"{done >> 20}/{d.size >> 20} MiB"})

            wdesc, spool = wire.compress_blob(img.layout, desc, spool_dir=img.layout.parent, progress=compressing)
            readers: list[Any] = []
            with spool:
                try:
                    upload(wdesc, lambda f=spool, opened=readers: _rewound(f, opened))
                finally:
                    for reader in readers:
                        reader.close()
            pushed.append(wdesc)
        mbytes, mtype = wire.wire_manifest(img, pushed), oci.MEDIA_MANIFEST
    digest = oci.digest_bytes(mbytes)
    got = reg.put_manifest(tag, mbytes, mtype, what=what)
    if got and got != digest:
        raise PublishError(f"registry stored the manifest of {what} as {got}, expected {digest}",
                           fix="the registry rewrote the manifest; use another registry")
    _verify_remote_manifest(repository, digest, auth=auth, what=what, insecure=insecure,
                            expected_config=img.config_desc.digest)
    return digest


def _rewound(spool: Any, readers: list[Any]) -> Any:
    """A new reader of an anonymous spool file from its start (an upload re-sent after an auth challenge
    reads it again), kept in ``readers`` for the caller to close."""
    reader = os.fdopen(os.dup(spool.fileno()), "rb")
    readers.append(reader)
    reader.seek(0)
    return reader


def _verify_remote_manifest(repository: str, digest: str, *, auth: dict[str, Any] | None, what: str,
                            expected_config: str | None = None, insecure: bool | None = None) -> None:
    """GET the manifest back by digest, check its bytes, its config and that every blob is there."""
    reg = RegistryClient(repository, auth=auth, insecure=insecure)
    data = reg.get_manifest(digest, MANIFEST_ACCEPT, what=what)
    if oci.digest_bytes(data) != digest:
        raise PublishError(f"registry {repository} returns a manifest for {digest} whose bytes hash to "
                           f"{oci.digest_bytes(data)} ({what})",
                           fix="the registry does not preserve content; do not record this publication")
    manifest = json.loads(data)
    config, layers = oci.parse_manifest(manifest, what=f"published manifest of {what}", compressed_ok=True)
    if expected_config is not None and config.digest != expected_config:
        raise PublishError(f"published manifest of {what} names config {config.digest}, expected {expected_config}",
                           fix="the pushed image is not the recorded capsule; nothing was recorded")
    for d in (config, *layers):
        if not reg.blob_exists(d.digest, d.size):
            if reg.blob_exists(d.digest):
                raise PublishError(f"registry {repository} holds blob {d.digest} of {what} with another size than "
                                   f"its {d.size} bytes, a damaged copy that a push does not replace (a registry "
                                   "keeps the first bytes stored under a digest)",
                                   fix="have the registry's operator remove that blob from its storage, then "
                                       "publish again; nothing was recorded")
            raise PublishError(f"registry {repository} lacks blob {d.digest} of {what} after the push",
                               fix="retry the publication; nothing was recorded")


# ----------------------------------------------------------------------------- pull

def pull_capsule(repository_digest: str, *, expected_image_id: str, layout: str, oci_root: Path | None = None,
                 auth: dict[str, Any] | None = None, unit: str | None = None, client: Any = None,
                 insecure: bool | None = None, progress: Progress | None = None) -> CapsuleRef:
    """Fetch exactly one published capsule by digest and verify it; return the local capsule.

    Already present and verified: nothing is fetched. Any mismatch raises
    IntegrityError and leaves nothing behind.
    """
    repo, digest = split_repository_digest(repository_digest)
    ids.parse_digest(expected_image_id, what="expected capsule image id")
    if layout == "oci-layout":
        if oci_root is None:
            raise ColdSnapError("pulling an OCI-layout capsule needs oci_root", fix="pass <state_root>/capsules")
        return _pull_oci(repo, digest, Path(oci_root), expected_image_id, auth=auth, unit=unit, insecure=insecure,
                         progress=progress, repository_digest=repository_digest)
    if layout != "docker":
        raise ColdSnapError(f"capsule layout {layout!r} is unknown", fix="use 'docker' or 'oci-layout'")
    return _pull_docker(repository_digest, expected_image_id, auth=auth, unit=unit, client=client,
                        progress=progress)


def _pull_docker(repository_digest: str, expected_image_id: str, *, auth: dict[str, Any] | None,
                 unit: str | None, client: Any, progress: Progress | None) -> CapsuleRef:
    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import dockerapi

    docker = dockerapi.docker_module()
    client = dockerapi.docker_client(client)
    repo, digest = repository_digest.split("@", 1)
    had_before = _docker_has(client, expected_image_id)
    error = None
    try:
        for ev in client.api.pull(repo, tag=digest, stream=True, decode=True, auth_config=_docker_auth(auth)):
            if progress is not None:
                progress({"unit": unit, "status": ev.get("status"), "id": ev.get("id")})
            if "error" in ev or "errorDetail" in ev:
                error = str(ev.get("error") or (ev.get("errorDetail") or {}).get("message"))
    except docker.errors.APIError as exc:
        error = str(exc.explanation or exc)
    if error:
        raise IntegrityError(f"pull of capsule {repository_digest} failed: {error}", fix=_pull_fix(error, repo))
    try:
        image = client.images.get(repository_digest)
    except docker.errors.ImageNotFound:
        raise IntegrityError(f"pull of capsule {repository_digest} reported success but no image is present",
                             fix="check the Docker daemon") from None
    if image.id != expected_image_id:
        if not had_before:
            # Leave nothing cached: the registry served a different (self-consistent) image.
            try:
                client.images.remove(image.id, force=True)
            except docker.errors.APIError:
                pass
        raise IntegrityError(f"capsule {repository_digest} is image {image.id}, the descriptor records "
                             f"{expected_image_id}",
                             fix="the descriptor and the registry disagree; re-publish the capture")
    labels = dockerapi.image_labels(image)
    if labels.get(LABEL_KIND) != "capsule" or (unit is not None and labels.get(LABEL_UNIT) != unit):
        raise IntegrityError(f"image {repository_digest} is not the capsule of unit {unit!r}",
                             fix="pull only the capsule assigned to this unit")
    bytes_ = int(image.attrs.get("Size") or 0)
    return CapsuleRef(labels.get(LABEL_UNIT, unit or ""), "docker", image.id, repository_digest, bytes_,
                      repository_digest)


def _pull_fix(error: str, repository: str) -> str:
    """What to do about a pull the daemon refused, from its reason."""
    said = error.lower()
    if any(word in said for word in ("no basic auth credentials", "unauthorized", "denied", "authentication required")):
        return (f"give the registry's credentials for {repository} (coldsnap_registry_username, and "
                "--secret-env coldsnap_registry_password or coldsnap_registry_token); nothing was cached")
    if "manifest unknown" in said or "not found" in said:
        return (f"the capsule is no longer in {repository}: publish the capture again from its capture host "
                "(coldsnap publish), or restore on that host; nothing was cached")
    return "the registry is unreachable or returned bytes that do not match their digest; nothing was cached"


def _docker_has(client: Any, image_id: str) -> bool:
    try:
        client.images.get(image_id)
        return True
    except Exception:
        return False


def _pull_oci(repo: str, digest: str, root: Path, image_id: str, *, auth: dict[str, Any] | None, unit: str | None,
              insecure: bool | None, progress: Progress | None, repository_digest: str) -> CapsuleRef:
    """Pull the wire manifest ``digest`` and land the local capsule ``image_id`` (the same digest when the
    layers travelled uncompressed; rebuilt from gzip layers and checked otherwise)."""
    root = Path(os.path.abspath(root))
    what = f"capsule {repository_digest}"
    final = oci.layout_dir(root, image_id)
    if os.path.lexists(final):
        with oci.layout_lock(root, image_id):
            img = _cached_layout(final, image_id, what=what)
        if img is not None:
            return _oci_ref(img, final, unit, repository_digest)
    reg = RegistryClient(repo, auth=auth, insecure=insecure)
    mbytes = reg.get_manifest(digest, MANIFEST_ACCEPT, what=what)
    if oci.digest_bytes(mbytes) != digest:
        raise IntegrityError(f"registry returned a manifest for {repository_digest} whose bytes hash to "
                             f"{oci.digest_bytes(mbytes)}",
                             fix="the registry (or something between) corrupts content; nothing was cached")
    try:
        manifest = json.loads(mbytes)
    except (ValueError, RecursionError) as exc:
        raise IntegrityError(f"manifest of {what} is not JSON", fix="re-publish the capture") from exc
    if not isinstance(manifest, dict):
        raise IntegrityError(f"manifest of {what} is not a JSON object", fix="re-publish the capture")
    config, layers = oci.parse_manifest(manifest, what=f"manifest of {what}", compressed_ok=True)
    compressed = any(d.media_type in oci.COMPRESSED_LAYER_TYPES for d in layers)
    if not compressed and digest != image_id:
        raise IntegrityError(f"OCI capsule {repository_digest}: the recorded id {image_id} is not its manifest digest",
                             fix="the descriptor is inconsistent; re-publish the capture")
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    remove_abandoned_layouts(root)  # what a killed pull (or build) left
    tmp, held = locked_temp_layout(root, "pull")  # private (a capsule holds process memory), locked while it runs
    try:
        _fetch_blob(reg, tmp, config, what=what, progress=progress, unit=unit)
        if compressed:
            diff_ids = (oci.load_json_blob(tmp, config, what=f"config of {what}").get("rootfs") or {}).get(
                "diff_ids")
            # Checked before any layer is fetched: the sizes a pull inflates up to are the recorded capsule's.
            mbytes, mtype = wire.rebuilt_manifest(config, diff_ids, layers, what=what), oci.MEDIA_MANIFEST
            if oci.digest_bytes(mbytes) != image_id:
                raise IntegrityError(f"{what} unpacks to capsule {oci.digest_bytes(mbytes)}, the descriptor records "
                                     f"{image_id}",
                                     fix="the descriptor and the registry disagree; re-publish the capture")
            for i, d in enumerate(layers):
                _fetch_layer(reg, tmp, d, diff_ids[i], what=f"layer {i} of {what}", progress=progress, unit=unit)
        else:
            for desc in layers:
                _fetch_blob(reg, tmp, desc, what=what, progress=progress, unit=unit)
            mtype = manifest.get("mediaType", oci.MEDIA_MANIFEST)
        oci.write_blob_bytes(tmp, mbytes, mtype)
        oci.write_layout_files(tmp, oci.Descriptor(mtype, image_id, len(mbytes)))
        img = oci.open_layout(tmp, expected_manifest=image_id, verify_layers=False, what=what)
        labels = img.labels
        if labels.get(LABEL_KIND) != "capsule" or (unit is not None and labels.get(LABEL_UNIT) != unit):
            raise IntegrityError(f"{what} is not the capsule of unit {unit!r}",
                                 fix="pull only the capsule assigned to this unit")
        with oci.layout_lock(root, image_id):
            # Another pull of the same capsule may have got there first: its layout is this one.
            if _cached_layout(final, image_id, what=what, verify_layers=False) is None:
                os.rename(tmp, final)
                fsync_dir(final.parent)
    except OSError as exc:  # the pull needs the capsule's size free below the capsule root
        raise space_error(exc, what=what, path=root) from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        os.close(held)
    img = oci.open_layout(final, expected_manifest=image_id, verify_layers=False, what=what)
    return _oci_ref(img, final, unit, repository_digest)


def _cached_layout(final: Path, digest: str, *, what: str, verify_layers: bool = True) -> oci.Image | None:
    """The layout of this capsule already in the cache, or None; a damaged one is removed (a verified pull
    replaces it). Called with the layout's lock held."""
    if not os.path.lexists(final):
        return None
    try:
        return oci.open_layout(final, expected_manifest=digest, verify_layers=verify_layers, what=what)
    except ColdSnapError:
        archive.rmtree(final)
        return None


def _fetch_blob(reg: RegistryClient, layout: Path, desc: oci.Descriptor, *, what: str,
                progress: Progress | None, unit: str | None) -> None:
    part = temp_path_for(oci.blob_dir(layout) / "blob")
    reader = reg.open_blob(desc.digest, what=f"blob {desc.digest} of {what}")
    try:
        with reader, _private_file(part) as out:
            hashing = archive.HashingReader(reader)
            while True:
                chunk = hashing.read(archive.CHUNK)
                if not chunk:
                    break
                if hashing.size > desc.size:
                    break
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        _check_wire(hashing, desc, what=f"blob {desc.digest} of {what}")
        os.replace(part, oci.blob_path(layout, desc.digest))
    finally:
        part.unlink(missing_ok=True)
    if progress:
        progress({"unit": unit, "status": "pulled", "digest": desc.digest, "bytes": desc.size})


def _private_file(path: Path) -> Any:
    """A new blob file only its owner may read (a capsule holds process memory), whatever the umask."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), "wb")


# A registry keeps the first bytes stored under a digest: a push of the same blob is taken as done.
STORED_COPY_FIX = ("run again; when the same bytes come back, the registry's stored copy is damaged and publishing "
                   "again does not replace it (a registry keeps the first bytes stored under a digest): have its "
                   "operator remove that blob from its storage, then publish the capture again; nothing was cached")


def _check_wire(hashing: archive.HashingReader, desc: oci.Descriptor, *, what: str) -> None:
    """The bytes the registry returned are the descriptor's, or the pull fails saying so."""
    if hashing.size < desc.size:
        raise IntegrityError(f"registry returned only {hashing.size} of the {desc.size} bytes of {what} "
                             f"({desc.digest}): the body ended early (a connection cut short, or a truncated "
                             "copy on the registry)", fix=STORED_COPY_FIX)
    if hashing.size != desc.size or hashing.digest != desc.digest:
        raise IntegrityError(f"registry returned {hashing.size} bytes hashing to {hashing.digest} for {what} "
                             f"({desc.digest}, {desc.size} bytes): the registry, or something between, "
                             "alters content", fix=STORED_COPY_FIX)


def _fetch_layer(reg: RegistryClient, layout: Path, desc: oci.Descriptor, diff_id: str, *, what: str,
                 progress: Progress | None, unit: str | None) -> None:
    """Download one gzip wire layer, checking the compressed bytes against ``desc`` and the decompressed
    ones against ``diff_id``; store it uncompressed under its diff id."""
    limit = wire.announced_size(desc, what=what)
    members = wire.announced_members(desc, what=what)
    part = temp_path_for(oci.blob_dir(layout) / "blob")
    reader = reg.open_blob(desc.digest, what=what)
    try:
        with reader, _private_file(part) as out:
            hashing = archive.HashingReader(_Bounded(reader, desc.size))
            try:
                got, size = wire.gunzip(hashing, out, limit=limit, what=what, members=members)
            except IntegrityError:
                hashing.drain()
                _check_wire(hashing, desc, what=what)  # wrong bytes on the wire are the first thing to say
                raise
            hashing.drain()
            out.flush()
            os.fsync(out.fileno())
        _check_wire(hashing, desc, what=what)
        if got != diff_id or size != limit:
            raise IntegrityError(f"{what} decompresses to {size} bytes hashing to {got}, the capsule's config "
                                 f"records {diff_id} ({limit} bytes)",
                                 fix="the registry holds other bytes than were published; re-publish the capture")
        os.replace(part, oci.blob_path(layout, diff_id))
    finally:
        part.unlink(missing_ok=True)
    if progress:
        progress({"unit": unit, "status": "pulled", "digest": desc.digest, "bytes": desc.size})


class _Bounded:
    """Reads at most ``limit`` bytes and one more (so an over-long body is seen, never read without end)."""

    def __init__(self, fh: Any, limit: int) -> None:
        self.fh, self.left = fh, limit + 1

    def read(self, n: int = -1) -> bytes:
        if self.left <= 0:
            return b""
        data = self.fh.read(self.left if n < 0 else min(n, self.left))
        self.left -= len(data)
        return data


def _oci_ref(img: oci.Image, final: Path, unit: str | None, repository_digest: str) -> CapsuleRef:
    return CapsuleRef(img.labels.get(LABEL_UNIT, unit or ""), "oci-layout", img.manifest_desc.digest, str(final),
                      img.bytes, repository_digest)


# ----------------------------------------------------------------------------- descriptor helpers

def local_capsules(artifact: dict[str, Any], *, host: str | None = None,
                   units: list[str] | None = None) -> list[tuple[dict[str, Any], CapsuleRef]]:
    """The artifact's capsule entries for one capture host (or the named units)."""
    out = []
    for entry in artifact["capsule"]["units"]:
        if host is not None and entry["host"] != host:
            continue
        if units is not None and entry["unit"] not in units:
            continue
        out.append((entry, CapsuleRef.from_dict(entry)))
    return out


def remote_has(repository_digest: str, *, auth: dict[str, Any] | None = None, insecure: bool | None = None) -> bool:
    """True when the registry already serves this manifest digest (publish is content-idempotent)."""
    repo, digest = split_repository_digest(repository_digest)
    try:
        return RegistryClient(repo, auth=auth, insecure=insecure).manifest_exists(digest, MANIFEST_ACCEPT)
    except RegistryError as exc:
        if exc.status == 404:  # the repository itself is unknown there: nothing published yet
            return False
        raise  # unreachable, credentials refused...: not an answer (check mode says so, as a push would)


def published_docker_capsule(ref: CapsuleRef, repository: str, *, auth: dict[str, Any] | None = None,
                             insecure: bool | None = None, client: Any = None) -> str | None:
    """``repository@<manifest digest>`` when the registry already serves this docker capsule under its
    publish tag (its manifest names the capsule's image id as config and every blob is there), else None.
    The local store keeps no repo digest for it (the publish tag is removed after a push), so this is how
    a second publish finds the first one instead of pushing again."""
    return _published_under_tag(ref, repository, publish_tag(ref, capture_id_of(ref, client=client)),
                                expected_config=ref.image_id, auth=auth, insecure=insecure)


def published_oci_capsule(ref: CapsuleRef, repository: str, *, auth: dict[str, Any] | None = None,
                          insecure: bool | None = None) -> str | None:
    """``repository@<manifest digest>`` when the registry already serves this OCI capsule: uncompressed
    under its own manifest digest, or with gzip layers under its publish tag (a manifest naming this
    capsule id, over the same config, every blob there); else None."""
    plain = f"{repository}@{ref.image_id}"
    if remote_has(plain, auth=auth, insecure=insecure):
        return plain
    img = oci.open_layout(Path(ref.location), expected_manifest=ref.image_id, verify_layers=False,
                          what=f"capsule of unit {ref.unit!r}")
    diff_ids = (img.config.get("rootfs") or {}).get("diff_ids")

    def is_this_capsule(manifest: dict[str, Any]) -> bool:
        # The manifest under the (mutable) tag must name this capsule and rebuild it: same layer count, gzip,
        # the announced sizes the capsule's own; a pull of it lands exactly this capsule.
        named = manifest.get("annotations") or {}
        if not isinstance(named, dict) or named.get(wire.ANN_IMAGE_ID) != ref.image_id:
            return False
        config, layers = oci.parse_manifest(manifest, what=f"capsule of unit {ref.unit!r}", compressed_ok=True)
        rebuilt = wire.rebuilt_manifest(config, diff_ids, layers, what=f"capsule of unit {ref.unit!r}")
        return oci.digest_bytes(rebuilt) == ref.image_id

    return _published_under_tag(ref, repository, publish_tag(ref, img.labels.get(LABEL_CAPTURE)),
                                expected_config=img.config_desc.digest, check=is_this_capsule, auth=auth,
                                insecure=insecure)


def _published_under_tag(ref: CapsuleRef, repository: str, tag: str, *, expected_config: str,
                         check: Callable[[dict[str, Any]], bool] | None = None, auth: dict[str, Any] | None,
                         insecure: bool | None) -> str | None:
    what = f"capsule of unit {ref.unit!r}"
    try:
        data = RegistryClient(repository, auth=auth, insecure=insecure).get_manifest(tag, MANIFEST_ACCEPT, what=what)
        digest = oci.digest_bytes(data)
        manifest = json.loads(data)
        if check is not None and not (isinstance(manifest, dict) and check(manifest)):
            return None  # another capsule (or not one a pull rebuilds) under this tag: push this one
        _verify_remote_manifest(repository, digest, auth=auth, what=what, expected_config=expected_config,
                                insecure=insecure)
    except RegistryError as exc:
        if exc.status != 404:
            raise  # unreachable, credentials refused...: no answer to "is it there?"
        return None  # not there: push it
    except (PublishError, IntegrityError, ValueError, AttributeError):
        return None  # not this capsule (or incomplete): push it
    return f"{repository}@{digest}"


def capture_id_of(ref: CapsuleRef, client: Any = None) -> str | None:
    """The capture id a local capsule is labelled with."""
    return inspect_capsule(ref, verify=False, client=client)["labels"].get(LABEL_CAPTURE)
