"""The native fill (native/fill.c) on a CPU-only host: the same C pipeline, ending in memcpy instead of a DMA.

Each test builds the library from source into its own directory (the builder is part of what is
tested) and points ``COLDSNAP_NATIVE_LIB`` at it. The device path (staging slots reused only after
their copy's event) is exercised on a GPU by tests/unit/payload/test_payload_cuda.py and
bench/gpu_hydration.py.
"""

from __future__ import annotations

import ctypes
import os
import random
import time
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import native_fill
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.hydrate import (
    FillJob,
    Piece,
    _check_ids_sizes,
    hydrate_native,
    hydrate_recovery,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import PayloadVerifier
from payload_testlib import capture, flip_checkpoint_byte, make_worker

pytestmark = pytest.mark.cc


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return native_fill.build(tmp_path_factory.mktemp("native") / "libcoldsnap_fill.so")


@pytest.fixture
def lib(built, monkeypatch):
    """Point the loader at the test's build; each NativeLanes takes its own reference (load())."""
    monkeypatch.setenv(native_fill.ENV_LIB, str(built))
    return built


def _mapped(path: Path) -> bool:
    return str(path) in Path("/proc/self/maps").read_text()


class HostSink:
    """AllocationSink over host buffers through the native pipeline (what CudaSink does with a device)."""

    engine = "native"

    def __init__(self, buffers: dict[str, ctypes.Array], *, threads: int, chunk: int, slots: int) -> None:
        self.buffers = buffers
        self.lanes = native_fill.NativeLanes(native_fill.load(), None, threads=threads, chunk=chunk, slots=slots)

    def check_allocations(self, allocations) -> None:
        _check_ids_sizes({k: len(v) for k, v in self.buffers.items()}, allocations)

    def fill(self, jobs, *, progress=None) -> None:
        self.lanes.fill(jobs, {k: ctypes.addressof(v) for k, v in self.buffers.items()}, progress=progress)


@pytest.mark.parametrize(("threads", "chunk", "slots"), [(1, 4096, 1), (3, 4096, 2), (4, 3 * 4096 + 512, 2),
                                                         (2, 1 << 20, 8)])
def test_hydrate_native_through_the_native_pipeline_gives_the_captured_bytes(tmp_path, lib, threads, chunk, slots):
    w = make_worker(tmp_path)
    wp, out, cache = capture(tmp_path, w)
    buffers = {a.id: (ctypes.c_ubyte * a.size)(*([0xA5] * a.size)) for a in w.allocations}
    sink = HostSink(buffers, threads=threads, chunk=chunk, slots=slots)
    seen: list[tuple[int, int]] = []
    try:
        with PayloadVerifier().verify(cache, wp.pack.sha256, wp.pack.size) as v:
            stats = hydrate_native(out / "native-manifest.json", v, out / "weights.blob", sink,
                                   progress=lambda d, t: seen.append((d, t)))
    finally:
        sink.lanes.close()
    for a in w.allocations:
        assert bytes(buffers[a.id]) == bytes(w.buffers[a.id]), a.id
    total = sum(a.size for a in w.allocations)
    assert seen and seen[-1] == (total, total)
    assert stats.as_dict()["fill"] == "native"  # recorded in the restore's engine.hydrate span
    assert [d for d, _t in seen] == sorted(d for d, _t in seen)


def test_staging_allocated_ahead_of_the_fill_is_the_staging_the_fill_uses(tmp_path, lib):
    """A restore stages while it still checks the payload; the fill then copies through those slots."""
    w = make_worker(tmp_path)
    wp, out, cache = capture(tmp_path, w)
    buffers = {a.id: (ctypes.c_ubyte * a.size)() for a in w.allocations}
    sink = HostSink(buffers, threads=3, chunk=4096, slots=2)
    try:
        sink.lanes.stage()
        sink.lanes.stage()  # staging already there: nothing more is allocated
        with PayloadVerifier().verify(cache, wp.pack.sha256, wp.pack.size) as v:
            hydrate_native(out / "native-manifest.json", v, out / "weights.blob", sink)
    finally:
        sink.lanes.close()
    for a in w.allocations:
        assert bytes(buffers[a.id]) == bytes(w.buffers[a.id]), a.id
    with pytest.raises(ColdSnapError, match="after close"):
        sink.lanes.stage()


def test_a_fill_started_while_its_staging_is_still_allocated_lands_every_byte(tmp_path, lib):
    """A restore's fill does not wait for the whole ring: each fill thread waits for its own lane's
    staging, then copies; the staging's end time is reported once, and close() after a started
    staging (never waited for) frees it."""
    w = make_worker(tmp_path)
    wp, out, cache = capture(tmp_path, w)
    for attempt in range(20):
        buffers = {a.id: (ctypes.c_ubyte * a.size)() for a in w.allocations}
        sink = HostSink(buffers, threads=16, chunk=4096, slots=8)
        try:
            before = time.monotonic()
            sink.lanes.stage_start()
            sink.lanes.stage_start()  # already staging: nothing more starts
            with PayloadVerifier().verify(cache, wp.pack.sha256, wp.pack.size) as v:
                hydrate_native(out / "native-manifest.json", v, out / "weights.blob", sink)
            ended = sink.lanes.stage_wait()
            assert ended is not None and before <= ended <= time.monotonic()
            assert sink.lanes.stage_wait() is None  # joined once: nothing is left to wait for
            if attempt % 2:
                sink.lanes.stage_start()  # closed while (maybe) still staging: close waits, then frees
        finally:
            sink.lanes.close()
        for a in w.allocations:
            assert bytes(buffers[a.id]) == bytes(w.buffers[a.id]), (attempt, a.id)
    with pytest.raises(ColdSnapError, match="after close"):
        sink.lanes.stage_start()


def test_pieces_from_several_files_land_contiguously(tmp_path, lib):
    rnd = random.Random(7)
    a, b = os.urandom(300_001), os.urandom(77_777)
    (tmp_path / "a").write_bytes(a)
    (tmp_path / "b").write_bytes(b)
    fa, fb = os.open(tmp_path / "a", os.O_RDONLY), os.open(tmp_path / "b", os.O_RDONLY)
    try:
        want, pieces = bytearray(), []
        for _i in range(200):  # odd sizes and offsets, alternating files
            fd, data = (fa, a) if rnd.random() < 0.5 else (fb, b)
            off = rnd.randrange(len(data) - 5000)
            n = rnd.randrange(1, 5000)
            pieces.append(Piece(fd, off, n))
            want += data[off:off + n]
        dst = (ctypes.c_ubyte * (len(want) + 100))()
        job = FillJob("x", 100, len(want), tuple(pieces))
        plan = native_fill.Plan([job], {"x": ctypes.addressof(dst)}, 8192)
        sizes = [sum(plan.pieces[i].size for i in range(plan.starts[g], plan.starts[g + 1]))
                 for g in range(plan.groups)]
        assert plan.groups > 10 and max(sizes) == 8192 and sum(sizes) == len(want)
        with native_fill.NativeLanes(native_fill.load(), None, threads=4, chunk=8192) as lanes:
            lanes.fill([job], {"x": ctypes.addressof(dst)})
        assert bytes(dst)[100:] == bytes(want) and bytes(dst)[:100] == bytes(100)
    finally:
        os.close(fa)
        os.close(fb)


def test_a_truncated_source_is_an_integrity_error_naming_the_file(tmp_path, lib):
    (tmp_path / "pack").write_bytes(os.urandom(50_000))
    fd = os.open(tmp_path / "pack", os.O_RDONLY)
    dst = (ctypes.c_ubyte * 64_000)()
    try:
        with native_fill.NativeLanes(native_fill.load(), None, threads=2, chunk=16384) as lanes, \
                pytest.raises(IntegrityError, match=r"model-weights\.pack ended after 50000 bytes .*re-stage"):
            lanes.fill([FillJob("x", 0, 64_000, (Piece(fd, 0, 64_000),), None, "model-weights.pack")],
                       {"x": ctypes.addressof(dst)})
    finally:
        os.close(fd)


def test_a_read_error_names_the_source_and_errno(tmp_path, lib):
    fd = os.open(tmp_path, os.O_RDONLY)  # a directory: pread fails with EISDIR
    dst = (ctypes.c_ubyte * 8192)()
    try:
        with native_fill.NativeLanes(native_fill.load(), None, threads=1, chunk=8192) as lanes, \
                pytest.raises(native_fill.FillFailure, match=r"reading weights\.blob at 0 failed: Is a directory"):
            lanes.fill([FillJob("x", 0, 8192, (Piece(fd, 0, 8192),), None, "weights.blob")],
                       {"x": ctypes.addressof(dst)})
    finally:
        os.close(fd)


def test_out_of_range_settings_are_refused_with_the_limits(lib):
    for kwargs in ({"threads": 0}, {"threads": 65}, {"threads": 1, "slots": 9}, {"threads": 1, "chunk": 100}):
        with pytest.raises(ColdSnapError, match="use 1-64 threads, 1-8 slots, chunks of at least 4 KiB"):
            native_fill.NativeLanes(native_fill.load(), None, **kwargs)


@pytest.mark.parametrize(("threads", "chunk"), [(1, 4096), (3, 4096), (2, 1 << 20)])
def test_hydrate_recovery_hashes_the_copied_bytes_natively(tmp_path, lib, threads, chunk):
    w = make_worker(tmp_path)
    _wp, out, _cache = capture(tmp_path, w)
    buffers = {a.id: (ctypes.c_ubyte * a.size)() for a in w.allocations}
    sink = HostSink(buffers, threads=threads, chunk=chunk, slots=2)
    try:
        assert sink.lanes.hashes, "OpenSSL's libcrypto is on every supported host (Python's hashlib uses it)"
        hydrate_recovery(out / "native-manifest.json", out / "replay-plan.json", w.ckpt_dir, out / "weights.blob",
                         sink)
    finally:
        sink.lanes.close()
    for a in w.allocations:
        assert bytes(buffers[a.id]) == bytes(w.buffers[a.id]), a.id


def test_a_wrong_checkpoint_fails_the_native_hash_check(tmp_path, lib):
    w = make_worker(tmp_path)
    _wp, out, _cache = capture(tmp_path, w)
    flip_checkpoint_byte(w)
    buffers = {a.id: (ctypes.c_ubyte * a.size)() for a in w.allocations}
    sink = HostSink(buffers, threads=2, chunk=4096, slots=2)
    try:
        with pytest.raises(IntegrityError, match=r"hashes to sha256:[0-9a-f]{64}, the capture recorded .*pinned"):
            hydrate_recovery(out / "native-manifest.json", out / "replay-plan.json", w.ckpt_dir,
                             out / "weights.blob", sink)
    finally:
        sink.lanes.close()


def test_each_hashed_job_is_checked_against_its_own_digest(tmp_path, lib):
    """Jobs of several sizes (filled largest first), each spanning slots and two files."""
    import hashlib

    a, b = os.urandom(200_000), os.urandom(90_000)
    (tmp_path / "a").write_bytes(a)
    (tmp_path / "b").write_bytes(b)
    fa, fb = os.open(tmp_path / "a", os.O_RDONLY), os.open(tmp_path / "b", os.O_RDONLY)
    try:
        jobs, pos, want = [], 0, b""
        for i, (n_a, n_b) in enumerate([(5_000, 100), (150_000, 80_000), (1, 1), (30_000, 0)]):
            pieces = (Piece(fa, i * 7, n_a),) + ((Piece(fb, i * 3, n_b),) if n_b else ())
            data = a[i * 7:i * 7 + n_a] + b[i * 3:i * 3 + n_b]
            jobs.append(FillJob("x", pos, n_a + n_b, pieces, "sha256:" + hashlib.sha256(data).hexdigest(), f"t{i}"))
            pos += n_a + n_b
            want += data
        dst = (ctypes.c_ubyte * pos)()
        ptrs = {"x": ctypes.addressof(dst)}
        with native_fill.NativeLanes(native_fill.load(), None, threads=3, chunk=8192) as lanes:
            lanes.fill(jobs, ptrs)
            assert bytes(dst) == want
            bad = list(jobs)
            bad[2] = FillJob("x", jobs[2].offset, jobs[2].size, jobs[2].pieces, "sha256:" + "0" * 64, "t2")
            with pytest.raises(IntegrityError, match=r"^t2 -> x\["):
                lanes.fill(bad, ptrs)
    finally:
        os.close(fa)
        os.close(fb)


def test_an_empty_hashed_extent_hashes_to_the_empty_digest(tmp_path, lib):
    (tmp_path / "f").write_bytes(b"abc")
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    dst = (ctypes.c_ubyte * 3)()
    empty = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    abc = "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    try:
        with native_fill.NativeLanes(native_fill.load(), None, threads=2, chunk=4096) as lanes:
            lanes.fill([FillJob("x", 3, 0, (), empty, "empty"), FillJob("x", 0, 3, (Piece(fd, 0, 3),), abc, "abc")],
                       {"x": ctypes.addressof(dst)})
        assert bytes(dst) == b"abc"
    finally:
        os.close(fd)


def test_hashed_and_plain_jobs_are_planned_apart():
    job = FillJob("x", 0, 10, (Piece(0, 0, 10),), "sha256:" + "0" * 64, "model.safetensors:w")
    with pytest.raises(ColdSnapError, match=r"model\.safetensors:w is hash-checked"):
        native_fill.Plan([job], {"x": 0}, 4096)
    with pytest.raises(ColdSnapError, match=r"plain is not hash-checked"):
        native_fill.Plan([FillJob("x", 0, 10, (Piece(0, 0, 10),), None, "plain")], {"x": 0}, 4096, hashed=True)


def test_without_libcrypto_hashed_jobs_are_refused_so_cudasink_keeps_them(lib):
    with native_fill.NativeLanes(native_fill.load(), None, threads=1, chunk=4096) as lanes:
        lanes.hashes = False  # what a host without OpenSSL's libcrypto reports
        with pytest.raises(ColdSnapError, match=r"cannot hash here .*Python loop"):
            lanes.fill([FillJob("x", 0, 10, (Piece(0, 0, 10),), "sha256:" + "0" * 64, "w")], {"x": 0})


def test_close_unloads_the_library(lib):
    """A restored engine closes its sink after hydration: no mapping of the library may reach a later snapshot."""
    lanes = native_fill.NativeLanes(native_fill.load(), None, threads=1, chunk=4096)
    assert _mapped(lib)
    lanes.close()
    lanes.close()  # idempotent
    assert not _mapped(lib)
    with pytest.raises(ColdSnapError, match="after close"):
        lanes.fill([], {})


def test_build_names_the_library_by_the_source_digest(tmp_path):
    src = tmp_path / "native" / "fill.c"
    src.parent.mkdir()
    src.write_bytes(native_fill.source_path().read_bytes())
    first = native_fill.default_library_path(src)
    assert first is not None and first.parent == src.parent / "build"
    assert native_fill.build(source=src) == first and first.is_file()
    src.write_bytes(src.read_bytes() + b"\n/* changed */\n")
    assert native_fill.default_library_path(src) != first, "a changed source must not load the old build"
    assert [p.name for p in first.parent.iterdir()] == [first.name], "no temporary file is left behind"


def test_an_abi_mismatch_is_refused(tmp_path, monkeypatch):
    src = tmp_path / "fill.c"
    src.write_text("#define CS_ABI 99\n" + native_fill.source_path().read_text())
    other = native_fill.build(tmp_path / "libother.so", source=src)
    monkeypatch.setenv(native_fill.ENV_LIB, str(other))
    with pytest.raises(ColdSnapError, match=f"has ABI 99, this code needs {native_fill.ABI}"):
        native_fill.load()
    assert not _mapped(other)


def test_without_a_compiler_the_error_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(ColdSnapError, match=r"needs a C compiler.*apt-get install gcc"):
        native_fill.build(tmp_path / "lib.so")


def test_a_compile_error_leaves_no_library(tmp_path):
    src = tmp_path / "fill.c"
    src.write_text("this is not C\n")
    with pytest.raises(ColdSnapError, match=r"compiling .* failed"):
        native_fill.build(tmp_path / "lib.so", source=src)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fill.c"]


def test_an_unloadable_library_named_by_the_environment_is_an_error(tmp_path, monkeypatch):
    bad = tmp_path / "lib.so"
    bad.write_bytes(b"not an ELF file")
    monkeypatch.setenv(native_fill.ENV_LIB, str(bad))
    assert native_fill.ensure_built() == bad  # named explicitly: nothing is built
    with pytest.raises(ColdSnapError, match=f"cannot be loaded.*unset {native_fill.ENV_LIB}"):
        native_fill.load()


def test_load_without_a_build_is_none_so_the_python_path_runs(tmp_path, monkeypatch):
    monkeypatch.delenv(native_fill.ENV_LIB, raising=False)
    monkeypatch.setattr(native_fill, "source_path", lambda: tmp_path / "native" / "fill.c")
    assert native_fill.load() is None  # no source at all (an installed collection without native/)
    src = tmp_path / "native" / "fill.c"
    src.parent.mkdir()
    src.write_bytes(Path(native_fill.__file__).resolve().parents[3].joinpath("native", "fill.c").read_bytes())
    assert native_fill.load() is None  # a source, not built
    assert native_fill.ensure_built() == native_fill.default_library_path(src)
    lib = native_fill.load()
    assert lib is not None and native_fill.default_library_path(src).is_file()
    native_fill.unload(lib)
