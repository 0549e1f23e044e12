"""Capture side: pack determinism, duplicates, padding layout, builder refusals, materialization."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import replace

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import (
    PACK_ALIGNMENT,
    Allocation,
    ModelExtent,
    TensorSource,
    padded,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.manifest import (
    load_manifest,
    load_replay_plan,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.pack import (
    MemoryReader,
    write_pack_from_resident,
    write_worker_payload,
)
from payload_testlib import MODEL, TENSORS, capture, make_worker


def test_same_bytes_in_any_order_or_address_give_one_digest(tmp_path):
    digests = set()
    names = list(TENSORS)
    layouts = [(names, 0x7F0000000000), (names[::-1], 0x10000),
               (random.Random(5).sample(names, len(names)), 0x5550000000)]
    for i, (order, base) in enumerate(layouts):
        w = make_worker(tmp_path / f"w{i}", order=order, base=base)
        rng = random.Random(i)
        rng.shuffle(w.extents)  # observation order must not matter either
        w.allocations.reverse()  # nor allocation-map order
        wp, _out, _cache = capture(tmp_path / f"w{i}", w, state_root=tmp_path / f"state{i}")
        digests.add(wp.pack.sha256)
    assert len(digests) == 1


def test_pack_layout_padding_and_duplicates(tmp_path):
    w = make_worker(tmp_path, duplicate=True)
    wp, out, cache = capture(tmp_path, w)
    pack = cache.path_for(wp.pack.sha256).read_bytes()
    assert len(pack) % PACK_ALIGNMENT == 0 and len(pack) == wp.pack.size
    assert "sha256:" + hashlib.sha256(pack).hexdigest() == wp.pack.sha256
    m = load_manifest(out / "native-manifest.json")
    # every extent is written, duplicates included: the tied 'embed' copy appears twice
    assert len(m.model_extents) == len(w.extents) == len(TENSORS) + 1
    embed = [e for e in m.model_extents if e.size == 64 * 48 * 4]
    assert len(embed) == 2 and embed[0].sha256 == embed[1].sha256 and embed[0].pack_offset != embed[1].pack_offset
    pos = 0
    keys = []
    for e in m.model_extents:
        assert e.pack_offset == pos and e.pack_offset % PACK_ALIGNMENT == 0
        data = pack[e.pack_offset:e.pack_offset + e.size]
        assert "sha256:" + hashlib.sha256(data).hexdigest() == e.sha256
        assert data == bytes(w.buffers[e.allocation][e.offset:e.offset + e.size])
        assert pack[e.pack_offset + e.size:e.pack_offset + padded(e.size)] == bytes(padded(e.size) - e.size)
        keys.append((e.sha256, e.size))
        pos += padded(e.size)
    assert keys == sorted(keys) and pos == len(pack)
    assert any(e.size % PACK_ALIGNMENT for e in m.model_extents)


def test_last_extent_is_padded_too(tmp_path):
    data = {"a": bytearray(b"x" * 100 + b"r" * 50 + b"y" * 4100)}
    ext = [ModelExtent("a", 0, 100, TensorSource("m.safetensors", "x", "U8", (100,), None)),
           ModelExtent("a", 150, 4100, TensorSource("m.safetensors", "y", "U8", (4100,), None))]
    cache = NodeCache(tmp_path / "state")
    wp = write_worker_payload(tmp_path / "u", [Allocation("a", 0x1000, 4250)], ext, MemoryReader(data),
                              export_pack=True, cache=cache, model=MODEL)
    pack = cache.path_for(wp.pack.sha256).read_bytes()
    assert len(pack) == 4096 + 8192
    m = load_manifest(tmp_path / "u" / "native-manifest.json")
    last = m.model_extents[-1]
    assert pack[last.pack_offset + last.size:] == bytes(len(pack) - last.pack_offset - last.size)
    assert (tmp_path / "u" / "weights.blob").read_bytes() == b"r" * 50


def test_residual_holds_every_non_model_byte(tmp_path):
    w = make_worker(tmp_path)
    wp, out, _cache = capture(tmp_path, w)
    blob = (out / "weights.blob").read_bytes()
    m = load_manifest(out / "native-manifest.json")
    assert len(blob) == wp.residual_bytes == m.residual_bytes
    assert wp.model_bytes + wp.residual_bytes == sum(a.size for a in w.allocations)
    for e in m.residual_extents:
        assert blob[e.blob_offset:e.blob_offset + e.size] == bytes(w.buffers[e.allocation][e.offset:e.offset + e.size])
    assert wp.residual.sha256 == "sha256:" + hashlib.sha256(blob).hexdigest()
    fields = wp.artifact_fields("worker-0")
    assert fields["payload"] == {"owner": "worker-0", "size": wp.pack.size, "sha256": wp.pack.sha256,
                                 "path": f"model-payloads/sha256/{wp.pack.sha256[7:]}.pack"}
    for ref in ("residual", "manifest", "replay"):
        data = (out / fields[ref]["path"]).read_bytes()
        assert fields[ref]["sha256"] == "sha256:" + hashlib.sha256(data).hexdigest()


def test_replay_plan_pins_model_files_and_sources(tmp_path):
    w = make_worker(tmp_path)
    _wp, out, _cache = capture(tmp_path, w)
    plan = load_replay_plan(out / "replay-plan.json")
    assert plan.model == MODEL
    assert set(plan.files) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    for pin in plan.files.values():
        assert pin["size"] > 0 and pin["header_sha256"].startswith("sha256:")
    qkv = next(e for e in plan.extents if e.source.tensor == "qkv")
    assert qkv.source.slice == (0, 32, 64) and qkv.size == 32 * 32 * 2


def test_export_off_writes_no_pack_and_manifest_has_no_digest(tmp_path):
    w = make_worker(tmp_path)
    wp, out, cache = capture(tmp_path, w, export=False)
    assert wp.pack is None and wp.artifact_fields("w")["payload"] is None
    assert not cache.objects.exists() or not any(cache.objects.iterdir())
    m = load_manifest(out / "native-manifest.json")
    assert m.pack_sha256 is None and m.pack_size > 0


def test_materialization_reproduces_the_capture_digest(tmp_path):
    w = make_worker(tmp_path)
    wp, out, _cache = capture(tmp_path, w)
    other = NodeCache(tmp_path / "other-host")
    ref = write_pack_from_resident(out / "native-manifest.json", MemoryReader(w.buffers), other)
    assert ref == wp.pack
    assert other.path_for(ref.sha256).read_bytes() == _cache.path_for(ref.sha256).read_bytes()
    # without a bound digest (export was off) every extent is checked instead, same object
    _wp2, out2, _c2 = capture(tmp_path, w, export=False, name="unit2")
    third = NodeCache(tmp_path / "third-host")
    assert write_pack_from_resident(out2 / "native-manifest.json", MemoryReader(w.buffers), third) == wp.pack


def test_materialization_from_wrong_bytes_commits_nothing(tmp_path):
    w = make_worker(tmp_path)
    wp, out, _cache = capture(tmp_path, w)
    m = load_manifest(out / "native-manifest.json")
    e = m.model_extents[0]
    w.buffers[e.allocation][e.offset] ^= 0xFF
    other = NodeCache(tmp_path / "other-host")
    with pytest.raises(IntegrityError):
        write_pack_from_resident(m, MemoryReader(w.buffers), other)
    assert not other.contains(wp.pack.sha256)
    assert [p.name for p in other.objects.iterdir() if not p.name.endswith(".json")] == []


@pytest.mark.parametrize("problem", ["overlap", "past-end", "unknown-allocation", "size-vs-tensor", "bad-file"])
def test_builder_refuses_inconsistent_observations(tmp_path, problem):
    w = make_worker(tmp_path)
    e0 = w.extents[0]
    if problem == "overlap":
        w.extents.append(replace(w.extents[0], offset=e0.offset + 1))
    elif problem == "past-end":
        size = next(a.size for a in w.allocations if a.id == e0.allocation)
        w.extents[0] = replace(e0, offset=size - e0.size + 1)
    elif problem == "unknown-allocation":
        w.extents[0] = replace(e0, allocation="nope")
    elif problem == "size-vs-tensor":
        w.extents[0] = replace(e0, size=e0.size - 2)
    else:
        w.extents[0] = replace(e0, source=replace(e0.source, file="../etc/passwd"))
    with pytest.raises(IntegrityError):
        capture(tmp_path, w)
    assert not (tmp_path / "unit").exists(), "nothing may be written before the maps are known to be sound"


def test_builder_refuses_tensor_that_differs_from_checkpoint(tmp_path):
    w = make_worker(tmp_path)
    e0 = w.extents[0]
    w.extents[0] = replace(e0, source=replace(e0.source, dtype="I32" if e0.source.dtype == "F32" else "F32"))
    with pytest.raises(IntegrityError, match="observer recorded"):
        capture(tmp_path, w)


def test_builder_refuses_overlapping_allocations_and_bad_model(tmp_path):
    data = {"a": bytearray(8192), "b": bytearray(8192)}
    src = TensorSource("m.safetensors", "t", "U8", (16,), None)
    allocs = [Allocation("a", 0x1000, 8192), Allocation("b", 0x2000, 8192)]
    with pytest.raises(IntegrityError, match="overlap"):
        write_worker_payload(tmp_path / "o", allocs, [ModelExtent("a", 0, 16, src)], MemoryReader(data),
                             export_pack=False, cache=None, model=MODEL)
    allocs = [Allocation("a", 0x1000, 8192), Allocation("b", 0x10000, 8192)]
    with pytest.raises(ColdSnapError, match="revision"):
        write_worker_payload(tmp_path / "o", allocs, [ModelExtent("a", 0, 16, src)], MemoryReader(data),
                             export_pack=False, cache=None, model={"id": "org/m", "revision": "main"})


def test_bytes_changing_between_passes_fail_the_capture(tmp_path):
    w = make_worker(tmp_path)

    class Drifting(MemoryReader):
        """An engine that was not quiesced: after the first pass its weights change."""

        def __init__(self, views):
            super().__init__(views)
            self.reads = 0

        def read(self, allocation, offset, size):
            self.reads += 1
            if self.reads == len(w.extents) + 1:
                w.buffers[w.extents[0].allocation][w.extents[0].offset] ^= 1
            return super().read(allocation, offset, size)

    cache = NodeCache(tmp_path / "state")
    with pytest.raises(IntegrityError, match="changed while the pack was written"):
        write_worker_payload(tmp_path / "unit", w.allocations, w.extents, Drifting(w.buffers), export_pack=True,
                             cache=cache, model=MODEL)
    leftovers = [p.name for p in cache.objects.iterdir() if p.suffix == ".pack" or ".tmp-" in p.name]
    assert leftovers == []


def test_manifest_is_strict_json_with_versioned_kind(tmp_path):
    w = make_worker(tmp_path)
    _wp, out, _cache = capture(tmp_path, w)
    doc = json.loads((out / "native-manifest.json").read_text())
    assert doc["format"] == 1 and doc["kind"] == "coldsnap-native-manifest"
    plan = json.loads((out / "replay-plan.json").read_text())
    assert plan["format"] == 1 and plan["kind"] == "coldsnap-replay-plan"


def test_a_killed_writers_temps_are_removed_before_the_next_capture_needs_their_space(tmp_path):
    """A capture killed mid-write leaves its residual temp in the output directory and its pack temp in the
    cache; the next capture removes both first (on a full disk they hold the space it needs), but never a
    temp a live writer still holds."""
    import fcntl
    import os

    w = make_worker(tmp_path)
    out, cache = tmp_path / "unit", NodeCache(tmp_path / "state")
    out.mkdir()
    cache.ensure_dirs()
    dead_residual = out / ".weights.blob.tmp-0123456789ab"
    dead_manifest = out / ".native-manifest.json.tmp-0123456789ab"
    dead_pack = cache.objects / ".incoming.pack.tmp-0123456789ab"
    live_residual = out / ".weights.blob.tmp-live00000000"
    for path in (dead_residual, dead_manifest, dead_pack, live_residual):
        path.write_bytes(b"\0" * 8192)
    holder = os.open(live_residual, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        wp, out, cache = capture(tmp_path, w)
    finally:
        os.close(holder)
    assert not dead_residual.exists() and not dead_manifest.exists() and not dead_pack.exists()
    assert live_residual.exists()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [".weights.blob.tmp-live00000000", "native-manifest.json", "replay-plan.json", "weights.blob"])
    assert cache.contains(wp.pack.sha256)
