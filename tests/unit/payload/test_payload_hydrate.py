"""Hydration: native and recovery rebuild identical allocations; bad maps are refused before memory (FAULTS 8)."""

from __future__ import annotations

import json
import os

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    FormatError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.hydrate import (
    FillJob,
    MemorySink,
    Piece,
    hydrate_native,
    hydrate_recovery,
    load_manifest,
    split_jobs,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.safetensors import (
    SafetensorsFile,
    write_safetensors,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import PayloadVerifier
from payload_testlib import anon_views, capture, make_worker


@pytest.fixture
def captured(tmp_path):
    w = make_worker(tmp_path)
    wp, out, cache = capture(tmp_path, w)
    return w, wp, out, cache


def _untouched(views, w):
    return all(views[a.id][:] == bytes([0xA5]) * a.size for a in w.allocations)


def test_native_and_recovery_build_byte_identical_allocations(captured, tmp_path):
    w, wp, out, cache = captured
    native = anon_views(w, fill=0x11)
    with PayloadVerifier().verify(cache, wp.pack.sha256, wp.pack.size) as v:
        stats = hydrate_native(out / "native-manifest.json", v, out / "weights.blob", MemorySink(native, threads=2))
    assert stats.provider == "native" and stats.bytes == sum(a.size for a in w.allocations)
    assert stats.fill == "python"
    # recovery needs no pack at all
    os.unlink(cache.path_for(wp.pack.sha256))
    recovery = anon_views(w, fill=0x22)
    seen = []
    stats = hydrate_recovery(out / "native-manifest.json", out / "replay-plan.json", w.ckpt_dir,
                             out / "weights.blob", MemorySink(recovery, threads=2),
                             progress=lambda d, t: seen.append((d, t)))
    assert stats.provider == "recovery" and seen[-1][0] == seen[-1][1] == stats.bytes
    for a in w.allocations:
        assert native[a.id][:] == recovery[a.id][:] == bytes(w.buffers[a.id])


def test_recovery_refuses_a_checkpoint_that_is_not_the_pinned_one(captured):
    w, _wp, out, _cache = captured
    f = w.ckpt_dir / "model-00002-of-00002.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x40  # a tensor byte, header unchanged
    f.write_bytes(bytes(data))
    views = anon_views(w)
    with pytest.raises(IntegrityError, match="pinned revision"):
        hydrate_recovery(out / "native-manifest.json", out / "replay-plan.json", w.ckpt_dir, out / "weights.blob",
                         MemorySink(views, threads=1))


def test_recovery_refuses_a_different_header_before_touching_memory(captured):
    """Same tensor bytes, different file (a re-export): the pinned header digest tells them apart."""
    w, _wp, out, _cache = captured
    f = w.ckpt_dir / "model-00001-of-00002.safetensors"
    with SafetensorsFile(f) as st:
        tensors = {name: (t.dtype, t.shape, os.pread(st.fd, t.end - t.begin, t.begin))
                   for name, t in st.tensors.items()}
    write_safetensors(f, tensors, metadata={"format": "pt"})
    views = anon_views(w)
    with pytest.raises(IntegrityError, match=r"capture pinned|different safetensors header"):
        hydrate_recovery(out / "native-manifest.json", out / "replay-plan.json", w.ckpt_dir,
                         out / "weights.blob", MemorySink(views))
    assert _untouched(views, w)


def test_recovery_refuses_a_same_size_file_with_another_header(captured):
    w, _wp, out, _cache = captured
    f = w.ckpt_dir / "model-00002-of-00002.safetensors"
    data = f.read_bytes()
    f.write_bytes(data.replace(b'"mask"', b'"mast"', 1))
    views = anon_views(w)
    with pytest.raises(IntegrityError, match="different safetensors header"):
        hydrate_recovery(out / "native-manifest.json", out / "replay-plan.json", w.ckpt_dir,
                         out / "weights.blob", MemorySink(views))
    assert _untouched(views, w)


def test_residual_with_other_bytes_is_refused_before_memory(captured):
    w, wp, out, cache = captured
    blob = out / "weights.blob"
    data = bytearray(blob.read_bytes())
    data[0] ^= 1
    blob.write_bytes(bytes(data))
    views = anon_views(w)
    with PayloadVerifier().verify(cache, wp.pack.sha256, wp.pack.size) as v, \
            pytest.raises(IntegrityError, match="residual blob"):
        hydrate_native(out / "native-manifest.json", v, blob, MemorySink(views))
    assert _untouched(views, w)


def _mutate_manifest(out, fn):
    path = out / "native-manifest.json"
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))
    return path


def _gap(doc):
    doc["residual_extents"][0]["offset"] += 1
    doc["residual_extents"][0]["size"] -= 1


def _overlap(doc):
    doc["residual_extents"][0]["size"] += 1


