"""CPU hydration without copying: the verified pack mapped copy-on-write over private arenas (payload.mapfill)."""

from __future__ import annotations

import errno
import hashlib
import os
import random

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import IntegrityError
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import mapfill
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.hydrate import (
    FillJob,
    MappingSink,
    MemorySink,
    Piece,
    hydrate_native,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import (
    Allocation,
    ModelExtent,
    TensorSource,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import PayloadVerifier
from coldsnap_engines.common import worker as engine_worker
from coldsnap_engines.common.allocations import AllocationTable, LiveAllocation
from coldsnap_engines.common.arena import CpuArena
from payload_testlib import Worker, capture

PAGE = mapfill.PAGE


def _worker(tmp_path, layout: dict[str, list[tuple[int, int]]], sizes: dict[str, int], *, seed: int = 3):
    """Allocations of ``sizes`` with model extents at (offset, size); every other byte is residual."""
    rng = random.Random(seed)
    buffers = {k: bytearray(rng.randbytes(n)) for k, n in sizes.items()}
    spans = [(k, off, n) for k, spans in layout.items() for off, n in spans]
    extents = [ModelExtent(k, off, n, TensorSource("model.safetensors", f"t{i}", "U8", (n,), None))
               for i, (k, off, n) in enumerate(spans)]
    allocs = [Allocation(k, 0x7F0000000000 + i * 0x1000000, n) for i, (k, n) in enumerate(sizes.items())]
    w = Worker(allocs, extents, buffers, tmp_path / "ckpt")
    wp, out, cache = capture(tmp_path, w, safetensors=False)
    return w, wp, out, cache


def _arenas(w) -> dict[str, CpuArena]:
    return {a.id: CpuArena(a.id, a.size) for a in w.allocations}


def _table(arenas: dict[str, CpuArena], private=None) -> AllocationTable:
    private = set(arenas) if private is None else set(private)
    return AllocationTable(LiveAllocation(a.id, "cpu", a.address, a.size, a.view(), private_mapping=a.id in private)
                           for a in arenas.values())


def _hydrate(w, wp, out, cache, sink):
    with PayloadVerifier().verify(cache, wp.pack.sha256, wp.pack.size) as v:
        return hydrate_native(out / "native-manifest.json", v, out / "weights.blob", sink)


def _pack_maps(path) -> list[tuple[int, int]]:
    return [(lo, hi) for lo, hi, _p, p in mapfill._maps() if p == str(path)]


def _digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(autouse=True)
def _no_leases_left():
    yield
    for lease in mapfill.leases():  # a failed test must not leak mappings into the next one
        for a, n in lease.ranges:
            mapfill.anonymize(a, n)
            mapfill.forget_range(a, n)
    assert mapfill.leases() == []


@pytest.fixture
def mixed(tmp_path):
    """a0: an aligned extent (mapped), one whose address and pack offset disagree (copied), one with
    a partial tail page (mapped + tail copied); a1: declared not a private mapping (copied)."""
    layout = {"a0": [(0, 4 * PAGE), (4 * PAGE + 256, 3 * PAGE + 100), (9 * PAGE, 2 * PAGE + 1808)],
              "a1": [(0, 2 * PAGE)]}
    return _worker(tmp_path, layout, {"a0": 16 * PAGE, "a1": 3 * PAGE + 77})


def test_aligned_pages_are_mapped_the_rest_copied(mixed):
    w, wp, out, cache = mixed
    arenas = _arenas(w)
    sink = _table(arenas, private=["a0"]).sink()
    assert isinstance(sink, MappingSink)
    stats = _hydrate(w, wp, out, cache, sink)
    for a in w.allocations:
        assert bytes(arenas[a.id].view()) == bytes(w.buffers[a.id])
    assert stats.fill == "map+python"
    assert stats.mapped_bytes == 4 * PAGE + 2 * PAGE
    for why in ("not page-aligned together", "partial pages", "a1 is not a private CPU mapping"):
        assert why in stats.map_fallback
    assert stats.as_dict()["mapped_bytes"] == stats.mapped_bytes
    pack = cache.path_for(wp.pack.sha256)
    a0 = arenas["a0"]
    maps = _pack_maps(pack)
    assert maps and all(a0.address <= lo and hi <= a0.address + a0.span for lo, hi in maps)
    assert sum(hi - lo for lo, hi in maps) == stats.mapped_bytes
    assert [lease.mapped_bytes for lease in mapfill.leases()] == [stats.mapped_bytes]
    for a in arenas.values():
        a.release()


def test_fully_aligned_model_is_all_mapped_in_one_mapping(tmp_path):
    layout = {"w": [(0, 2 * PAGE), (2 * PAGE, PAGE), (3 * PAGE, 5 * PAGE)]}
    w, wp, out, cache = _worker(tmp_path, layout, {"w": 9 * PAGE + 300})
    arenas = _arenas(w)
    stats = _hydrate(w, wp, out, cache, _table(arenas).sink())
    assert stats.fill == "map" and stats.map_fallback is None and stats.mapped_bytes == 8 * PAGE
    assert bytes(arenas["w"].view()) == bytes(w.buffers["w"])
    arenas["w"].release()


def test_plan_merges_runs_that_continue_each_other():
    fd = 99
    jobs = [FillJob("a", 0, 2 * PAGE, (Piece(fd, 8 * PAGE, 2 * PAGE),)),
            FillJob("a", 2 * PAGE, PAGE, (Piece(fd, 10 * PAGE, PAGE),)),
            FillJob("a", 3 * PAGE, PAGE, (Piece(fd, 20 * PAGE, PAGE),)),  # continues in memory, not in the file
            FillJob("a", 5 * PAGE, 100, (Piece(7, 0, 100),))]  # residual: copied, no reason
    runs, copies, reasons = mapfill.plan(jobs, {"a": (0x10000000, 8 * PAGE)}, fd)
    assert [(r.offset, r.size, r.file_offset) for r in runs] == [(0, 3 * PAGE, 8 * PAGE), (3 * PAGE, PAGE, 20 * PAGE)]
    assert [j.offset for j in copies] == [5 * PAGE] and reasons == {}
    runs, copies, reasons = mapfill.plan(jobs, {"a": (0x10000000, 8 * PAGE)}, fd, limit=1)
    assert runs == [] and sum(j.size for j in copies) == 4 * PAGE + 100 and list(reasons) == ["more than 1 mappings"]
    hashed = [FillJob("a", 0, PAGE, (Piece(fd, 0, PAGE),), "sha256:" + "0" * 64)]
    assert mapfill.plan(hashed, {"a": (0x10000000, PAGE)}, fd)[2] == {"hash-checked extent": PAGE}


def test_writing_a_mapped_tensor_never_changes_the_pack(mixed):
    w, wp, out, cache = mixed
    pack = cache.path_for(wp.pack.sha256)
    before, st = _digest(pack), os.stat(pack)
    arenas = _arenas(w)
    _hydrate(w, wp, out, cache, _table(arenas, private=["a0"]).sink())
    view = arenas["a0"].view()
    view[0:PAGE] = b"\x5a" * PAGE  # a mapped page: copy-on-write
    view[PAGE + 7] = 0x01
    assert bytes(view[0:PAGE]) == b"\x5a" * PAGE and view[PAGE + 7] == 0x01
    assert bytes(view[2 * PAGE:4 * PAGE]) == bytes(w.buffers["a0"][2 * PAGE:4 * PAGE])
    assert _digest(pack) == before
    after = os.stat(pack)
    assert (after.st_mtime_ns, after.st_ctime_ns, after.st_size) == (st.st_mtime_ns, st.st_ctime_ns, st.st_size)
    mapfill.check_leases()  # the pack is still the verified one
    for a in arenas.values():
        a.release()


def test_release_gives_anonymous_zeroed_memory_at_the_same_address(mixed):
    w, wp, out, cache = mixed
    pack = cache.path_for(wp.pack.sha256)
    arenas = _arenas(w)
    addresses = {k: a.address for k, a in arenas.items()}
    _hydrate(w, wp, out, cache, _table(arenas, private=["a0"]).sink())
    assert _pack_maps(pack) and mapfill.pack_references() and NodeCache.pack_in_use(pack)
    for a in arenas.values():
        a.release()
    for k, a in arenas.items():
        assert a.current_address() == addresses[k] and not a.resident
        assert bytes(a.view()) == bytes(a.size)
        assert mapfill.is_private_mapping(a.address, a.size)
    assert _pack_maps(pack) == [] and mapfill.pack_references() == [] and mapfill.leases() == []
    assert not NodeCache.pack_in_use(pack)
    engine_worker.check_released()
    # and hydrates again (a wake) at the same place
    stats = _hydrate(w, wp, out, cache, _table(arenas, private=["a0"]).sink())
    assert stats.mapped_bytes and bytes(arenas["a0"].view()) == bytes(w.buffers["a0"])
    for a in arenas.values():
        a.release()


def test_check_released_refuses_a_leftover_pack_mapping(mixed):
    w, wp, out, cache = mixed
    arenas = _arenas(w)
    _hydrate(w, wp, out, cache, _table(arenas, private=["a0"]).sink())
    with pytest.raises(Exception, match="still refers to model payloads"):
        engine_worker.check_released()
    for a in arenas.values():
        a.release()


def test_a_second_hydration_replaces_the_first_mapping(mixed):
    w, wp, out, cache = mixed
    arenas = _arenas(w)
    table = _table(arenas, private=["a0"])
    first = _hydrate(w, wp, out, cache, table.sink())
    second = _hydrate(w, wp, out, cache, table.sink())
    assert first.mapped_bytes == second.mapped_bytes
    assert [lease.mapped_bytes for lease in mapfill.leases()] == [second.mapped_bytes]
    assert bytes(arenas["a0"].view()) == bytes(w.buffers["a0"])
    for a in arenas.values():
        a.release()


def test_switched_off_copies_everything(mixed, monkeypatch):
    monkeypatch.setenv(mapfill.ENV_SWITCH, "0")
    w, wp, out, cache = mixed
    arenas = _arenas(w)
    stats = _hydrate(w, wp, out, cache, _table(arenas).sink())
    assert stats.fill == "python" and stats.mapped_bytes == 0 and "turned off" in stats.map_fallback
    assert _pack_maps(cache.path_for(wp.pack.sha256)) == []
    for a in w.allocations:
        assert bytes(arenas[a.id].view()) == bytes(w.buffers[a.id])


def test_failed_mmap_falls_back_to_the_copy(mixed, monkeypatch):
    def refuse(*_a):
        raise OSError(errno.ENODEV, "no mmap here")

    monkeypatch.setattr(mapfill, "map_file", refuse)
    w, wp, out, cache = mixed
    arenas = _arenas(w)
    stats = _hydrate(w, wp, out, cache, _table(arenas).sink())
    assert stats.fill == "python" and stats.mapped_bytes == 0 and "mmap of the pack failed (ENODEV)" in stats.map_fallback
    assert mapfill.leases() == []
    for a in w.allocations:
        assert bytes(arenas[a.id].view()) == bytes(w.buffers[a.id])


def test_only_private_writable_page_aligned_ranges_are_legal(tmp_path):
    import mmap

    arena = CpuArena("x", 3 * PAGE)
    assert mapfill.is_private_mapping(arena.address, arena.size)
    assert not mapfill.is_private_mapping(arena.address + 256, PAGE)
    shared = mmap.mmap(-1, PAGE, flags=mmap.MAP_SHARED)
    import ctypes

    addr = ctypes.addressof(ctypes.c_char.from_buffer(shared))
    assert not mapfill.is_private_mapping(addr, PAGE)
    # a sink whose allocations are not mappings of the process copies (a bytearray is no arena)
    buf = bytearray(2 * PAGE)
    sink = MappingSink({"b": buf}, {"b": (0x1000, 2 * PAGE)})
    assert sink._legal_regions()[0] == {}
    del addr


def test_memory_sink_is_kept_where_no_allocation_is_a_private_mapping(mixed):
    w, _wp, _out, _cache = mixed
    arenas = _arenas(w)
    sink = _table(arenas, private=[]).sink()
    assert isinstance(sink, MemorySink) and not isinstance(sink, MappingSink)


def _corrupt(path, at: int = 10) -> None:
    os.chmod(path, 0o600)
    with open(path, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0xFF]))


