"""Capsule layers on the wire (capsule/wire.py): parallel gzip members out, bounded and checked gunzip in."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import zlib

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import oci, wire
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import IntegrityError

SIZES = [0, 1, 4097, wire.MEMBER - 1, wire.MEMBER, 3 * wire.MEMBER + 17]


def _layer(n: int) -> bytes:
    """Memory-like bytes: a random quarter (compresses badly), the rest zeros and repeats."""
    rnd = os.urandom(n // 4)
    return (rnd + bytes(n // 4) + b"heap" * (n // 8))[:n].ljust(n, b"\0")


def _compress(data: bytes, **kw) -> bytes:
    out = io.BytesIO()
    done = wire.compress(io.BytesIO(data), out, **kw)
    assert done.size == out.tell() and done.digest == "sha256:" + hashlib.sha256(out.getvalue()).hexdigest()
    assert (done.source_digest, done.source_size) == ("sha256:" + hashlib.sha256(data).hexdigest(), len(data))
    return out.getvalue()


@pytest.mark.parametrize("n", SIZES)
def test_compressed_layers_are_standard_gzip_and_come_back_exactly(n):
    data = _layer(n)
    packed = _compress(data, workers=2)
    assert gzip.decompress(packed) == data, "any gzip reader (docker, containerd, gzip) reads the members as one"
    out = io.BytesIO()
    digest, size = wire.gunzip(io.BytesIO(packed), out, limit=n, what="layer")
    assert out.getvalue() == data and size == n and digest == "sha256:" + hashlib.sha256(data).hexdigest()


def test_compression_is_deterministic_whatever_the_parallelism():
    data = _layer(2 * wire.MEMBER + 5)
    assert _compress(data, workers=1) == _compress(data, workers=3), "a second publish pushes the same blob"


def test_a_standard_single_member_gzip_from_elsewhere_is_read_too():
    data = _layer(wire.MEMBER + 3)
    assert wire.gunzip(io.BytesIO(gzip.compress(data)), io.BytesIO(), limit=len(data), what="l")[1] == len(data)


def test_compression_reports_progress():
    seen = []
    _compress(_layer(3 * wire.MEMBER), workers=1, progress=seen.append)
    assert seen and seen[-1] == 3 * wire.MEMBER and seen == sorted(seen)


@pytest.mark.parametrize("damage", ["truncated", "trailing", "flipped", "empty", "not-gzip"])
def test_a_damaged_stream_is_refused(damage):
    data = _layer(wire.MEMBER + 100)
    packed = bytearray(_compress(data))
    if damage == "truncated":
        packed = packed[:-5]
    elif damage == "trailing":
        packed += b"\0\0\0\0"
    elif damage == "flipped":
        packed[100] ^= 0x40  # inside the first member's deflate data: its CRC-32 no longer matches
    elif damage == "empty":
        packed = bytearray()
    else:
        packed = bytearray(b"PK\x03\x04" + bytes(200))
    with pytest.raises(IntegrityError, match=r"layer 0 .*publish the capture again"):
        wire.gunzip(io.BytesIO(bytes(packed)), io.BytesIO(), limit=len(data), what="layer 0")


def test_decompression_stops_at_the_announced_size():
    """A small blob that inflates without end (a gzip bomb) writes no more than the layer announced."""
    bomb = zlib.compressobj(9, zlib.DEFLATED, wire.GZIP_WBITS)
    packed = bomb.compress(bytes(256 << 20)) + bomb.flush()
    assert len(packed) < 1 << 20

    class Counting(io.RawIOBase):
        written = 0

        def write(self, b):
            self.written += len(b)
            return len(b)

    out = Counting()
    with pytest.raises(IntegrityError, match="more than the 1000000 bytes it announces"):
        wire.gunzip(io.BytesIO(packed), out, limit=1_000_000, what="layer")
    assert out.written <= 1_000_000


def test_the_wire_manifest_names_the_local_capsule_and_rebuilds_it(tmp_path):
    config = oci.write_blob_bytes(tmp_path, b'{"rootfs":{}}', oci.MEDIA_CONFIG)
    layer = oci.Descriptor(oci.MEDIA_LAYER_TAR, "sha256:" + "ab" * 32, 10)
    local = oci.json_bytes(oci.image_manifest(config, [layer]))
    mdesc = oci.Descriptor(oci.MEDIA_MANIFEST, oci.digest_bytes(local), len(local))
    img = oci.Image(tmp_path, mdesc, {}, config, {}, (layer,))
    gz = oci.Descriptor(oci.MEDIA_LAYER_GZIP, "sha256:" + "cd" * 32, 7, {wire.ANN_LAYER_SIZE: "10"})
    import json

    sent = json.loads(wire.wire_manifest(img, [gz]))
    assert sent["annotations"] == {wire.ANN_IMAGE_ID: mdesc.digest}
    assert sent["layers"][0]["mediaType"] == oci.MEDIA_LAYER_GZIP
    assert wire.announced_size(gz, what="l") == 10
    for bad in ({}, {wire.ANN_LAYER_SIZE: "-1"}, {wire.ANN_LAYER_SIZE: "1e9"}, {wire.ANN_LAYER_SIZE: "9" * 30}):
        with pytest.raises(IntegrityError, match="does not announce its uncompressed size"):
            wire.announced_size(oci.Descriptor(oci.MEDIA_LAYER_GZIP, gz.digest, 7, bad), what="l")
    # What a pull rebuilds from the config and the decompressed layer is the local manifest, byte for byte.
    assert oci.json_bytes(oci.image_manifest(config, [layer])) == local


def _members(data: bytes) -> tuple[bytes, list[int]]:
    out = io.BytesIO()
    members = wire.compress(io.BytesIO(data), out, workers=2).members
    return out.getvalue(), members


@pytest.mark.parametrize("n", [0, 5, 2 * wire.MEMBER + 9])
def test_announced_members_inflate_in_parallel_to_the_same_bytes(n):
    data = _layer(n)
    packed, members = _members(data)
    assert sum(members) == len(packed) and len(members) == max(1, -(-n // wire.MEMBER))
    for workers in (1, 3):
        out = io.BytesIO()
        digest, size = wire.gunzip(io.BytesIO(packed), out, limit=n, what="l", members=members, workers=workers)
        assert size == n and out.getvalue() == data and digest == "sha256:" + hashlib.sha256(data).hexdigest()


def test_the_members_annotation_is_checked_against_the_layer():
    packed, members = _members(_layer(wire.MEMBER + 1))
    desc = oci.Descriptor(oci.MEDIA_LAYER_GZIP, oci.digest_bytes(packed), len(packed),
                          {wire.ANN_LAYER_MEMBERS: ",".join(map(str, members))})
    assert wire.announced_members(desc, what="l") == members
    assert wire.announced_members(oci.Descriptor(desc.media_type, desc.digest, desc.size), what="l") is None
    for bad in (f"{members[0]},{members[1] + 1}", f"{members[0]}", "", "a,b", f"-{members[0]},{members[1]}"):
        with pytest.raises(IntegrityError, match="announces gzip members"):
            wire.announced_members(oci.Descriptor(desc.media_type, desc.digest, desc.size,
                                                  {wire.ANN_LAYER_MEMBERS: bad}), what="l")


@pytest.mark.parametrize("damage", ["shifted-boundary", "truncated", "oversized-member", "flipped"])
def test_members_that_are_not_what_they_announce_are_refused(damage):
    data = _layer(2 * wire.MEMBER)
    packed, members = _members(data)
    limit = len(data)
    if damage == "shifted-boundary":
        members = [members[0] - 1, members[1] + 1]
    elif damage == "truncated":
        packed = packed[:-3]
    elif damage == "oversized-member":
        # One member that inflates to more than a member may hold (the layer's total would still fit).
        packed = gzip.compress(bytes(wire.MEMBER + 1))
        members, limit = [len(packed)], 4 * wire.MEMBER
    else:
        packed = bytearray(packed)
        packed[members[0] + 100] ^= 0x40  # inside the second member
        packed = bytes(packed)
    with pytest.raises(IntegrityError, match="layer 3"):
        wire.gunzip(io.BytesIO(packed), io.BytesIO(), limit=limit, what="layer 3", members=members, workers=2)


def test_a_layer_that_is_not_its_digest_is_refused_while_compressed(tmp_path):
    """Publish reads every byte to compress it: a layer that changed since the capture never goes out."""
    layout = tmp_path / "layout"
    desc = oci.write_blob_bytes(layout, _layer(wire.MEMBER + 10), oci.MEDIA_LAYER_TAR)
    wdesc, spool = wire.compress_blob(layout, desc, spool_dir=tmp_path)
    with spool:
        spool.seek(0)
        assert hashlib.sha256(spool.read()).hexdigest() == wdesc.digest.split(":")[1]
    assert os.listdir(tmp_path) == ["layout"], "the spool file is anonymous"
    path = oci.blob_path(layout, desc.digest)
    data = bytearray(path.read_bytes())
    data[wire.MEMBER + 3] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="changed while it was compressed"):
        wire.compress_blob(layout, desc, spool_dir=tmp_path)


def test_announcements_in_other_digits_or_beyond_a_member_are_refused_by_name():
    gz = oci.Descriptor(oci.MEDIA_LAYER_GZIP, "sha256:" + "cd" * 32, 20, {wire.ANN_LAYER_SIZE: "\u00b2"})
    with pytest.raises(IntegrityError, match="does not announce its uncompressed size"):
        wire.announced_size(gz, what="l")
    with pytest.raises(IntegrityError, match="announces gzip members"):
        wire.announced_members(oci.Descriptor(gz.media_type, gz.digest, 20, {wire.ANN_LAYER_MEMBERS: "1\u00b2"}),
                               what="l")
    big = wire.MEMBER_WIRE_MAX + 1
    with pytest.raises(IntegrityError, match="more than a member of"):
        wire.announced_members(oci.Descriptor(gz.media_type, gz.digest, big, {wire.ANN_LAYER_MEMBERS: str(big)}),
                               what="l")
    # zlib's own bound for a member of MEMBER random bytes stays inside the limit.
    assert len(wire._gzip_member(os.urandom(wire.MEMBER), 3)) <= wire.MEMBER_WIRE_MAX


def test_the_rebuilt_manifest_follows_the_config_and_the_announced_sizes(tmp_path):
    config = oci.write_blob_bytes(tmp_path, b'{"rootfs":{}}', oci.MEDIA_CONFIG)
    diff = "sha256:" + "ab" * 32
    gz = oci.Descriptor(oci.MEDIA_LAYER_GZIP, "sha256:" + "cd" * 32, 7, {wire.ANN_LAYER_SIZE: "10"})
    local = oci.json_bytes(oci.image_manifest(config, [oci.Descriptor(oci.MEDIA_LAYER_TAR, diff, 10)]))
    assert wire.rebuilt_manifest(config, [diff], [gz], what="c") == local
    other = oci.Descriptor(gz.media_type, gz.digest, 7, {wire.ANN_LAYER_SIZE: "11"})
    assert wire.rebuilt_manifest(config, [diff], [other], what="c") != local
    with pytest.raises(IntegrityError, match="one diff id per layer"):
        wire.rebuilt_manifest(config, [diff, diff], [gz], what="c")
    with pytest.raises(IntegrityError, match="is not gzip"):
        wire.rebuilt_manifest(config, [diff], [oci.Descriptor(oci.MEDIA_LAYER_TAR, diff, 10)], what="c")


def test_threads_follow_the_cpus_this_process_may_use():
    assert 1 <= wire._workers(None) <= min(len(os.sched_getaffinity(0)), wire.MAX_WORKERS)
    assert wire._workers(3) == 3


def test_push_refuses_an_unknown_compression_before_anything_else():
    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.build import CapsuleRef
    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.publish import push_capsule
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError

    ref = CapsuleRef("unit-0", "oci-layout", "sha256:" + "ab" * 32, "/nonexistent", 1)
    with pytest.raises(ColdSnapError, match=r"compression 'zstd' is unknown.*use one of gzip, none"):
        push_capsule(ref, "127.0.0.1:1/coldsnap/never", compression="zstd")
