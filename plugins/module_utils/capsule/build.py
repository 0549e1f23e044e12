"""Per-unit capsules: build, inspect and (for runtime ``host``) materialize them.

A capsule is one unit's captured state as an OCI image: the CRIU image
directory, the residual ``weights.blob``, ``native-manifest.json``,
``replay-plan.json`` and logs at the state target path, plus the declared
derived-cache directories at their own absolute paths. It never holds a model
pack (``*.pack``), a Hugging Face cache or a model mount: those are refused or
left out here, whoever calls.

Two layouts, one content:

* ``docker``: a local image built with the Docker SDK ``FROM`` the exact
  digest-pinned runtime image; its id (``sha256:<config digest>``) is the
  capsule id.
* ``oci-layout``: for hosts without Docker, an OCI image layout on disk (one
  uncompressed layer tar of the state, a config, a manifest) written with the
  standard library; the manifest digest is the capsule id. Layouts live at
  ``<oci_root>/sha256/<manifest hex>/``.

Capture never pushes; :mod:`.publish` does that explicitly later.

Why one ~650-line unit: building, inspecting and extracting a capsule are one contract
(labels, state target, layer shape) over two layouts (Docker image, OCI layout); keeping
them together keeps what a build writes and what an extraction trusts side by side.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import hashlib
import json
import os
import platform
import posixpath
import shutil
import tarfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import archive, oci
from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.archive import ArchiveError, LayerEntry
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
    space_error,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import (
    TEMP_MARKER,
    exclusive_commit,
    first_link_below,
    fsync_dir,
    fsync_file,
    is_temp_name,
    planted_by_another,
    temp_path_for,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import identifiers as ids
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.canonical import canonical_sha256
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.capsule_labels import (
    CAPSULE_LAYOUTS,
    LABEL_BASE,
    LABEL_CACHE_PATHS,
    LABEL_CAPTURE,
    LABEL_FORMAT,
    LABEL_KIND,
    LABEL_STATE_TARGET,
    LABEL_UNIT,
    RESERVED_LABELS,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.capsule_paths import (
    NO_HOST_CACHE_UNDER,
    cache_path_problems,
    check_capsule_paths,
    looks_like_hf_cache,
    paths_overlap,
)

CAPSULE_FORMAT = "1"
LAYOUTS = CAPSULE_LAYOUTS

# Never inside a capsule: model packs and their validation records (model bytes travel as payloads).
EXCLUDED_PATTERNS = ("*.pack", "*.pack.coldsnap-validation.json", "*.pack.part", ".coldsnap-state-validation.json")
# A derived cache holding these is model data, not a cache seed.
MODEL_FILE_PATTERNS = ("*.safetensors", "*.pack", "*.bin.index.json", "*.safetensors.index.json")
# Whole system trees a capsule must never overlay.


@dataclass(frozen=True)
class CapsuleRef:
    """Where one unit's capsule is and what it is.

    ``image_id`` is the docker image id or the OCI manifest digest (both
    ``sha256:<hex>``); ``location`` the local image name or the OCI layout
    directory; ``bytes`` the capsule's own bytes (docker: the layers above the
    base; OCI: manifest + config + layer); ``repository_digest`` the immutable
    ``repo@sha256:<manifest digest>`` once published.
    """

    unit: str
    layout: str
    image_id: str
    location: str
    bytes: int
    repository_digest: str | None = None

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ColdSnapError(f"capsule of unit {self.unit!r} has unknown layout {self.layout!r}",
                                fix=f"use one of {', '.join(LAYOUTS)}")
        ids.parse_digest(self.image_id, what=f"capsule image id of unit {self.unit!r}")

    def as_dict(self) -> dict[str, Any]:
        """The artifact's ``capsule.units[]`` entry (without ``host``, which the caller knows)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CapsuleRef:
        """From an artifact ``capsule.units[]`` entry (extra keys such as ``host`` are ignored).

        A malformed entry is a ColdSnapError naming the field (``what`` below), never a KeyError."""
        what = f"capsule entry {d.get('unit')!r}" if isinstance(d, dict) else "capsule entry"
        if not isinstance(d, dict):
            raise ColdSnapError(f"{what} is {type(d).__name__}, not an object", fix=_ENTRY_FIX)
        for key in ("unit", "layout", "image_id", "location"):
            if not isinstance(d.get(key), str) or not d[key]:
                raise ColdSnapError(f"{what}: '{key}' is {'missing' if key not in d else repr(d[key])}, "
                                    f"it must be a non-empty string", fix=_ENTRY_FIX)
        size = d.get("bytes", 0)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ColdSnapError(f"{what}: bytes {size!r} is not a byte count", fix=_ENTRY_FIX)
        digest = d.get("repository_digest")
        if digest is not None and not isinstance(digest, str):
            raise ColdSnapError(f"{what}: repository_digest {digest!r} is not a string", fix=_ENTRY_FIX)
        return cls(unit=d["unit"], layout=d["layout"], image_id=d["image_id"], location=d["location"],
                   bytes=size, repository_digest=digest)


_ENTRY_FIX = "pass the artifact's capsule.units entries (unit, layout, image_id, location, bytes) unchanged"


@dataclass(frozen=True)
class CapsuleBuild:
    """The outcome of a build: the capsule (None in a dry run that would build a docker image), whether
    anything was created, what was left out on purpose, the cache paths that were absent, and the build key."""

    ref: CapsuleRef | None
    changed: bool
    excluded: tuple[str, ...] = ()
    absent_caches: tuple[str, ...] = ()
    build_key: str = ""
    dry_run: bool = False
    labels: dict[str, str] = field(default_factory=dict)


