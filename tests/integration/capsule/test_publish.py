"""Capsule publication against a real registry (Debian's docker-registry on loopback).

Round trips push -> pull -> verify for both layouts, a push the registry rejects
(read-only maintenance mode), and pulls whose bytes are corrupted in flight by a
proxy: those fail and leave nothing cached (FAULTS.md 11).
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import oci, wire
from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.build import (
    build_capsule,
    extract_capsule,
    inspect_capsule,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.publish import (
    MANIFEST_ACCEPT,
    PublishError,
    published_oci_capsule,
    pull_capsule,
    push_capsule,
    remote_has,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.registry import (
    RegistryClient,
    RegistryError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import IntegrityError
from capsule_helpers import CorruptingProxy, make_state

pytestmark = [pytest.mark.docker, pytest.mark.registry, pytest.mark.slow]

TARGET = "/var/lib/coldsnap/captures/p/units/unit-0"


def _oci(tmp_path: Path, capture_id: str, unit: str = "unit-0"):
    state = make_state(tmp_path / unit)
    return build_capsule(unit=unit, capture_id=capture_id, files=state, state_target=TARGET, cache_paths=[],
                         forbidden_paths=["/models"], layout="oci-layout", base_image=None,
                         oci_root=tmp_path / "capsules", labels={"org.coldsnap.recipe": "r"})


def _docker(tmp_path: Path, capture_id: str, base: str, unit: str = "unit-0"):
    state = make_state(tmp_path / unit)
    return build_capsule(unit=unit, capture_id=capture_id, files=state, state_target=TARGET, cache_paths=[],
                         forbidden_paths=["/models"], layout="docker", base_image=base, oci_root=None,
                         labels={"org.coldsnap.recipe": "r"})


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


# ----------------------------------------------------------------------------- OCI layout

@pytest.mark.parametrize("compression", ["gzip", "none"])
def test_oci_capsule_round_trip(tmp_path, capture_id, registry, docker_client, compression):
    ref = _oci(tmp_path, capture_id)
    repo = f"{registry}/coldsnap/capsules-{compression}"
    events = []
    published = push_capsule(ref, repo, progress=events.append, compression=compression)
    wire_manifest = json.loads(RegistryClient(repo).get_manifest(published.split("@")[1], MANIFEST_ACCEPT, what="t"))
    if compression == "none":
        assert published == f"{repo}@{ref.image_id}", "pushed as it is, an OCI capsule's id is its manifest digest"
        assert [d["mediaType"] for d in wire_manifest["layers"]] == [oci.MEDIA_LAYER_TAR]
    else:
        assert published != f"{repo}@{ref.image_id}"
        assert [d["mediaType"] for d in wire_manifest["layers"]] == [oci.MEDIA_LAYER_GZIP]
        assert wire_manifest["annotations"][wire.ANN_IMAGE_ID] == ref.image_id
        assert any(e["status"] == "compressing" for e in events), "compression shows progress"
    assert {e["status"] for e in events} - {"compressing"} == {"pushed"}
    assert remote_has(published)
    # Content-idempotent: a second push uploads nothing (the compressed bytes are the same).
    events.clear()
    assert push_capsule(ref, repo, progress=events.append, compression=compression) == published
    assert {e["status"] for e in events} - {"compressing"} == {"exists"}
    assert published_oci_capsule(ref, repo) == published

    elsewhere = tmp_path / "restore-host" / "capsules"
    pulled = pull_capsule(published, expected_image_id=ref.image_id, layout="oci-layout", oci_root=elsewhere,
                          unit="unit-0")
    assert pulled.image_id == ref.image_id and pulled.repository_digest == published
    assert Path(pulled.location) == elsewhere / "sha256" / ref.image_id.split(":")[1]
    assert inspect_capsule(pulled)["capture_id"] == capture_id
    extract_capsule(pulled, tmp_path / "restored")
    original = tmp_path / "unit-0" / "state"
    for name in ("weights.blob", "criu/pages-1.img", "replay-plan.json"):
        assert (tmp_path / "restored" / name).read_bytes() == (original / name).read_bytes()
    assert not list((tmp_path / "restored").glob("*.pack"))
    # Pulling again finds the verified copy.
    assert pull_capsule(published, expected_image_id=ref.image_id, layout="oci-layout", oci_root=elsewhere) \
        == pulled
    # A damaged local copy is not trusted: it is replaced by a verified pull.
    layer = max((Path(pulled.location) / "blobs" / "sha256").iterdir(), key=lambda p: p.stat().st_size)
    data = bytearray(layer.read_bytes())
    data[len(data) // 2] ^= 0xFF
    layer.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        inspect_capsule(pulled)
    assert pull_capsule(published, expected_image_id=ref.image_id, layout="oci-layout", oci_root=elsewhere) \
        == pulled
    assert inspect_capsule(pulled)["verified"] is True


def test_only_the_assigned_capsule_is_pulled(tmp_path, capture_id, registry):
    a = _oci(tmp_path, capture_id, "unit-0")
    b = _oci(tmp_path, capture_id, "unit-1")
    repo = f"{registry}/coldsnap/capsules"
    push_capsule(a, repo)
    pb = push_capsule(b, repo)
    root = tmp_path / "host-1"
    pull_capsule(pb, expected_image_id=b.image_id, layout="oci-layout", oci_root=root, unit="unit-1")
    assert sorted(os.listdir(root / "sha256")) == [b.image_id.split(":")[1]]
    pulled = root / "sha256" / b.image_id.split(":")[1]
    for d in (root, pulled, pulled / "blobs", pulled / "blobs" / "sha256"):  # process memory: private
        assert d.stat().st_mode & 0o077 == 0, d
    for blob in (pulled / "blobs" / "sha256").iterdir():
        assert blob.stat().st_mode & 0o077 == 0, blob
    with pytest.raises(IntegrityError, match="not the capsule of unit 'unit-0'"):
        pull_capsule(pb, expected_image_id=b.image_id, layout="oci-layout", oci_root=tmp_path / "h2", unit="unit-0")
    assert _leftovers(tmp_path / "h2") == []
    with pytest.raises(IntegrityError, match=f"unpacks to capsule {b.image_id}, the descriptor records {a.image_id}"):
        pull_capsule(pb, expected_image_id=a.image_id, layout="oci-layout", oci_root=tmp_path / "h3")
    assert _leftovers(tmp_path / "h3") == []
    plain = push_capsule(b, repo, compression="none")
    with pytest.raises(IntegrityError, match="not its manifest digest"):
        pull_capsule(plain, expected_image_id=a.image_id, layout="oci-layout", oci_root=tmp_path / "h4")


def test_pulls_of_one_capsule_at_once_all_end_with_it(tmp_path, capture_id, registry):
    """Several restore-side pulls of the same capsule into one cache (two units' roles, a retry): the
    pulls that lose the race to the final name use the winner's verified copy instead of failing."""
    from concurrent.futures import ThreadPoolExecutor

    ref = _oci(tmp_path, capture_id)
    published = push_capsule(ref, f"{registry}/coldsnap/capsules")
    for attempt in range(5):  # threads: a fork of the test process could inherit a held lock
        root = tmp_path / f"host-{attempt}"
        with ThreadPoolExecutor(4) as pool:
            ids = list(pool.map(lambda _i, r=root: _pulled_id(published, ref.image_id, r), range(4)))
        assert ids == [ref.image_id] * 4
        assert os.listdir(root / "sha256") == [ref.image_id.split(":")[1]]
        assert [name for name in os.listdir(root) if ".tmp-" in name] == []


def _pulled_id(published: str, image_id: str, root: Path) -> str:
    return pull_capsule(published, expected_image_id=image_id, layout="oci-layout", oci_root=root).image_id


def test_oci_push_rejected_by_a_read_only_registry(tmp_path, capture_id, readonly_registry):
    ref = _oci(tmp_path, capture_id)
    with pytest.raises(RegistryError) as err:
        push_capsule(ref, f"{readonly_registry}/coldsnap/capsules")
    msg = str(err.value)
    assert err.value.status == 405 and "refused" in msg and "read-only" in msg
    assert not remote_has(f"{readonly_registry}/coldsnap/capsules@{ref.image_id}")


CORRUPTED = pytest.mark.parametrize("min_bytes", [0, 4096], ids=["config-blob", "layer-blob"])


@CORRUPTED
@pytest.mark.parametrize("compression", ["gzip", "none"])
def test_oci_pull_of_corrupted_bytes_fails_and_caches_nothing(tmp_path, capture_id, registry, min_bytes, compression):
    ref = _oci(tmp_path, capture_id)
    published = push_capsule(ref, f"{registry}/coldsnap/capsules", compression=compression)
    root = tmp_path / "restore-host"
    with CorruptingProxy(registry, min_bytes=min_bytes) as proxy:
        via_proxy = f"{proxy.address}/coldsnap/capsules@{published.split('@')[1]}"
        with pytest.raises(IntegrityError, match="alters content"):
            pull_capsule(via_proxy, expected_image_id=ref.image_id, layout="oci-layout", oci_root=root)
        assert proxy.corrupted, "the proxy served at least one (corrupted) blob"
    assert _leftovers(root) == [], "no layout, no blob, no temporary directory may remain"


def test_a_damaged_copy_on_the_registry_is_named_and_never_taken_as_replaced(tmp_path, capture_id):
    """A byte of a stored layer changed, then the layer cut short, on the registry's own disk: the pull fails
    and its fix says that publishing again does not replace a stored blob (the registry keeps the first bytes
    stored under a digest); a publish over the truncated copy names it as damaged instead of "retry"."""
    from capsule_helpers import docker_registry

    ref = _oci(tmp_path, capture_id)
    with docker_registry(tmp_path / "registry") as addr:
        repo = f"{addr}/coldsnap/capsules"
        published = push_capsule(ref, repo)
        layer = json.loads(RegistryClient(repo).get_manifest(published.split("@")[1], MANIFEST_ACCEPT,
                                                             what="t"))["layers"][0]["digest"].split(":")[1]
        stored = next((tmp_path / "registry").rglob(f"blobs/sha256/{layer[:2]}/{layer}/data"))
        data = bytearray(stored.read_bytes())
        data[len(data) // 2] ^= 0xFF
        stored.write_bytes(bytes(data))
        root = tmp_path / "restore-host"
        with pytest.raises(IntegrityError, match="alters content") as err:
            pull_capsule(published, expected_image_id=ref.image_id, layout="oci-layout", oci_root=root)
        assert "publishing again does not replace it" in str(err.value)
        stored.write_bytes(bytes(data[: len(data) // 2]))
        with pytest.raises(PublishError, match=f"holds blob sha256:{layer} .* a damaged copy"):
            push_capsule(ref, repo)
        with pytest.raises(IntegrityError, match=f"only {len(data) // 2} of the {len(data)} bytes .* ended early"):
            pull_capsule(published, expected_image_id=ref.image_id, layout="oci-layout", oci_root=root)
    assert _leftovers(root) == [], "no layout, no blob, no temporary directory may remain"


def test_what_a_killed_pull_left_goes_with_the_next_pull(tmp_path, capture_id, registry):
    """A pull killed mid-layer leaves its private temporary layout; the next pull removes it (a live pull's
    stays), instead of keeping the partial layers for ever."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.build import locked_temp_layout

    ref = _oci(tmp_path, capture_id)
    published = push_capsule(ref, f"{registry}/coldsnap/capsules")
    root = tmp_path / "restore-host"
    root.mkdir()
    dead, held = locked_temp_layout(root, "pull")
    (dead / "partial-layer").write_bytes(b"x" * 4096)
    os.close(held)  # its puller is gone (kill -9 releases the lock)
    live, held = locked_temp_layout(root, "pull")
    try:
        pull_capsule(published, expected_image_id=ref.image_id, layout="oci-layout", oci_root=root)
        assert not dead.exists() and live.exists()
    finally:
        os.close(held)
    assert sorted(p.name for p in root.iterdir()) == sorted(["sha256", live.name])


def test_a_corrupted_local_layout_is_refused_before_push(tmp_path, capture_id, registry):
    ref = _oci(tmp_path, capture_id)
    blobs = Path(ref.location) / "blobs" / "sha256"
    biggest = max(blobs.iterdir(), key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 1
    biggest.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="corrupt"):
        push_capsule(ref, f"{registry}/coldsnap/capsules")
    assert not remote_has(f"{registry}/coldsnap/capsules@{ref.image_id}")


def _publish_wire_layer(ref, repo: str, layer: bytes, annotations: dict, tag: str = "crafted") -> str:
    """Publish ``ref``'s own config with ``layer`` as its gzip wire layer (a registry holding other bytes than
    were pushed, self-consistent on the wire) under ``tag``; return repo@digest."""
    img = oci.open_layout(Path(ref.location))
    reg = RegistryClient(repo)
    config = oci.blob_path(img.layout, img.config_desc.digest).read_bytes()
    reg.upload_blob(img.config_desc.digest, len(config), lambda: config, what="config")
    desc = oci.Descriptor(oci.MEDIA_LAYER_GZIP, oci.digest_bytes(layer), len(layer), annotations)
    reg.upload_blob(desc.digest, desc.size, lambda: layer, what="layer")
    mbytes = wire.wire_manifest(img, [desc])
    reg.put_manifest(tag, mbytes, oci.MEDIA_MANIFEST, what="manifest")
    return f"{repo}@{oci.digest_bytes(mbytes)}"


@pytest.mark.parametrize("case", ["other-bytes", "bomb", "not-gzip", "truncated", "no-size", "members-lie",
                                  "size-lie"])
def test_oci_pull_of_a_wire_layer_that_does_not_unpack_to_the_capsule_caches_nothing(
        tmp_path, capture_id, registry, case):
    ref = _oci(tmp_path, capture_id)
    img = oci.open_layout(Path(ref.location))
    raw = oci.blob_path(img.layout, img.layers[0].digest).read_bytes()
    size = {wire.ANN_LAYER_SIZE: str(len(raw))}
    other = bytearray(raw)
    other[len(other) // 2] ^= 1
    layer, annotations, expect = {
        "other-bytes": (gzip.compress(bytes(other)), size, "decompresses to .* the capsule's config records"),
        "bomb": (gzip.compress(bytes(64 << 20)), size, f"decompresses to more than the {len(raw)} bytes"),
        "not-gzip": (b"this is not gzip" * 100, size, "not a valid gzip stream"),
        "truncated": (gzip.compress(raw)[:-9], size, "truncated"),
        "no-size": (gzip.compress(raw), {}, "does not announce its uncompressed size"),
        # A size the recorded capsule id does not vouch for: refused before the layer is fetched.
        "size-lie": (gzip.compress(bytes(64 << 20)), {wire.ANN_LAYER_SIZE: str(10 ** 17)},
                     f"unpacks to capsule sha256:[0-9a-f]{{64}}, the descriptor records {ref.image_id}"),
        "members-lie": (gzip.compress(raw) + gzip.compress(b"x"),
                        {**size, wire.ANN_LAYER_MEMBERS: f"{len(gzip.compress(raw)) - 1},{len(gzip.compress(b'x')) + 1}"},
                        "not a valid gzip stream"),
    }[case]
    published = _publish_wire_layer(ref, f"{registry}/coldsnap/crafted-{case}", layer, annotations)
    root = tmp_path / "restore-host"
    with pytest.raises(IntegrityError, match=expect):
        pull_capsule(published, expected_image_id=ref.image_id, layout="oci-layout", oci_root=root)
    assert _leftovers(root) == [], "no layout, no blob, no temporary directory may remain"
    # The same bytes, honest: the pull lands the capsule (the crafting itself is not what failed).
    honest = _publish_wire_layer(ref, f"{registry}/coldsnap/crafted-{case}", gzip.compress(raw), size)
    assert pull_capsule(honest, expected_image_id=ref.image_id, layout="oci-layout", oci_root=root).image_id \
        == ref.image_id


def test_a_second_publish_pushes_again_over_a_tag_that_does_not_rebuild_the_capsule(tmp_path, capture_id, registry):
    """The publish tag is mutable: a manifest planted under it that names this capsule but announces other
    layer sizes is not taken for the publication (a pull of it would fail); the capsule is pushed again."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.publish import (
        capture_id_of,
        publish_tag,
    )

    ref = _oci(tmp_path, capture_id)
    repo = f"{registry}/coldsnap/planted"
    tag = publish_tag(ref, capture_id_of(ref))
    _publish_wire_layer(ref, repo, gzip.compress(bytes(1 << 20)), {wire.ANN_LAYER_SIZE: str(10 ** 12)}, tag=tag)
    assert published_oci_capsule(ref, repo) is None
    published = push_capsule(ref, repo)
    assert published_oci_capsule(ref, repo) == published
    root = tmp_path / "restore-host"
    assert pull_capsule(published, expected_image_id=ref.image_id, layout="oci-layout", oci_root=root).image_id \
        == ref.image_id
    extracted = tmp_path / "out"
    extract_capsule(pull_capsule(published, expected_image_id=ref.image_id, layout="oci-layout", oci_root=root),
                    extracted, part="all")
    assert any(p.read_bytes() == (tmp_path / "unit-0" / "state" / "criu" / "pages-1.img").read_bytes()
               for p in extracted.rglob("pages-1.img"))


# ----------------------------------------------------------------------------- docker

def test_docker_capsule_round_trip(tmp_path, capture_id, registry, base_image, docker_client):
    ref = _docker(tmp_path, capture_id, base_image["base_image"])
    repo = f"{registry}/coldsnap/docker-capsules"
    published = push_capsule(ref, repo)
    assert published.startswith(repo + "@sha256:")
    assert remote_has(published)
    # The restore host does not have it: remove it, pull by digest, get the very same image id.
    docker_client.images.remove(ref.image_id, force=True)
    pulled = pull_capsule(published, expected_image_id=ref.image_id, layout="docker", unit="unit-0")
    assert pulled.image_id == ref.image_id and pulled.location == published
    info = inspect_capsule(pulled)
    assert published in info["repo_digests"]
    assert info["capture_id"] == capture_id
    dest = tmp_path / "restored"
    extract_capsule(pulled, dest)
    assert (dest / "weights.blob").read_bytes() == (tmp_path / "unit-0" / "state" / "weights.blob").read_bytes()
    # A descriptor that records another id is refused (and the pulled image is not left behind).
    docker_client.images.remove(ref.image_id, force=True)
    with pytest.raises(IntegrityError, match="descriptor records"):
        pull_capsule(published, expected_image_id="sha256:" + "0" * 64, layout="docker")
    with pytest.raises(Exception, match=r"No such image|not found"):
        docker_client.images.get(ref.image_id)


@pytest.mark.parametrize("units", [("Web", "web"), ("a--b", "a-b")])
def test_docker_capsules_of_units_whose_names_fold_together_keep_a_name_each(tmp_path, capture_id, base_image,
                                                                             docker_client, units):
    """Unit ids that differ only in case (or in runs of separators) fold to one repository name: each
    capsule of one capture still keeps a local name of its own, never left nameless for an image prune."""
    refs = [_docker(tmp_path, capture_id, base_image["base_image"], unit=unit) for unit in units]
    try:
        assert refs[0].image_id != refs[1].image_id and refs[0].location != refs[1].location
        for ref in refs:
            assert docker_client.images.get(ref.image_id).tags == [ref.location], ref.unit
    finally:
        for ref in refs:
            docker_client.images.remove(ref.image_id, force=True)


def test_a_docker_publish_keeps_a_capsule_whose_only_name_was_the_publish_tag(
        tmp_path, capture_id, registry, base_image, docker_client):
    """Another build of the same unit and capture took the capsule's local name: removing the publish tag
    after the push (the image's last name) would remove the capsule itself from the local store."""
    first = _docker(tmp_path / "first", capture_id, base_image["base_image"])
    second = _docker(tmp_path / "second", capture_id, base_image["base_image"])
    try:
        assert first.image_id != second.image_id and docker_client.images.get(first.image_id).tags == []
        published = push_capsule(first, f"{registry}/coldsnap/docker-capsules")
        assert remote_has(published)
        assert docker_client.images.get(first.image_id).id == first.image_id
        assert inspect_capsule(first, verify=True)["capture_id"] == capture_id
    finally:
        for ref in (first, second):
            try:
                docker_client.images.remove(ref.image_id, force=True)
            except Exception:  # what the failing case already removed
                pass


def test_docker_push_rejected_by_a_read_only_registry(tmp_path, capture_id, readonly_registry, base_image,
                                                      docker_client):
    ref = _docker(tmp_path, capture_id, base_image["base_image"])
    repo = f"{readonly_registry}/coldsnap/docker-capsules"
    with pytest.raises(PublishError, match="registry refused the push") as err:
        push_capsule(ref, repo)
    assert "nothing was recorded" in str(err.value)
    tags = docker_client.images.get(ref.image_id).tags
    assert not any(t.startswith(readonly_registry) for t in tags), "the publish tag is not left behind"


@CORRUPTED
def test_docker_pull_of_corrupted_bytes_fails_and_caches_nothing(tmp_path, capture_id, registry, *, base_image,
                                                                 docker_client, min_bytes):
    ref = _docker(tmp_path, capture_id, base_image["base_image"])
    repo_path = "coldsnap/docker-capsules"
    published = push_capsule(ref, f"{registry}/{repo_path}")
    digest = published.split("@", 1)[1]
    docker_client.images.remove(ref.image_id, force=True)
    with CorruptingProxy(registry, min_bytes=min_bytes) as proxy:
        with pytest.raises(IntegrityError, match="verification failed"):
            pull_capsule(f"{proxy.address}/{repo_path}@{digest}", expected_image_id=ref.image_id, layout="docker")
        assert proxy.corrupted
    with pytest.raises(Exception, match=r"No such image|not found"):
        docker_client.images.get(ref.image_id)