def test_pack_changed_between_verify_and_map_is_refused_and_undone(mixed):
    w, wp, out, cache = mixed
    pack = cache.path_for(wp.pack.sha256)
    arenas = _arenas(w)
    sink = _table(arenas, private=["a0"]).sink()
    with PayloadVerifier().verify(cache, wp.pack.sha256, wp.pack.size) as v:
        _corrupt(pack)
        with pytest.raises(IntegrityError, match="changed after it was verified"):
            hydrate_native(out / "native-manifest.json", v, out / "weights.blob", sink)
    assert mapfill.leases() == [] and _pack_maps(pack) == []
    view = arenas["a0"].view()
    assert bytes(view[0:4 * PAGE]) == bytes(4 * PAGE)  # the mapped pages are anonymous zeros again


def test_pack_changed_while_mapped_is_caught_before_export(mixed):
    w, wp, out, cache = mixed
    pack = cache.path_for(wp.pack.sha256)
    arenas = _arenas(w)
    _hydrate(w, wp, out, cache, _table(arenas, private=["a0"]).sink())
    engine_worker.check_mapped_packs()
    _corrupt(pack, at=PAGE + 3)
    with pytest.raises(IntegrityError, match="mapped into the engine's weights, changed"):
        engine_worker.check_mapped_packs()
    for a in arenas.values():
        a.release()