def _excluded(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return is_temp_name(name) or any(fnmatch.fnmatch(name, pat) for pat in EXCLUDED_PATTERNS)


def _refuse_model_files(entries: list[LayerEntry], *, what: str) -> None:
    for e in entries:
        name = e.arcname.rsplit("/", 1)[-1]
        if any(fnmatch.fnmatch(name, pat) for pat in MODEL_FILE_PATTERNS) or name.startswith("models--"):
            raise ColdSnapError(f"{what} holds {e.source} ({name}), which is model data",
                                fix="capsules carry process state and derived caches only; model weights travel "
                                    "as payloads or pinned safetensors")


def gather_inputs(files: dict[str, Path] | Path, state_target: str, cache_paths: list[str],
                  cache_sources: dict[str, Path] | None
                  ) -> tuple[list[tuple[str, list[LayerEntry]]], list[str], list[str]]:
    """The capsule's input trees: ([(root, entries) for the state, then each present cache], excluded,
    absent caches). Roots and entry names are layer paths relative to ``/``.
    """
    state_prefix = state_target.lstrip("/")
    excluded: list[str] = []
    if isinstance(files, dict):
        state: list[LayerEntry] = [LayerEntry(state_prefix, None)]
        for rel, src in sorted(files.items()):
            rel_n = archive.normalize_member_name(rel, what="capsule state file name")
            if _excluded(rel_n):
                raise ColdSnapError(f"capsule state file {rel!r} ({src}) is a model pack or temporary file",
                                    fix="model packs never enter a capsule; remove it from the declared files")
            path = Path(src)
            if path.is_symlink() or not path.exists():
                raise ColdSnapError(f"capsule state file {rel!r}: {path} is missing or a symlink",
                                    fix="give the real file or directory")
            if path.is_dir():
                sub, ex = archive.collect_tree(path, f"{state_prefix}/{rel_n}", exclude=_excluded,
                                               what=f"state directory {rel!r}")
                state += sub
                excluded += [f"{rel_n}/{x}" for x in ex]
            elif path.is_file():
                state.append(LayerEntry(f"{state_prefix}/{rel_n}", path))
            else:
                raise ArchiveError(f"capsule state file {rel!r}: {path} is a special file",
                                   fix="remove device nodes, FIFOs and sockets from the state")
    else:
        state, excluded = archive.collect_tree(Path(files), state_prefix, exclude=_excluded,
                                               what="capsule state directory")
    _refuse_model_files(state, what="the capsule state")
    trees = [(state_prefix, state)]
    absent: list[str] = []
    sources = {k.rstrip("/") or "/": Path(v) for k, v in (cache_sources or {}).items()}
    for cpath in cache_paths:
        src = sources.get(cpath, Path(cpath))
        if not src.exists():
            absent.append(cpath)
            continue
        entries, ex = archive.collect_tree(src, cpath.lstrip("/"), exclude=_excluded, what=f"cache directory {cpath}")
        _refuse_model_files(entries, what=f"cache directory {cpath}")
        if any(looks_like_hf_cache(e.arcname) for e in entries):
            raise ColdSnapError(f"cache directory {cpath} ({src}) contains a Hugging Face cache tree",
                                fix="remove it from policy.cache.paths; model bytes never enter a capsule")
        excluded += [f"{cpath}/{x}" for x in ex]
        trees.append((cpath.lstrip("/"), entries))
    return trees, sorted(excluded), absent


def capsule_labels(*, unit: str, capture_id: str, state_target: str, cache_paths: list[str],
                   labels: dict[str, str]) -> dict[str, str]:
    """The caller's labels plus ColdSnap's own (which the caller may not override)."""
    for key in labels:
        if key in RESERVED_LABELS:
            raise ColdSnapError(f"capsule label {key!r} is reserved", fix="drop it; build_capsule sets it")
    out = {str(k): str(v) for k, v in labels.items()}
    out.update({LABEL_KIND: "capsule", LABEL_FORMAT: CAPSULE_FORMAT, LABEL_UNIT: unit, LABEL_CAPTURE: capture_id,
                LABEL_STATE_TARGET: state_target, LABEL_CACHE_PATHS: json.dumps(cache_paths)})
    return out


def docker_capsule_name(unit: str, capture_id: str) -> str:
    """The local image name of a docker capsule: ``coldsnap-capsule/<unit>:<capture id>``.

    A repository name is lower case: a unit id that does not pass unchanged (``Web``, ``a--b``) gets a
    short hash of itself, so units ``Web`` and ``web`` of one capture never share a name (the later
    build would take it from the earlier one's image, left without a name for ``docker image prune``)."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.dockerapi import (
        sanitize_repo_component,
        sanitize_tag,
    )

    component = sanitize_repo_component(unit)
    if component != unit:
        component += "-" + hashlib.sha256(unit.encode("utf-8", "surrogateescape")).hexdigest()[:12]
    return f"coldsnap-capsule/{component}:{sanitize_tag(capture_id)}"


def _goarch() -> str:
    m = platform.machine().lower()
    return {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64", "ppc64le": "ppc64le",
            "s390x": "s390x"}.get(m, m)


# ----------------------------------------------------------------------------- build

def build_capsule(*, unit: str, capture_id: str, files: dict[str, Path] | Path, state_target: str,
                  cache_paths: list[str], forbidden_paths: list[str], layout: str, base_image: str | None,
                  oci_root: Path | None, labels: dict[str, str], cache_sources: dict[str, Path] | None = None,
                  client: Any = None) -> CapsuleRef:
    """Build one unit's capsule and return it (see :func:`build_capsule_detailed`)."""
    result = build_capsule_detailed(unit=unit, capture_id=capture_id, files=files, state_target=state_target,
                                    cache_paths=cache_paths, forbidden_paths=forbidden_paths, layout=layout,
                                    base_image=base_image, oci_root=oci_root, labels=labels,
                                    cache_sources=cache_sources, client=client)
    if result.ref is None:
        raise AssertionError(f"capsule build of unit {unit!r} returned no reference")
    return result.ref


def build_capsule_detailed(*, unit: str, capture_id: str, files: dict[str, Path] | Path, state_target: str,
                           cache_paths: list[str], forbidden_paths: list[str], layout: str,
                           base_image: str | None, oci_root: Path | None, labels: dict[str, str],
                           cache_sources: dict[str, Path] | None = None, dry_run: bool = False,
                           client: Any = None) -> CapsuleBuild:
    """Build (or find already built) one unit's capsule.

    ``files`` is the unit's state directory on the host (placed at
    ``state_target``) or an explicit ``{relative name: host path}`` mapping.
    ``cache_paths`` are the declared derived-cache directories (absolute paths
    inside the unit); their bytes come from ``cache_sources[path]`` or, by
    default, the same path on this host; an absent one is reported, not an
    error. ``forbidden_paths`` are the request's mount targets. ``dry_run``
    changes nothing and says whether a build would happen.
    """
    if layout not in LAYOUTS:
        raise ColdSnapError(f"capsule layout {layout!r} is unknown", fix=f"use one of {', '.join(LAYOUTS)}")
    if not capture_id or not unit:
        raise ColdSnapError("a capsule needs its unit id and capture id", fix="pass unit= and capture_id=")
    state, caches = check_capsule_paths(state_target, cache_paths, forbidden_paths)
    if isinstance(files, (str, Path)) and not Path(files).is_dir():
        raise ColdSnapError(f"unit {unit!r}: state directory {files} "
                            f"{'is not a directory' if Path(files).exists() else 'does not exist'}",
                            fix="capture the unit first (unit_capture writes it), or pass its state_dir")
    trees, excluded, absent = gather_inputs(files, state, caches, cache_sources)
    present = [c for c in caches if c not in absent]
    all_labels = capsule_labels(unit=unit, capture_id=capture_id, state_target=state, cache_paths=present,
                                labels=labels)
    if layout == "oci-layout":
        if oci_root is None:
            raise ColdSnapError(f"OCI-layout capsule of unit {unit!r} needs oci_root",
                                fix="pass the directory that holds OCI capsules, e.g. <state_root>/capsules")
        return _build_oci(unit=unit, trees=trees, labels=all_labels, root=Path(oci_root), excluded=excluded,
                          absent=absent, dry_run=dry_run)
    if not base_image:
        raise ColdSnapError(f"docker capsule of unit {unit!r} needs the digest-pinned runtime image as its base",
                            fix="pass base_image='name@sha256:<hex>' (the unit's launch image)")
    return _build_docker(unit=unit, capture_id=capture_id, trees=trees, labels=all_labels, base_image=base_image,
                         excluded=excluded, absent=absent, dry_run=dry_run, client=client)


def _build_oci(*, unit: str, trees: list[tuple[str, list[LayerEntry]]], labels: dict[str, str], root: Path,
               excluded: list[str], absent: list[str], dry_run: bool) -> CapsuleBuild:
    entries = [e for _name, tree in trees for e in tree]
    key = canonical_sha256({"format": CAPSULE_FORMAT, "labels": labels, "entries": archive.entry_fingerprint(entries)})

    def finish(layer: oci.Descriptor) -> tuple[bytes, bytes]:
        config = {"architecture": _goarch(), "os": "linux", "config": {"Labels": labels},
                  "rootfs": {"type": "layers", "diff_ids": [layer.digest]}}
        cbytes = oci.json_bytes(config)
        manifest = oci.image_manifest(oci.Descriptor(oci.MEDIA_CONFIG, oci.digest_bytes(cbytes), len(cbytes)),
                                      [layer])
        return cbytes, oci.json_bytes(manifest)

    root = Path(os.path.abspath(root))
    if dry_run:
        digest, size = archive.write_layer(entries, None)
        cbytes, mbytes = finish(oci.Descriptor(oci.MEDIA_LAYER_TAR, digest, size))
        mdigest = oci.digest_bytes(mbytes)
        final = oci.layout_dir(root, mdigest)
        ref = CapsuleRef(unit, "oci-layout", mdigest, str(final), len(mbytes) + len(cbytes) + size)
        return CapsuleBuild(ref, not _layout_intact(final, mdigest), tuple(excluded), tuple(absent), key, True,
                            labels)

    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    remove_abandoned_layouts(root)
    tmp, held = locked_temp_layout(root, "capsule")
    try:
        try:
            layer = oci.write_blob_stream(tmp, oci.MEDIA_LAYER_TAR, lambda out: archive.write_layer(entries, out))
        except OSError as exc:
            raise space_error(exc, what=f"the capsule of unit {unit!r}", path=root) from None
        cbytes, mbytes = finish(layer)
        oci.write_blob_bytes(tmp, cbytes, oci.MEDIA_CONFIG)
        mdesc = oci.write_blob_bytes(tmp, mbytes, oci.MEDIA_MANIFEST)
        mdesc = oci.Descriptor(oci.MEDIA_MANIFEST, mdesc.digest, mdesc.size,
                               {oci.REF_NAME: f"{labels[LABEL_CAPTURE]}.{unit}"})
        oci.write_layout_files(tmp, mdesc)
        with oci.layout_lock(root, mdesc.digest) as final:
            # A build of the same capsule that got here first left this very layout: nothing to do.
            changed = not _layout_intact(final, mdesc.digest)
            if changed:
                if os.path.lexists(final):
                    archive.rmtree(final)  # a damaged copy under the final name: replaced by the fresh build
                os.rename(tmp, final)
                fsync_dir(final.parent)
    finally:
        archive.rmtree(tmp)
        os.close(held)
    ref = CapsuleRef(unit, "oci-layout", mdesc.digest, str(final), len(mbytes) + len(cbytes) + layer.size)
    return CapsuleBuild(ref, changed, tuple(excluded), tuple(absent), key, False, labels)


LAYOUT_TEMP_STEMS = ("capsule", "pull")  # the temporary layouts of builds and of pulls below a capsule root


def locked_temp_layout(root: Path, stem: str) -> tuple[Path, int]:
    """A new private temporary directory below ``root`` for a build or a pull (``stem``), and the descriptor
    that holds its lock until the caller closes it: :func:`remove_abandoned_layouts` removes it only once its
    writer is gone (killed), never under a live one."""
    tmp = temp_path_for(root / stem)
    # Made under a name the clean-up does not match, locked, then renamed: a build or pull that cleans up
    # at the same moment never takes this one for abandoned between its mkdir and its lock.
    pending = tmp.with_name(tmp.name.replace(TEMP_MARKER, ".new-", 1))
    os.mkdir(pending, 0o700)  # a capsule holds process memory: private, like its blobs
    held = os.open(pending, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        os.rename(pending, tmp)
    except BaseException:
        os.close(held)
        archive.rmtree(pending)
        raise
    return tmp, held


def remove_abandoned_layouts(root: Path) -> None:
    """Remove the temporary layouts of builds and pulls that were killed (their writer no longer holds the
    lock): a pull cut short by ``kill -9`` would otherwise keep its partial layers for ever."""
    prefixes = tuple(temp_path_for(root / stem).name.rsplit(TEMP_MARKER, 1)[0] + TEMP_MARKER
                     for stem in LAYOUT_TEMP_STEMS)
    for entry in os.scandir(root):
        if not entry.name.startswith(prefixes) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live build
        finally:
            os.close(fd)
        archive.rmtree(Path(entry.path))


def _layout_intact(final: Path, manifest_digest: str) -> bool:
    """An OCI layout of this manifest is already there and reads back whole (a build has nothing to do)."""
    if not final.exists():
        return False
    try:
        oci.open_layout(final, expected_manifest=manifest_digest)
    except ColdSnapError:
        return False
    return True


def _build_docker(*, unit: str, capture_id: str, trees: list[tuple[str, list[LayerEntry]]], labels: dict[str, str],
                  base_image: str, excluded: list[str], absent: list[str], dry_run: bool,
                  client: Any) -> CapsuleBuild:
    """A docker capsule: the base's layers plus one state layer, loaded as an image archive.

    The image is assembled here rather than with ``docker build``: its layer is
    the same deterministic tar an OCI capsule gets (the builder's COPY would
    chown every file and so drop set-user-ID bits), its config is derived from
    the base's, and so the image id is a pure function of the inputs: an
    unchanged rebuild finds the image already present. Base layers are never
    re-sent; the daemon has them.
    """
    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import dockerapi

    client = dockerapi.docker_client(client)
    base = dockerapi.resolve_image(client, base_image, what=f"capsule base image of unit {unit!r}")
    name = docker_capsule_name(unit, capture_id)
    entries = [e for _name, tree in trees for e in tree]
    # An upper layer's directory entry shadows the base's: parents are written with the base's own metadata.
    names = {e.arcname for e in entries}
    entries += _base_parent_dirs(client, base, [d for d in archive.parent_dirs(names) if d not in names], unit=unit)
    key = canonical_sha256({"format": CAPSULE_FORMAT, "base": base.id, "labels": labels,
                            "entries": archive.entry_fingerprint(entries)})
    labels = {**labels, LABEL_BASE: base.id}
    layer_digest, layer_size = archive.write_layer(entries, None)
    config_bytes = oci.json_bytes(_docker_config(base, labels, layer_digest, entries))
    image_id = oci.digest_bytes(config_bytes)
    ref = CapsuleRef(unit, "docker", image_id, name, layer_size)
    try:
        present = client.images.get(image_id)
    except Exception as exc:
        if not dockerapi.is_not_found(exc):
            raise
        present = None
    if present is not None:
        if not dry_run and name not in present.tags:
            present.tag(name)
        return CapsuleBuild(ref, False, tuple(excluded), tuple(absent), key, dry_run, labels)
    if dry_run:
        return CapsuleBuild(ref, True, tuple(excluded), tuple(absent), key, True, labels)

    base_layers = list((base.attrs.get("RootFS") or {}).get("Layers") or [])
    layer_name = f"{layer_digest.split(':', 1)[1]}/layer.tar"
    manifest = [{"Config": f"{image_id.split(':', 1)[1]}.json", "RepoTags": [name],
                 "Layers": [f"{d.split(':', 1)[1]}/layer.tar" for d in base_layers] + [layer_name]}]
    written: dict[str, Any] = {}

    def write_archive(tar: Any) -> None:
        # docker load unpacks the whole archive before reading manifest.json, so member order is free; the
        # base layers' files are omitted on purpose (the daemon has those layers and does not read them).
        info = tarfile.TarInfo(layer_name)
        info.size = layer_size
        info.mode = 0o644
        tar.addfile(info, _LayerStream(entries, written))
        dockerapi.add_bytes(tar, manifest[0]["Config"], config_bytes)
        dockerapi.add_bytes(tar, "manifest.json", json.dumps(manifest).encode())

    dockerapi.stream_load(client, write_archive, what=f"capsule of unit {unit!r}")
    if written.get("digest") != layer_digest:
        raise ColdSnapError(f"the state of unit {unit!r} changed while its capsule was built",
                            fix="build the capsule only after the captured process has stopped")
    loaded = client.images.get(image_id)
    if loaded.id != image_id:
        raise IntegrityError(f"docker loaded capsule of unit {unit!r} as {loaded.id}, expected {image_id}",
                             fix="check the Docker daemon")
    return CapsuleBuild(ref, True, tuple(excluded), tuple(absent), key, False, labels)


GO_MODE_DIR, GO_MODE_SYMLINK = 1 << 31, 1 << 27
GO_MODE_SETUID, GO_MODE_SETGID, GO_MODE_STICKY = 1 << 23, 1 << 22, 1 << 20


def _base_parent_dirs(client: Any, base: Any, parents: list[str], *, unit: str) -> list[LayerEntry]:
    """Directory entries for ``parents`` carrying the base image's mode and mtime (0755/epoch when absent).

    A parent that is a symlink in the base (``/var/run`` -> ``/run``) is refused:
    a directory entry would replace the link and break the image.
    """
    if not parents:
        return []
    import base64
    import calendar

    cid = client.api.create_container(base.id, ["true"], network_disabled=True,
                                      labels={LABEL_KIND: "capsule-probe"})["Id"]
    out: list[LayerEntry] = []
    try:
        for rel in sorted(parents):
            resp = client.api.head(client.api._url("/containers/{0}/archive", cid), params={"path": "/" + rel})
            if resp.status_code == 404:
                out.append(LayerEntry(rel, None))
                continue
            header = resp.headers.get("X-Docker-Container-Path-Stat")
            if resp.status_code != 200 or not header:
                raise ColdSnapError(f"cannot stat /{rel} in the base image of unit {unit!r} "
                                    f"(HTTP {resp.status_code})", fix="check the Docker daemon")
            st = json.loads(base64.b64decode(header))
            mode = int(st.get("mode", 0))
            if st.get("linkTarget") or mode & GO_MODE_SYMLINK or not mode & GO_MODE_DIR:
                raise ColdSnapError(f"/{rel} is not a directory in the base image of unit {unit!r} "
                                    f"(it is {'a link to ' + st['linkTarget'] if st.get('linkTarget') else 'a file'})",
                                    fix="give the state target and cache paths by their real directory path")
            perm = mode & 0o777
            perm |= (0o4000 if mode & GO_MODE_SETUID else 0) | (0o2000 if mode & GO_MODE_SETGID else 0)
            perm |= 0o1000 if mode & GO_MODE_STICKY else 0
            mtime = 0
            stamp = str(st.get("mtime", ""))[:19]
            if stamp:
                try:
                    mtime = calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))
                except ValueError:
                    mtime = 0
            out.append(LayerEntry(rel, None, perm, mtime))
    finally:
        client.api.remove_container(cid, force=True)
    return out