def _past_end(doc):
    doc["residual_extents"][-1]["size"] += 1


def _alloc_grows(doc):
    doc["allocations"][0]["size"] += 4096


@pytest.mark.parametrize("mutate", [_gap, _overlap, _past_end, _alloc_grows])
def test_bad_maps_are_refused_before_touching_memory(captured, mutate):
    """FAULTS 8: gap, overlap, extent past the allocation end, size change."""
    w, wp, out, cache = captured
    path = _mutate_manifest(out, mutate)
    with pytest.raises(IntegrityError):
        load_manifest(path)
    views = anon_views(w)
    with PayloadVerifier().verify(cache, wp.pack.sha256, wp.pack.size) as v, pytest.raises(IntegrityError):
        hydrate_native(path, v, out / "weights.blob", MemorySink(views))
    assert _untouched(views, w)


def test_allocation_size_change_in_the_process_is_refused(captured):
    w, wp, out, cache = captured
    views = anon_views(w)
    a0 = w.allocations[0]
    import mmap

    views[a0.id] = mmap.mmap(-1, a0.size + 4096)
    views[a0.id].write(bytes([0xA5]) * (a0.size + 4096))
    with PayloadVerifier().verify(cache, wp.pack.sha256, wp.pack.size) as v, \
            pytest.raises(IntegrityError, match="size change"):
        hydrate_native(out / "native-manifest.json", v, out / "weights.blob", MemorySink(views))
    assert views[a0.id][:] == bytes([0xA5]) * (a0.size + 4096)
    del views[a0.id]
    with PayloadVerifier().verify(cache, wp.pack.sha256, wp.pack.size) as v, \
            pytest.raises(IntegrityError, match="missing"):
        hydrate_native(out / "native-manifest.json", v, out / "weights.blob", MemorySink(views))


def test_identity_change_of_the_pack_is_refused(captured, tmp_path):
    w, wp, out, cache = captured
    path = _mutate_manifest(out, lambda d: d["pack"].update(sha256="sha256:" + "1" * 64))
    with PayloadVerifier().verify(cache, wp.pack.sha256, wp.pack.size) as v, \
            pytest.raises(IntegrityError, match="binds"):
        hydrate_native(path, v, out / "weights.blob", MemorySink(anon_views(w)))
    with pytest.raises(ColdSnapError, match="needs the verified model payload"):
        hydrate_native(path, None, out / "weights.blob", MemorySink(anon_views(w)))


def test_non_canonical_pack_layout_is_refused(captured):
    _w, _wp, out, _cache = captured
    path = _mutate_manifest(out, lambda d: d["model_extents"].reverse())
    with pytest.raises(IntegrityError):
        load_manifest(path)


@pytest.mark.parametrize("edit", ["unknown-field", "duplicate-key", "wrong-kind", "bad-digest"])
def test_manifest_decoding_is_strict(captured, edit):
    _w, _wp, out, _cache = captured
    path = out / "native-manifest.json"
    text = path.read_text()
    if edit == "unknown-field":
        text = text.replace('"format": 1', '"format": 1, "extra": true', 1)
    elif edit == "duplicate-key":
        text = text.replace('"format": 1', '"format": 1, "format": 1', 1)
    elif edit == "wrong-kind":
        text = text.replace("coldsnap-native-manifest", "coldsnap-replay-plan")
    else:
        text = text.replace('"sha256": "sha256:', '"sha256": "sha256:X', 1)
    path.write_text(text)
    with pytest.raises(FormatError):
        load_manifest(path)


def test_replay_plan_must_match_the_manifest(captured):
    w, _wp, out, _cache = captured
    plan = out / "replay-plan.json"
    doc = json.loads(plan.read_text())
    doc["extents"] = doc["extents"][1:]
    plan.write_text(json.dumps(doc))
    views = anon_views(w)
    with pytest.raises(IntegrityError, match="does not rebuild"):
        hydrate_recovery(out / "native-manifest.json", plan, w.ckpt_dir, out / "weights.blob", MemorySink(views))
    assert _untouched(views, w)


def test_split_jobs_keeps_byte_order(tmp_path):
    f = tmp_path / "src"
    f.write_bytes(bytes(range(256)) * 64)
    fd = os.open(f, os.O_RDONLY)
    try:
        job = FillJob("a", 5, 100 + 3000, (Piece(fd, 0, 100), Piece(fd, 1000, 3000)))
        parts = split_jobs([job], chunk=512)
        assert sum(p.size for p in parts) == job.size and all(p.size <= 512 for p in parts)
        assert [p.offset for p in parts] == list(range(5, 5 + job.size, 512))
        buf = bytearray(5 + job.size)
        MemorySink({"a": buf}, threads=2).fill(parts)
        src = f.read_bytes()
        assert bytes(buf[5:]) == src[:100] + src[1000:4000]
    finally:
        os.close(fd)
