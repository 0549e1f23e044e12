"""The load observer on the reference engine's real checkpoint and stable CPU arenas.

The reference loader records its extents explicitly; an engine we do not own is
observed instead. Both must yield the same model extents for the same load.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from coldsnap_engines.common.observer import (  # noqa: E402
    LoadObserver,
    RangeMap,
    SourceIndex,
    compose,
    relative_slice,
)
from engines_testlib import (  # noqa: E402
    arenas_for,
    make_reference_model,
    safetensors_iter,
    table_of,
    vllm_style_load,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref-model")
    make_reference_model(d)
    return d


def reference_extents(model_dir, rank, world):
    from coldsnap_engines.reference.config import ModelConfig
    from coldsnap_engines.reference.loader import load

    loaded = load(model_dir, ModelConfig.load(model_dir), rank=rank, world=world, device="cpu")
    return sorted(loaded.extents, key=lambda e: (e.allocation, e.offset))


@pytest.mark.parametrize(("rank", "world"), [(0, 1), (1, 2)])
def test_observed_extents_equal_the_reference_loaders_records(model_dir, rank, world):
    cfg, plan, arenas = arenas_for(model_dir, rank, world)
    obs = LoadObserver()
    vllm_style_load(model_dir, safetensors_iter(model_dir), plan, arenas, getattr(torch, cfg.dtype), observer=obs)
    got = obs.resolve(table_of(arenas))
    want = reference_extents(model_dir, rank, world)
    assert got == want
    assert obs.stats["recorded"] == len(want)
    if world > 1:
        assert any(e.source.slice and e.source.slice[0] == 1 for e in got), "row-parallel slices along dim 1"


def test_a_contiguous_copy_of_a_slice_keeps_its_source(model_dir):
    cfg, plan, arenas = arenas_for(model_dir, 1, 2)
    obs = LoadObserver()
    vllm_style_load(model_dir, safetensors_iter(model_dir), plan, arenas, getattr(torch, cfg.dtype), observer=obs,
                    contiguous_first=True)
    assert obs.resolve(table_of(arenas)) == reference_extents(model_dir, 1, 2)


def test_later_writes_demote_bytes_to_the_residual(model_dir):
    cfg, plan, arenas = arenas_for(model_dir, 0, 1)
    dtype = getattr(torch, cfg.dtype)
    obs = LoadObserver()
    vllm_style_load(model_dir, safetensors_iter(model_dir), plan, arenas, dtype, observer=obs)
    victims = plan[:3]
    with obs:
        # an in-place transform, an op writing through out=, and a fused overwrite by copy_ from
        # a non-checkpoint tensor: none of these bytes are the checkpoint's any more
        arenas["params"].tensor(victims[0].offset, victims[0].shape, dtype).mul_(2)
        t1 = arenas["params"].tensor(victims[1].offset, victims[1].shape, dtype)
        torch.add(t1, 1, out=t1)
        arenas["params"].tensor(victims[2].offset, victims[2].shape, dtype).copy_(torch.zeros(victims[2].shape))
    got = {(e.allocation, e.offset) for e in obs.resolve(table_of(arenas))}
    assert {("params", v.offset) for v in victims}.isdisjoint(got)
    assert len(got) == len(plan) - 3


def test_dtype_converted_and_unknown_sources_are_not_model_bytes(model_dir):
    _cfg, plan, arenas = arenas_for(model_dir, 0, 1)
    index = SourceIndex(model_dir)
    obs = LoadObserver()
    p = plan[0]
    with obs:
        for name, full in safetensors_iter(model_dir):
            if name == p.name:
                # the iterator handed over a converted tensor: it does not hold the file's bytes
                assert not obs.register(full.to(torch.float64), index.lookup(name))
                dest = arenas["params"].tensor(p.offset, p.shape, full.dtype)
                dest.copy_(full)
    assert obs.resolve(table_of(arenas)) == []
    assert obs.stats["unmatched_copies"] == 1


def test_writes_outside_the_stable_allocations_are_ignored(model_dir):
    index = SourceIndex(model_dir)
    obs = LoadObserver()
    name, full = next(iter(safetensors_iter(model_dir)))
    with obs:
        obs.register(full, index.lookup(name))
        torch.empty_like(full).copy_(full)
    assert len(obs.writes()) == 1
    _cfg, _plan, arenas = arenas_for(model_dir, 0, 1)
    assert obs.resolve(table_of(arenas)) == []


def test_relative_slice_geometry():
    # whole tensor, a dim-0 row range (contiguous), a dim-1 column range (strided)
    assert relative_slice((4, 6), 0, (4, 6), (6, 1), True) == (True, None)
    assert relative_slice((4, 6), 12, (2, 6), (6, 1), True) == (True, (0, 2, 4))
    assert relative_slice((4, 6), 2, (4, 3), (6, 1), False) == (True, (1, 2, 5))
    # a slice along two dims, a transposed view, a partial row: not expressible
    assert relative_slice((4, 6), 0, (2, 3), (6, 1), False)[0] is False
    assert relative_slice((4, 6), 0, (6, 4), (1, 6), False)[0] is False
    assert relative_slice((4, 6), 3, (3,), (1,), True)[0] is False
    assert compose((1, 2, 5), (1, 1, 2), (4, 6)) == (True, (1, 3, 4))
    assert compose((0, 0, 4), None, (4, 6)) == (True, None)
    assert compose((0, 1, 3), (1, 0, 2), (4, 6))[0] is False


def test_range_map_replaces_overlaps():
    m = RangeMap()
    m.insert(0, 10, "a")
    m.insert(10, 20, "b")
    m.insert(5, 12, "c")
    assert list(m.items()) == [(5, 12, "c")]
    assert m.containing(6, 12) == (5, "c")
    assert m.containing(4, 8) is None
    assert m.remove_overlapping(11, 30) == 1 and len(m) == 0