def _docker_config(base: Any, labels: dict[str, str], layer_digest: str,
                   entries: list[LayerEntry]) -> dict[str, Any]:
    """The capsule's image config: the base's runtime settings, merged labels, one more layer."""
    attrs = base.attrs
    src = attrs.get("Config") or {}
    config = {k: src[k] for k in ("User", "ExposedPorts", "Env", "Entrypoint", "Cmd", "Volumes", "WorkingDir",
                                  "StopSignal") if src.get(k) not in (None, "", [], {})}
    config["Labels"] = {**(src.get("Labels") or {}), **labels}
    # A deterministic creation time (the newest input), so equal inputs give an equal image id.
    newest = max((int(os.lstat(e.source).st_mtime) for e in entries if e.source is not None), default=0)
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(newest))
    return {"architecture": attrs.get("Architecture") or _goarch(), "os": attrs.get("Os") or "linux",
            "created": created, "config": config,
            "rootfs": {"type": "layers", "diff_ids": [*((attrs.get("RootFS") or {}).get("Layers") or []),
                                                      layer_digest]}}


class _LayerStream:
    """The layer tar produced on demand as tarfile reads it (a pipe-free, one-pass file object)."""

    def __init__(self, entries: list[LayerEntry], result: dict[str, Any]) -> None:
        import queue
        import threading

        self._q: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=16)
        self._buf = b""
        self._done = False
        self._result = result

        def produce() -> None:
            try:
                result["digest"], result["size"] = archive.write_layer(entries, _QueueSink(self._q))
                self._q.put(None)
            except BaseException as exc:
                self._q.put(exc)

        self._thread = threading.Thread(target=produce, name="coldsnap-capsule-layer", daemon=True)
        self._thread.start()

    def read(self, n: int = -1) -> bytes:
        while not self._done and (n < 0 or len(self._buf) < n):
            item = self._q.get()
            if item is None:
                self._done = True
            elif isinstance(item, BaseException):
                self._done = True
                raise item
            else:
                self._buf += item
        if n < 0:
            data, self._buf = self._buf, b""
        else:
            data, self._buf = self._buf[:n], self._buf[n:]
        return data


