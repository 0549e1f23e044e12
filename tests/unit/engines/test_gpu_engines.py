"""GPU paths of the shared integration code (CUDA tensors, caching-allocator segments,
pinned readers/sinks, driver memset). Skipped without an NVIDIA GPU."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")


def _table_for(tensors):
    from coldsnap_engines.common.allocations import from_segments

    return from_segments(tensors, "weights")


def test_segments_table_observer_export_and_native_hydration_on_cuda(tmp_path):
    from coldsnap_engines.common import worker
    from coldsnap_engines.common.observer import LoadObserver, SourceIndex
    from engines_testlib import make_reference_model, model_identity, safetensors_iter

    model_dir = tmp_path / "model"
    ident = make_reference_model(model_dir)
    index = SourceIndex(model_dir)
    obs = LoadObserver()
    params = {}
    with obs:
        for name, full in safetensors_iter(model_dir):
            obs.register(full, index.lookup(name))
            params[name] = torch.empty(full.shape, dtype=full.dtype, device="cuda:0")
            params[name].copy_(full)
    torch.cuda.synchronize()
    table = _table_for(params.values())
    extents = obs.resolve(table)
    assert len(extents) == len(params)
    before = {k: v.cpu().clone() for k, v in params.items()}
    out = tmp_path / "w"
    payload = worker.export(table, extents, out, export_pack=True, state_root=str(tmp_path / "state"),
                            model=model_identity(ident), model_dir=model_dir)
    for t in params.values():
        t.zero_()
    torch.cuda.synchronize()
    spec = {"provider": "native", "manifest": str(out / "native-manifest.json"), "residual": str(out / "weights.blob"),
            "pack": {"path": str(tmp_path / "state" / payload["pack"]["path"]), "sha256": payload["pack"]["sha256"],
                     "size": payload["pack"]["size"]}}
    worker.hydrate(table, spec)
    torch.cuda.synchronize()
    assert all(torch.equal(before[k], v.cpu()) for k, v in params.items())


def test_zero_clears_cuda_allocations():
    pytest.importorskip("cuda.bindings")
    from coldsnap_engines.common.allocations import zero

    t = torch.full((1 << 20,), 7, dtype=torch.uint8, device="cuda:0")
    table = _table_for([t])
    zero(table)
    assert int(t.sum()) == 0