def test_unlinked_pack_stays_valid_while_mapped(mixed):
    """Deleting a mapped pack only changes its ctime: the mapped inode re-hashes to the verified digest."""
    w, wp, out, cache = mixed
    pack = cache.path_for(wp.pack.sha256)
    arenas = _arenas(w)
    _hydrate(w, wp, out, cache, _table(arenas, private=["a0"]).sink())
    os.unlink(pack)
    mapfill.check_leases()
    assert bytes(arenas["a0"].view()) == bytes(w.buffers["a0"])
    for a in arenas.values():
        a.release()
    assert mapfill.pack_references() == []


def test_pack_corrupted_on_disk_after_staging_never_reaches_the_weights(mixed):
    w, wp, out, cache = mixed
    pack = cache.path_for(wp.pack.sha256)
    _corrupt(pack, at=5)
    arenas = _arenas(w)
    with pytest.raises(IntegrityError):
        _hydrate(w, wp, out, cache, _table(arenas, private=["a0"]).sink())
    assert mapfill.leases() == []
    assert bytes(arenas["a0"].view()) == bytes(arenas["a0"].size)


def test_delete_keeps_a_pack_a_running_engine_maps(mixed):
    from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.leftovers import remove_local

    w, wp, out, cache = mixed
    pack = cache.path_for(wp.pack.sha256)
    arenas = _arenas(w)
    _hydrate(w, wp, out, cache, _table(arenas, private=["a0"]).sink())
    refs = [{"payloads": [{"sha256": wp.pack.sha256}]}]
    res = remove_local(cache.state_root, refs, keep_payloads=[], host="localhost")
    assert pack.exists() and "mapped by a running engine" in res["kept"]["payloads"][0]["reason"]
    for a in arenas.values():
        a.release()
    res = remove_local(cache.state_root, refs, keep_payloads=[], host="localhost")
    assert not pack.exists() and res["removed"]["payloads"]