class _QueueSink:
    def __init__(self, q: Any) -> None:
        self._q = q

    def write(self, data: bytes) -> int:
        # Bounded wait: if the daemon stopped reading, the producer gives up instead of hanging forever.
        self._q.put(bytes(data), timeout=600)
        return len(data)

    def flush(self) -> None:
        pass


# ----------------------------------------------------------------------------- inspect / extract

def inspect_capsule(ref: CapsuleRef | dict, *, verify: bool = True, client: Any = None) -> dict[str, Any]:
    """Describe a local capsule and check it is the one recorded (image id / manifest digest).

    Raises IntegrityError when the local object differs from ``ref`` and
    ColdSnapError when it is absent. ``verify`` re-hashes OCI layers.
    """
    if isinstance(ref, dict):
        ref = CapsuleRef.from_dict(ref)
    if ref.layout == "oci-layout":
        img = oci.open_layout(Path(ref.location), expected_manifest=ref.image_id, verify_layers=verify,
                              what=f"capsule of unit {ref.unit!r}")
        labels = img.labels
        info = {"layers": [d.digest for d in img.layers], "config_digest": img.config_desc.digest,
                "bytes": img.bytes, "repo_digests": []}
    else:
        from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import dockerapi

        client = dockerapi.docker_client(client)
        try:
            image = client.images.get(ref.image_id)
        except Exception as exc:
            if dockerapi.is_not_found(exc):
                raise ColdSnapError(f"capsule image {ref.image_id} of unit {ref.unit!r} is not in the local "
                                    "Docker image store",
                                    fix="run on the capture host, or pull the published capsule by digest") from None
            raise
        if image.id != ref.image_id:
            raise IntegrityError(f"capsule of unit {ref.unit!r}: local image is {image.id}, recorded {ref.image_id}",
                                 fix="the local image store does not hold the recorded capsule; re-pull it")
        labels = dockerapi.image_labels(image)
        info = {"layers": list((image.attrs.get("RootFS") or {}).get("Layers") or []), "config_digest": image.id,
                "bytes": ref.bytes, "repo_digests": list(image.attrs.get("RepoDigests") or []),
                "tags": list(image.tags)}
    if labels.get(LABEL_KIND) != "capsule" or labels.get(LABEL_UNIT) != ref.unit:
        raise IntegrityError(f"capsule {ref.image_id} is labelled for unit {labels.get(LABEL_UNIT)!r}, "
                             f"recorded for {ref.unit!r}",
                             fix="the descriptor and the capsule disagree; rebuild or re-publish the capture")
    try:
        cache_paths = json.loads(labels.get(LABEL_CACHE_PATHS, "[]"))
    except ValueError:
        cache_paths = []
    return {"unit": ref.unit, "layout": ref.layout, "image_id": ref.image_id, "location": ref.location,
            "capture_id": labels.get(LABEL_CAPTURE), "state_target": labels.get(LABEL_STATE_TARGET),
            "cache_paths": cache_paths, "labels": labels, "verified": bool(verify or ref.layout == "docker"),
            **info}


