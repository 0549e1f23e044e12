"""OCI-layout capsules (runtime ``host``): built with the standard library only, content-addressed,
never carrying a model pack, a model mount or a Hugging Face cache, and extracted safely."""

from __future__ import annotations

import io
import json
import os
import stat
import tarfile
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import oci
from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.archive import ArchiveError
from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.build import (
    CapsuleRef,
    build_capsule,
    build_capsule_detailed,
    extract_capsule,
    inspect_capsule,
    place_caches,
    restore_caches,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)

TARGET = "/var/lib/coldsnap/captures/cap-1/units/unit-0"
MODEL_MOUNT = "/var/lib/coldsnap/models/reference-tiny"
PACK = "b" * 64 + ".pack"


@pytest.fixture
def state(tmp_path: Path) -> Path:
    s = tmp_path / "state"
    (s / "criu").mkdir(parents=True)
    (s / "criu" / "pages-1.img").write_bytes(b"\x00" * 8192 + b"pages")
    (s / "weights.blob").write_bytes(b"residual")
    (s / "native-manifest.json").write_text("{}")
    (s / "replay-plan.json").write_text("{}")
    (s / "capture.log").write_text("log\n")
    (s / "tool").write_text("#!/bin/sh\n")
    os.chmod(s / "tool", 0o4750)
    (s / PACK).write_bytes(b"MODELBYTES")
    (s / (PACK + ".coldsnap-validation.json")).write_text("{}")
    (s / "criu" / "latest").symlink_to("pages-1.img")
    return s


def _build(state: Path, root: Path, **over) -> object:
    kw = dict(unit="unit-0", capture_id="cap-1", files=state, state_target=TARGET, cache_paths=[],
              forbidden_paths=[MODEL_MOUNT], layout="oci-layout", base_image=None, oci_root=root,
              labels={"org.coldsnap.recipe": "reference-tiny-local"})
    kw.update(over)
    return build_capsule_detailed(**kw)


def _layer_names(ref: CapsuleRef) -> list[str]:
    img = oci.open_layout(Path(ref.location))
    with open(oci.blob_path(img.layout, img.layers[0].digest), "rb") as fh, tarfile.open(fileobj=fh) as tar:
        return tar.getnames()