def extract_capsule(ref: CapsuleRef | dict, dest: Path, *, part: str = "state", replace: bool = False,
                    client: Any = None, digests: dict[str, str] | None = None,
                    caches_to: tuple[list[str], Path] | None = None) -> list[str]:
    """Materialize a capsule's files on this host (runtime ``host`` restore), safely.

    ``part='state'`` writes the state directory's contents into ``dest``;
    ``part='all'`` writes the whole layer (state and caches at their absolute
    paths) below ``dest`` (OCI layouts only; a docker capsule's state is copied
    out of a created, never started, container). The layer's digest is checked while it streams and
    every member is checked before it is written (FAULTS.md 10): a bad capsule
    leaves ``dest`` untouched. Returns the names written below ``dest``; ``digests`` (optional)
    receives each written file's SHA-256 (:func:`archive.safe_extract`). ``caches_to`` (cache paths,
    scratch; OCI, part 'state'): the files of those derived caches come out in the same pass over the
    layer, below the scratch directory at their absolute paths, for :func:`place_caches`.
    """
    if isinstance(ref, dict):
        ref = CapsuleRef.from_dict(ref)
    if part not in ("state", "all"):
        raise ColdSnapError(f"extract part {part!r} is unknown", fix="use 'state' or 'all'")
    if ref.layout == "docker":
        if part != "state":
            raise ColdSnapError(f"docker capsule of unit {ref.unit!r}: only its state can be extracted",
                                fix="run the capsule image to get its caches at their paths")
        return _extract_docker_state(ref, Path(dest), replace=replace, client=client, digests=digests)
    img = oci.open_layout(Path(ref.location), expected_manifest=ref.image_id, verify_layers=False,
                          what=f"capsule of unit {ref.unit!r}")
    if len(img.layers) != 1:
        raise IntegrityError(f"capsule of unit {ref.unit!r} has {len(img.layers)} layers, expected 1",
                             fix="ColdSnap OCI capsules hold one state layer; rebuild the capsule")
    layer = img.layers[0]
    select = None
    if part == "state":
        prefix = (img.labels.get(LABEL_STATE_TARGET) or "").strip("/")
        if not prefix:
            raise IntegrityError(f"capsule of unit {ref.unit!r} does not record its state target",
                                 fix="rebuild the capsule with this version of ColdSnap")

        def select(name: str) -> str | None:
            if name == prefix:
                return ""
            if name.startswith(prefix + "/"):
                return name[len(prefix) + 1:]
            return None

    what = f"capsule layer {layer.digest} of unit {ref.unit!r}"
    caches = [c.strip("/") for c in caches_to[0] if c.strip("/")] if caches_to and part == "state" else []
    if not caches:
        with oci.open_blob(img.layout, layer, what=f"capsule of unit {ref.unit!r}") as fh:
            return archive.safe_extract(fh, Path(dest), expected_digest=layer.digest, select=select, what=what,
                                        replace=replace, digests=digests)
    return _extract_state_and_caches(img, layer, Path(dest), Path(caches_to[1]), state_select=select,
                                     caches=caches, replace=replace, digests=digests, what=what)


def _extract_state_and_caches(img: oci.Image, layer: oci.Descriptor, dest: Path, scratch: Path, *,
                              state_select: Any, caches: list[str], replace: bool, digests: dict[str, str] | None,
                              what: str) -> list[str]:
    """One pass over the layer: the state into ``dest`` (0700, as :func:`archive.safe_extract` makes a root)
    and the files of ``caches`` below ``scratch`` at their absolute paths; both checked as one archive."""
    if os.path.lexists(dest) and not replace:
        raise ArchiveError(f"extraction destination {dest} already exists",
                           fix="remove it or extract into a new directory")

    def select(name: str) -> str | None:
        below = state_select(name)
        if below is not None:
            return "state/" + below if below else "state"
        return "caches/" + name if _in_caches(name, caches) else None

    root = temp_path_for(dest)
    got: dict[str, str] = {}
    with oci.open_blob(img.layout, layer, what=what) as fh:
        names = archive.safe_extract(fh, root, expected_digest=layer.digest, select=select, what=what, digests=got)
    try:
        state = root / "state"
        if not state.is_dir() or state.is_symlink():
            os.mkdir(state, 0o700)  # no state in this capsule: the caller finds no evidence and says so
        os.chmod(state, 0o700)
        archive.rmtree(scratch)
        if (root / "caches").is_dir():
            os.rename(root / "caches", scratch)
        if os.path.lexists(dest):
            archive.rmtree(dest)
        os.rename(state, dest)
        fsync_dir(dest.parent)
    finally:
        archive.rmtree(root)
    if digests is not None:
        digests.update({n[len("state/"):]: d for n, d in got.items() if n.startswith("state/")})
    return [n[len("state/"):] for n in names if n.startswith("state/")]