def test_build_is_content_addressed_idempotent_and_leaves_the_pack_out(state: Path, tmp_path: Path) -> None:
    root = tmp_path / "capsules"
    first = _build(state, root)
    ref = first.ref
    assert first.changed and ref.layout == "oci-layout"
    assert Path(ref.location) == root / "sha256" / ref.image_id.split(":")[1]
    assert sorted(first.excluded) == sorted([PACK, PACK + ".coldsnap-validation.json"])
    names = _layer_names(ref)
    assert f"{TARGET.lstrip('/')}/weights.blob" in names
    assert not any(n.endswith(".pack") or ".pack." in n for n in names)
    # Layout files per the image-layout spec.
    assert json.loads((Path(ref.location) / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads((Path(ref.location) / "index.json").read_text())
    assert index["manifests"][0]["digest"] == ref.image_id
    assert ref.bytes == sum(p.stat().st_size for p in (Path(ref.location) / "blobs" / "sha256").iterdir())

    dry = _build(state, root, dry_run=True)
    assert dry.dry_run and not dry.changed and dry.ref.image_id == ref.image_id
    again = _build(state, root)
    assert not again.changed and again.ref == ref
    assert sorted(os.listdir(root)) == ["sha256"], "no temporary directory may remain"

    (state / "capture.log").write_text("log, changed\n")
    changed = _build(state, root, dry_run=True)
    assert changed.changed and changed.ref.image_id != ref.image_id


def test_check_mode_sees_a_damaged_layout_that_the_build_replaces(state: Path, tmp_path: Path) -> None:
    root = tmp_path / "capsules"
    ref = _build(state, root).ref
    layer = oci.open_layout(Path(ref.location)).layers[0]
    oci.blob_path(Path(ref.location), layer.digest).unlink()
    before = sorted(str(p) for p in root.rglob("*"))
    dry = _build(state, root, dry_run=True)
    assert dry.changed, "check mode reports the rebuild a real run does"
    assert sorted(str(p) for p in root.rglob("*")) == before, "and changes nothing"
    assert _build(state, root).changed
    assert oci.open_layout(Path(ref.location), expected_manifest=ref.image_id)
    assert not _build(state, root, dry_run=True).changed


def test_labels_and_inspect(state: Path, tmp_path: Path) -> None:
    ref = _build(state, tmp_path / "c").ref
    info = inspect_capsule(ref)
    assert info["capture_id"] == "cap-1" and info["state_target"] == TARGET and info["cache_paths"] == []
    assert info["labels"]["org.coldsnap.recipe"] == "reference-tiny-local"
    assert info["labels"]["org.coldsnap.kind"] == "capsule"
    wrong_unit = CapsuleRef("unit-9", ref.layout, ref.image_id, ref.location, ref.bytes)
    with pytest.raises(IntegrityError, match="unit-9"):
        inspect_capsule(wrong_unit)


def test_extract_state_and_all_preserve_modes(state: Path, tmp_path: Path) -> None:
    ref = _build(state, tmp_path / "c").ref
    dest = tmp_path / "restored"
    extract_capsule(ref, dest)
    assert (dest / "weights.blob").read_bytes() == b"residual"
    assert (dest / "criu" / "pages-1.img").read_bytes() == (state / "criu" / "pages-1.img").read_bytes()
    assert os.readlink(dest / "criu" / "latest") == "pages-1.img"
    assert stat.S_IMODE(os.stat(dest / "tool").st_mode) == 0o750, "modes kept, set-id bits never"
    assert not (dest / PACK).exists()
    everything = tmp_path / "all"
    extract_capsule(ref.as_dict(), everything, part="all")
    assert (everything / TARGET.lstrip("/") / "capture.log").read_text() == "log\n"


def test_cache_paths_are_copied_to_their_absolute_paths(state: Path, tmp_path: Path) -> None:
    cache = tmp_path / "staged-cache"
    (cache / "triton").mkdir(parents=True)
    (cache / "triton" / "kernel.cubin").write_bytes(b"cubin")
    (cache / "stale.pack").write_bytes(b"no")
    res = _build(state, tmp_path / "c", cache_paths=["/root/.cache/vllm", "/root/.cache/absent"],
                 cache_sources={"/root/.cache/vllm": cache})
    assert res.absent_caches == ("/root/.cache/absent",)
    assert "/root/.cache/vllm/stale.pack" in res.excluded
    names = _layer_names(res.ref)
    assert "root/.cache/vllm/triton/kernel.cubin" in names
    assert inspect_capsule(res.ref)["cache_paths"] == ["/root/.cache/vllm"]


def test_restore_caches_adds_only_the_files_this_host_lacks(state: Path, tmp_path: Path) -> None:
    staged = tmp_path / "staged"
    (staged / "ab12").mkdir(parents=True)
    (staged / "ab12" / "kernel.so").write_bytes(b"compiled")
    (staged / "ab12" / "other.so").write_bytes(b"captured copy")
    host_cache = tmp_path / "host" / "torch_compile_cache"
    res = _build(state, tmp_path / "c", cache_paths=[str(host_cache)], cache_sources={str(host_cache): staged})
    (host_cache / "ab12").mkdir(parents=True)
    (host_cache / "ab12" / "other.so").write_bytes(b"host copy")  # present here: never replaced
    scratch = tmp_path / "scratch"
    added = restore_caches(res.ref, [str(host_cache)], scratch)
    assert added == [str(host_cache / "ab12" / "kernel.so")]
    assert (host_cache / "ab12" / "kernel.so").read_bytes() == b"compiled"
    assert (host_cache / "ab12" / "other.so").read_bytes() == b"host copy"
    assert not scratch.exists()
    assert restore_caches(res.ref, [str(host_cache)], scratch) == []


def test_the_state_and_its_caches_come_out_of_one_pass_over_the_layer(state: Path, tmp_path: Path,
                                                                      monkeypatch) -> None:
    """A host without the capture extracts the state and the derived caches in one read of the layer: the
    state as a private directory with each file's digest, the caches in a scratch tree at their absolute
    paths, placed where this host lacks them; a damaged layer leaves neither (nor a temporary name)."""
    import hashlib

    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import build

    staged = tmp_path / "staged"
    (staged / "ab12").mkdir(parents=True)
    (staged / "ab12" / "kernel.so").write_bytes(b"compiled")
    host_cache = tmp_path / "host" / "torch_compile_cache"
    res = _build(state, tmp_path / "c", cache_paths=[str(host_cache)], cache_sources={str(host_cache): staged})
    reads = []
    real_safe_extract = build.archive.safe_extract
    monkeypatch.setattr(build.archive, "safe_extract", lambda *a, **k: reads.append(1) or real_safe_extract(*a, **k))
    digests: dict[str, str] = {}
    dest, scratch = tmp_path / "units" / "unit-0", tmp_path / "units" / ".unit-0.caches-1"
    dest.parent.mkdir()
    names = extract_capsule(res.ref, dest, digests=digests, caches_to=([str(host_cache)], scratch))
    monkeypatch.undo()
    assert reads == [1], "one pass over the layer"
    assert (dest / "criu" / "pages-1.img").read_bytes() == (state / "criu" / "pages-1.img").read_bytes()
    assert stat.S_IMODE(os.stat(dest).st_mode) == 0o700 and "criu/pages-1.img" in names
    assert digests["criu/pages-1.img"] == "sha256:" + hashlib.sha256((state / "criu" / "pages-1.img").read_bytes()).hexdigest()
    assert not any(n.startswith(("state", "caches")) for n in [*names, *digests])
    cached = scratch / str(host_cache).lstrip("/") / "ab12" / "kernel.so"
    assert cached.read_bytes() == b"compiled"
    assert sorted(os.listdir(dest.parent)) == [".unit-0.caches-1", "unit-0"], "no temporary name is left"
    assert place_caches("unit-0", [str(host_cache)], scratch) == [str(host_cache / "ab12" / "kernel.so")]
    assert (host_cache / "ab12" / "kernel.so").read_bytes() == b"compiled" and not scratch.exists()

    blob = oci.blob_path(Path(res.ref.location), oci.open_layout(Path(res.ref.location)).layers[0].digest)
    data = bytearray(blob.read_bytes())
    data[len(data) // 3] ^= 1
    os.chmod(blob, 0o600)
    blob.write_bytes(bytes(data))
    again = tmp_path / "again"
    again.mkdir()
    with pytest.raises((IntegrityError, ArchiveError)):
        extract_capsule(res.ref, again / "unit-0", caches_to=([str(host_cache)], again / ".unit-0.caches-1"))
    assert os.listdir(again) == [], "neither the state nor the caches nor a temporary name"


@pytest.mark.parametrize("cache_path", ["/etc/cron.d", "/usr/lib/x", "/root/.cache/huggingface"])
def test_restore_caches_never_writes_into_system_trees(state: Path, tmp_path: Path, cache_path: str) -> None:
    res = _build(state, tmp_path / "c")
    with pytest.raises(ColdSnapError, match=r"policy\.cache\.paths"):
        restore_caches(res.ref, [cache_path], tmp_path / "scratch")
    assert not (tmp_path / "scratch").exists()


@pytest.mark.parametrize(("cache_path", "message"), [
    (MODEL_MOUNT, "overlaps the unit's mount"),
    (MODEL_MOUNT + "/derived", "overlaps the unit's mount"),
    ("/var/lib/coldsnap/models", "overlaps the unit's mount"),
    ("/root/.cache/huggingface", "Hugging Face"),
    ("/data/hf/hub", "Hugging Face"),
    ("/data/cache/models--org--name", "Hugging Face"),
    (TARGET + "/cache", "overlaps the state target"),
    ("/usr", "system directory"),
    ("/proc/sys", "system directory"),
    ("relative/path", "not an absolute path"),
    ("/root/../etc", "'..'"),
])
def test_forbidden_cache_paths_are_refused_before_anything_is_written(
        state: Path, tmp_path: Path, cache_path: str, message: str) -> None:
    root = tmp_path / "c"
    with pytest.raises(ColdSnapError, match=message):
        _build(state, root, cache_paths=[cache_path], cache_sources={cache_path: tmp_path})
    assert not root.exists()


def test_model_data_in_a_cache_or_the_state_is_refused(state: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(ColdSnapError, match="model data"):
        _build(state, tmp_path / "c", cache_paths=["/root/.cache/x"], cache_sources={"/root/.cache/x": cache})
    (state / "copy.safetensors").write_bytes(b"weights")
    with pytest.raises(ColdSnapError, match="model data"):
        _build(state, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_a_declared_pack_is_refused(state: Path, tmp_path: Path) -> None:
    files = {"weights.blob": state / "weights.blob", "model-weights.pack": state / PACK}
    with pytest.raises(ColdSnapError, match="model pack"):
        _build(state, tmp_path / "c", files=files)
    ok = _build(state, tmp_path / "c", files={"weights.blob": state / "weights.blob", "criu": state / "criu"})
    assert f"{TARGET.lstrip('/')}/criu/pages-1.img" in _layer_names(ok.ref)


def test_state_target_must_not_overlap_a_mount(state: Path, tmp_path: Path) -> None:
    with pytest.raises(ColdSnapError, match="overlaps the unit's mount"):
        _build(state, tmp_path / "c", state_target=MODEL_MOUNT + "/state")


def test_state_with_an_escaping_symlink_is_refused(state: Path, tmp_path: Path) -> None:
    (state / "escape").symlink_to("/etc/passwd")
    with pytest.raises(ArchiveError, match="points outside"):
        _build(state, tmp_path / "c")


def test_a_corrupted_blob_is_detected_and_extraction_writes_nothing(state: Path, tmp_path: Path) -> None:
    ref = build_capsule(unit="unit-0", capture_id="cap-1", files=state, state_target=TARGET, cache_paths=[],
                        forbidden_paths=[], layout="oci-layout", base_image=None, oci_root=tmp_path / "c",
                        labels={})
    img = oci.open_layout(Path(ref.location))
    blob = oci.blob_path(img.layout, img.layers[0].digest)
    data = bytearray(blob.read_bytes())
    data[600] ^= 0x01
    blob.chmod(0o644)
    blob.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="corrupt"):
        inspect_capsule(ref)
    with pytest.raises(IntegrityError):
        extract_capsule(ref, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


@pytest.mark.parametrize("blob_kind", ["layer", "config"])
def test_a_blob_that_is_a_link_is_never_read_through(state: Path, tmp_path: Path, blob_kind: str) -> None:
    """A link to /dev/zero at a blob's name would be read without end (a JSON blob into memory)."""
    ref = build_capsule(unit="unit-0", capture_id="cap-1", files=state, state_target=TARGET, cache_paths=[],
                        forbidden_paths=[], layout="oci-layout", base_image=None, oci_root=tmp_path / "c",
                        labels={})
    img = oci.open_layout(Path(ref.location))
    desc = img.layers[0] if blob_kind == "layer" else img.config_desc
    blob = oci.blob_path(img.layout, desc.digest)
    blob.unlink()
    blob.symlink_to("/dev/zero")
    with pytest.raises(IntegrityError, match="symbolic link"):
        extract_capsule(ref, tmp_path / "out") if blob_kind == "layer" else oci.open_layout(Path(ref.location))
    assert not (tmp_path / "out").exists()
    with pytest.raises(IntegrityError, match="symbolic link"):
        inspect_capsule(ref)


def test_a_malicious_layer_is_refused_on_extraction(tmp_path: Path) -> None:
    """A hand-made layout whose layer writes ../ : extraction refuses it and writes nothing outside."""
    layout = tmp_path / "evil"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("var/lib/state/../../../../escaped.txt")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"evil"))
    layer = oci.write_blob_bytes(layout, buf.getvalue(), oci.MEDIA_LAYER_TAR)
    config = {"architecture": "amd64", "os": "linux",
              "config": {"Labels": {"org.coldsnap.kind": "capsule", "org.coldsnap.unit": "u",
                                    "org.coldsnap.capsule.state-target": "/var/lib/state"}},
              "rootfs": {"type": "layers", "diff_ids": [layer.digest]}}
    cdesc = oci.write_blob_bytes(layout, oci.json_bytes(config), oci.MEDIA_CONFIG)
    manifest = {"schemaVersion": 2, "mediaType": oci.MEDIA_MANIFEST, "config": cdesc.as_dict(),
                "layers": [layer.as_dict()]}
    mdesc = oci.write_blob_bytes(layout, oci.json_bytes(manifest), oci.MEDIA_MANIFEST)
    oci.write_layout_files(layout, mdesc)
    ref = CapsuleRef("u", "oci-layout", mdesc.digest, str(layout), 0)
    for part in ("state", "all"):
        with pytest.raises(ArchiveError, match=r"'\.\.'"):
            extract_capsule(ref, tmp_path / "dest" / "x", part=part)
    assert not (tmp_path / "escaped.txt").exists() and not Path("/escaped.txt").exists()
    assert not (tmp_path / "dest" / "x").exists()


def test_capsule_ref_validates_its_fields() -> None:
    with pytest.raises(ColdSnapError, match="layout"):
        CapsuleRef("u", "zip", "sha256:" + "0" * 64, "x", 0)
    with pytest.raises(ColdSnapError, match="64 hex"):
        CapsuleRef("u", "docker", "sha256:abc", "x", 0)
    ref = CapsuleRef("u", "docker", "sha256:" + "0" * 64, "x", 1)
    assert CapsuleRef.from_dict({**ref.as_dict(), "host": "h"}) == ref


def _cache_capsule(root: Path, members: list[tuple[str, bytes, str, bytes]]) -> CapsuleRef:
    """A one-layer OCI capsule written by hand (the builder refuses such trees, a crafted one need not)."""
    bio = io.BytesIO()
    with tarfile.open(fileobj=bio, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, link, data in members:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, link
            info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
            info.size = len(data) if kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
    layer = oci.write_blob_bytes(root, bio.getvalue(), oci.MEDIA_LAYER_TAR)
    config = oci.write_blob_bytes(root, oci.json_bytes({"rootfs": {"type": "layers", "diff_ids": [layer.digest]},
                                                        "config": {}}), oci.MEDIA_CONFIG)
    manifest = oci.write_blob_bytes(root, oci.json_bytes({"schemaVersion": 2, "mediaType": oci.MEDIA_MANIFEST,
                                                          "config": config.as_dict(), "layers": [layer.as_dict()]}),
                                    oci.MEDIA_MANIFEST)
    oci.write_layout_files(root, manifest)
    return CapsuleRef(unit="unit-0", layout="oci-layout", image_id=manifest.digest, location=str(root), bytes=0)


def test_restore_caches_never_places_a_file_outside_its_cache_path(tmp_path: Path) -> None:
    """One capsule's link out of the cache (``x -> ../outside``) is refused before anything is placed;
    a link already on the host inside the cache path is not followed by a later capsule's files."""
    outside = tmp_path / "outside"
    outside.mkdir()
    cache = tmp_path / "cache"
    p = str(cache).strip("/")
    d, sym, reg = tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.REGTYPE
    escaping = _cache_capsule(tmp_path / "a", [(p, d, "", b""), (p + "/ok.so", reg, "", b"k"),
                                               (p + "/x", sym, "../outside", b"")])
    with pytest.raises(IntegrityError, match=r"cache link .*/x points outside its cache path"):
        restore_caches(escaping, [str(cache)], tmp_path / "scratch")
    assert not (cache / "x").is_symlink() and not (cache / "ok.so").exists()
    assert not (tmp_path / "scratch").exists()

    cache.mkdir(exist_ok=True)
    (cache / "x").symlink_to(outside)  # however it got there
    through = _cache_capsule(tmp_path / "b", [(p, d, "", b""), (p + "/x", d, "", b""),
                                              (p + "/x/pwned", reg, "", b"outside"), (p + "/y.so", reg, "", b"y")])
    with pytest.raises(ColdSnapError, match=r"is a symbolic link inside the cache path"):
        restore_caches(through, [str(cache)], tmp_path / "scratch")
    assert os.listdir(outside) == [] and not (cache / "y.so").exists()

    inside = _cache_capsule(tmp_path / "c", [(p, d, "", b""), (p + "/k", d, "", b""), (p + "/k/a.so", reg, "", b"a"),
                                             (p + "/latest", sym, "k/a.so", b"")])
    (cache / "x").unlink()
    added = restore_caches(inside, [str(cache)], tmp_path / "scratch")
    assert added == [str(cache / "k" / "a.so"), str(cache / "latest")]
    assert (cache / "latest").read_bytes() == b"a"


@pytest.mark.parametrize("stem", ["capsule", "pull"])
def test_a_killed_build_leaves_nothing_the_next_build_keeps(state: Path, tmp_path: Path, stem: str) -> None:
    """The temporary layout of a build (or a pull) that was killed is removed by the next build; a live
    one's stays."""
    import fcntl

    root = tmp_path / "capsules"
    root.mkdir()
    dead, live = root / f".{stem}.tmp-0123456789ab", root / f".{stem}.tmp-ba9876543210"
    for d in (dead, live):
        (d / "blobs" / "sha256").mkdir(parents=True)
        (d / "blobs" / "sha256" / "partial").write_bytes(b"x" * 4096)
    held = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        assert _build(state, root).changed
        assert not dead.exists() and live.exists()
    finally:
        os.close(held)


def test_no_space_for_a_capsule_is_named_with_the_fix(state: Path, tmp_path: Path, monkeypatch) -> None:
    def full(*_a, **_kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(oci, "write_blob_stream", full)
    root = tmp_path / "capsules"
    with pytest.raises(ColdSnapError, match=r"no space left on the file system of .*capsules.*free space there"):
        _build(state, root)
    assert [p.name for p in root.iterdir()] == [], "the temporary layout is removed"


def test_no_space_while_a_capsule_is_extracted_is_named_and_leaves_nothing(
        state: Path, tmp_path: Path, monkeypatch) -> None:
    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import archive

    ref = _build(state, tmp_path / "c").ref

    def full(*_a, **_kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(archive, "_write_all", full)
    work = tmp_path / "restore"
    with pytest.raises(ColdSnapError, match=r"no space left on the file system of .*restore while writing the "
                                            r"files of capsule layer sha256:[0-9a-f]{64} of unit .*free space"):
        extract_capsule(ref, work / "unit-0")
    assert list(work.iterdir()) == [], "no destination and no temporary directory remain"


@pytest.mark.parametrize("damage", ["link to /dev/zero", "directory", "fifo", "deep nesting", "trailing data"])
@pytest.mark.parametrize("name", ["index.json", "oci-layout"])
def test_a_damaged_layout_file_is_an_integrity_error_and_the_next_build_replaces_it(
        state: Path, tmp_path: Path, name: str, damage: str) -> None:
    """The layout's own files are read as carefully as its blobs: never through a link or from a FIFO
    (read without end), bounded, strict JSON; a build then puts a good copy in place."""
    root = tmp_path / "capsules"
    ref = _build(state, root).ref
    path = Path(ref.location) / name
    path.unlink()
    if damage == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    elif damage == "directory":
        path.mkdir()
    elif damage == "fifo":
        os.mkfifo(path)
    elif damage == "deep nesting":
        path.write_text("[" * 100_000 + "]" * 100_000)
    else:
        path.write_text('{"imageLayoutVersion": "1.0.0"} {}')
    for read in (lambda: oci.open_layout(Path(ref.location)), lambda: inspect_capsule(ref)):
        with pytest.raises(IntegrityError) as exc:
            read()
        assert name in str(exc.value) and "rebuild or re-pull" in exc.value.fix
    again = _build(state, root)
    assert again.changed and again.ref.image_id == ref.image_id
    assert oci.open_layout(Path(ref.location), expected_manifest=ref.image_id).manifest_desc.digest == ref.image_id


def test_builds_of_one_capsule_at_once_all_end_with_it(state: Path, tmp_path: Path) -> None:
    """Builds of the same capsule race to its final name (threads here: a fork of the test process could
    inherit a held lock): one of them places it, the others find it in place, and none removes it under
    the others."""
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    root = tmp_path / "capsules"
    for _round in range(8):
        shutil.rmtree(root, ignore_errors=True)
        with ThreadPoolExecutor(4) as pool:
            builds = list(pool.map(lambda _i: _build(state, root), range(4)))
        ids = {b.ref.image_id for b in builds}
        assert len(ids) == 1 and sum(b.changed for b in builds) == 1
        [image_id] = ids
        assert oci.open_layout(root / "sha256" / image_id.split(":", 1)[1], expected_manifest=image_id)
        assert os.listdir(root / "sha256") == [image_id.split(":", 1)[1]], "no lock file stays"
        assert [p.name for p in root.iterdir() if ".tmp-" in p.name or ".new-" in p.name] == []


def test_a_link_planted_at_a_layouts_name_is_replaced_not_followed(state: Path, tmp_path: Path) -> None:
    root = tmp_path / "capsules"
    ref = _build(state, root).ref
    final = Path(ref.location)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("not ColdSnap's")
    import shutil

    shutil.rmtree(final)
    final.symlink_to(elsewhere)
    again = _build(state, root)
    assert again.changed and not final.is_symlink() and (elsewhere / "keep").read_text() == "not ColdSnap's"
    assert oci.open_layout(final, expected_manifest=ref.image_id).manifest_desc.digest == ref.image_id


def test_a_built_capsule_is_private_whatever_the_umask(state: Path, tmp_path: Path) -> None:
    """A capsule holds process memory: its layout, blobs and files are the owner's only."""
    import stat as st

    old = os.umask(0o022)
    try:
        ref = _build(state, tmp_path / "capsules").ref
    finally:
        os.umask(old)
    final = Path(ref.location)
    for d in (final.parent, final, final / "blobs", final / "blobs" / "sha256"):
        assert st.S_IMODE(d.stat().st_mode) == 0o700, d
    files = [p for p in final.rglob("*") if p.is_file()]
    assert files and all(st.S_IMODE(p.stat().st_mode) & 0o077 == 0 for p in files), files


def test_restore_caches_never_places_through_a_directory_another_user_made_in_tmp(tmp_path: Path) -> None:
    """A cache path in a world-writable directory that another user made first (or a link of theirs there)
    would take root's files wherever they point: refused before anything is placed; the same path made by
    this user is fine."""
    if os.geteuid() != 0:
        pytest.skip("making a directory owned by another user needs root")
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    victim = tmp_path / "victim"
    victim.mkdir()
    cache = shared / "torchinductor_root"
    p = str(cache).strip("/")
    d, reg = tarfile.DIRTYPE, tarfile.REGTYPE
    ref = _cache_capsule(tmp_path / "a", [(p, d, "", b""), (p + "/k", d, "", b""), (p + "/k/a.so", reg, "", b"a")])
    cache.symlink_to(victim)
    os.lchown(cache, 65534, 65534)
    with pytest.raises(ColdSnapError, match=r"belongs to uid 65534 .*anyone may write to"):
        restore_caches(ref, [str(cache)], tmp_path / "scratch")
    assert os.listdir(victim) == [] and not (tmp_path / "scratch").exists()
    cache.unlink()
    cache.mkdir()
    os.chown(cache, 65534, 65534)
    with pytest.raises(ColdSnapError, match=r"belongs to uid 65534"):
        restore_caches(ref, [str(cache)], tmp_path / "scratch")
    assert os.listdir(cache) == []
    cache.rmdir()
    assert restore_caches(ref, [str(cache)], tmp_path / "scratch") == [str(cache / "k" / "a.so")]


def test_a_cache_file_on_another_file_system_is_never_seen_half_written(tmp_path: Path, monkeypatch) -> None:
    """Across file systems a placement is a copy: it goes to a temporary name, is synced and linked, so a
    kill never leaves a partial kernel under the name an engine maps; a file that appeared meanwhile is
    kept, not replaced."""
    import errno as errno_mod

    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import build

    cache = tmp_path / "cache"
    p = str(cache).strip("/")
    d, reg = tarfile.DIRTYPE, tarfile.REGTYPE
    ref = _cache_capsule(tmp_path / "a", [(p, d, "", b""), (p + "/a.so", reg, "", b"a" * 5000),
                                          (p + "/b.so", reg, "", b"b")])
    real_link, seen = os.link, []

    def cross_device(src, dst, **kw):
        if "scratch" in str(src):  # scratch -> cache: as if on two file systems
            raise OSError(errno_mod.EXDEV, "Invalid cross-device link")
        seen.append((os.path.basename(src), os.path.basename(dst), os.path.getsize(src)))
        return real_link(src, dst, **kw)

    monkeypatch.setattr(build.os, "link", cross_device)
    added = restore_caches(ref, [str(cache)], tmp_path / "scratch")
    assert added == [str(cache / "a.so"), str(cache / "b.so")]
    assert (cache / "a.so").read_bytes() == b"a" * 5000
    assert [s[1] for s in seen] == ["a.so", "b.so"] and seen[0][2] == 5000, "linked whole from a temporary name"
    assert sorted(os.listdir(cache)) == ["a.so", "b.so"], "no temporary name is left"
    (cache / "b.so").unlink()

    def another_restore_first(src, dst, **kw):
        if os.path.basename(dst) == "b.so":
            (cache / "b.so").write_bytes(b"placed by another restore")
        return cross_device(src, dst, **kw)

    monkeypatch.setattr(build.os, "link", another_restore_first)
    assert restore_caches(ref, [str(cache)], tmp_path / "scratch") == []
    assert (cache / "b.so").read_bytes() == b"placed by another restore"
    assert sorted(os.listdir(cache)) == ["a.so", "b.so"]