def restore_caches(ref: CapsuleRef | dict, cache_paths: list[str], scratch: Path) -> list[str]:
    """Add the files of the capsule's derived caches that this host lacks, at their own paths.

    A restored process maps compiled kernels from its cache directories (vLLM's
    ``torch_compile_cache``); a host that never ran the engine lacks them. Only
    absent files are added, never one that exists (a cache is keyed by content,
    and a file in use must not change under its users). The layer digest is
    checked while it streams; ``scratch`` (a new directory on the state root) is
    removed afterwards. Returns the paths added.
    """
    if isinstance(ref, dict):
        ref = CapsuleRef.from_dict(ref)
    prefixes = _cache_prefixes(cache_paths)
    if not prefixes or ref.layout != "oci-layout":
        return []
    img = oci.open_layout(Path(ref.location), expected_manifest=ref.image_id, verify_layers=False,
                          what=f"capsule of unit {ref.unit!r}")

    def select(name: str) -> str | None:
        return name if _in_caches(name, prefixes) else None

    added: list[str] = []
    try:
        for layer in img.layers:
            with oci.open_blob(img.layout, layer, what=f"capsule of unit {ref.unit!r}") as fh:
                archive.safe_extract(fh, scratch, expected_digest=layer.digest, select=select,
                                     what=f"capsule layer {layer.digest} of unit {ref.unit!r}", replace=True)
            added += _place_tree(scratch, prefixes, ref.unit)
    finally:
        archive.rmtree(scratch)
    return sorted(added)


def place_caches(unit: str, cache_paths: list[str], scratch: Path) -> list[str]:
    """:func:`restore_caches` for cache files an extraction already left below ``scratch`` at their
    absolute paths (:func:`extract_capsule` with ``caches_to``): the same checks and placement, and
    ``scratch`` removed afterwards. Returns the paths added."""
    try:
        prefixes = _cache_prefixes(cache_paths)
        return sorted(_place_tree(scratch, prefixes, unit)) if prefixes and os.path.isdir(scratch) else []
    finally:
        archive.rmtree(scratch)


def _cache_prefixes(cache_paths: list[str]) -> list[str]:
    """The declared cache paths as layer member prefixes, after the checks a placement on this host needs."""
    for i, problem, fix in cache_path_problems(cache_paths, []):
        raise ColdSnapError(f"artifact policy.cache.paths[{i}]: {problem}", fix=fix)
    for c in cache_paths:
        if any(paths_overlap(c, d) for d in NO_HOST_CACHE_UNDER):
            raise ColdSnapError(f"artifact policy.cache.paths: {c!r} lies in a system directory this host "
                                "does not let a restore write into",
                                fix="keep derived caches under /root/.cache, /var/cache or the engine's own cache root")
    return [c.strip("/") for c in cache_paths if c.strip("/")]


def _in_caches(name: str, prefixes: list[str]) -> bool:
    return any(name == p or name.startswith(p + "/") for p in prefixes)


def _place_tree(scratch: Path, prefixes: list[str], unit: str) -> list[str]:
    """Place the files of the caches ``prefixes`` that ``scratch`` holds (at their absolute paths below
    it) where this host lacks them; every placement is checked before the first one is made."""
    moves: dict[str, str] = {}  # target -> source (nested cache paths are walked once)
    for p in prefixes:
        top = os.path.join(scratch, p)
        if os.path.islink(top):
            entries = [(os.path.dirname(top), [], [os.path.basename(top)])]
        elif os.path.isdir(top):
            entries = list(os.walk(top))
        else:
            continue
        for dirpath, dirnames, filenames in entries:
            rel = os.path.relpath(dirpath, scratch)
            target_dir = "/" + ("" if rel == "." else rel)
            for name in [*filenames, *(d for d in dirnames if os.path.islink(os.path.join(dirpath, d)))]:
                target = os.path.join(target_dir, name)
                if target in moves or os.path.lexists(target):
                    continue
                _check_cache_placement(os.path.join(dirpath, name), target, _cache_root_of(target, prefixes), unit)
                moves[target] = os.path.join(dirpath, name)
    added = []
    for target, source in moves.items():
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        # Again, now that the directories exist: one another user made in the meantime (a missing cache path
        # in /tmp) would be theirs to swap what is placed in it. Once root's own, nobody else can replace it.
        _refuse_planted(os.path.dirname(target), target, unit)
        if _place(source, target):
            added.append(target)
    return added


def _place(source: str, target: str) -> bool:
    """Put the scratch file ``source`` at ``target``, never over anything there and never as a partial
    file under ``target`` (an engine would map it): synced, then linked (``exclusive_commit``), or across
    file systems copied to a temporary name beside ``target``, synced and linked; a symlink is made anew.
    False when ``target`` appeared meanwhile (another restore placed it: a cache is keyed by content)."""
    try:
        if os.path.islink(source):
            os.symlink(os.readlink(source), target)
            fsync_dir(Path(target).parent)
            return True
        fsync_file(source)  # the extraction wrote it without a sync: its bytes land before its new name
        try:
            exclusive_commit(Path(source), Path(target))
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            tmp = temp_path_for(Path(target))
            try:
                shutil.copy2(source, tmp, follow_symlinks=False)
                fsync_file(tmp)
                exclusive_commit(tmp, Path(target))
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
    except FileExistsError:
        return False
    return True


def _cache_root_of(target: str, prefixes: list[str]) -> str:
    """The declared cache path (``/``-rooted) that holds ``target``; the select above kept only those."""
    return "/" + max((p for p in prefixes if target == "/" + p or target.startswith("/" + p + "/")), key=len)


def _check_cache_placement(source: str, target: str, cache_root: str, unit: str) -> None:
    """Refuse a cache file whose placement would write outside its declared cache path.

    The capsule's symbolic links must point inside that path (``x -> ../../etc`` passes the
    scratch tree's own check, as the layer is rooted at ``/``), no directory between the
    cache path and ``target`` may be a link on this host (an earlier capsule's link would make
    ``makedirs`` and the move follow it out of the cache), and no directory on the way (the
    cache path itself included) may be another user's in a world-writable one (``/tmp/x`` made
    by someone else, or a link of theirs there, would take root's files where they want).
    """
    if os.path.islink(source):
        dest = posixpath.normpath(posixpath.join(posixpath.dirname(target), os.readlink(source)))
        if not (dest == cache_root or dest.startswith(cache_root.rstrip("/") + "/")):
            raise IntegrityError(f"capsule of unit {unit!r}: the cache link {target} points outside "
                                 f"its cache path {cache_root} (to {dest})",
                                 fix="rebuild the capsule from a cache whose links stay inside it")
    _refuse_planted(os.path.dirname(target), target, unit)
    linked = first_link_below(cache_root, posixpath.relpath(target, cache_root))
    if linked is not None:
        raise ColdSnapError(f"capsule of unit {unit!r}: {linked} on this host is a symbolic link inside the "
                            f"cache path {cache_root}; a cache file is not placed through it ({target})",
                            fix=f"remove the link {linked} (the capsule adds the directory), or drop "
                                f"{cache_root} from policy.cache.paths")


def _refuse_planted(directory: str, target: str, unit: str) -> None:
    planted = planted_by_another(directory)
    if planted is not None:
        where, shared, uid = planted
        raise ColdSnapError(f"capsule of unit {unit!r}: {where} belongs to uid {uid} and lies in {shared}, which "
                            f"anyone may write to; a cache file is not placed through it ({target})",
                            fix=f"remove {where}, or declare a cache path outside world-writable directories "
                                "(or one this user made there)")


def _extract_docker_state(ref: CapsuleRef, dest: Path, *, replace: bool, client: Any,
                          digests: dict[str, str] | None = None) -> list[str]:
    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import dockerapi

    details = inspect_capsule(ref, verify=False, client=client)
    target = details.get("state_target") or ""
    if not target.startswith("/"):
        raise IntegrityError(f"capsule of unit {ref.unit!r} does not record its state target",
                             fix="rebuild the capsule with this version of ColdSnap")
    client = dockerapi.docker_client(client)
    top = posixpath.basename(target.rstrip("/"))

    def select(name: str) -> str | None:
        if name == top:
            return ""
        return name[len(top) + 1:] if name.startswith(top + "/") else None

    container = client.containers.create(ref.image_id, ["true"], network_disabled=True,
                                         labels={LABEL_KIND: "capsule-extract"})
    try:
        stream, _stat = container.get_archive(target)
        return archive.safe_extract(archive.ChunkReader(stream), dest, select=select, replace=replace,
                                    what=f"state of docker capsule {ref.image_id} (unit {ref.unit!r})",
                                    digests=digests)
    finally:
        container.remove(force=True)
