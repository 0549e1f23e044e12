"""GPU hydration (CudaSink) and GPU capture (CudaReader); the GPU tests skip without an NVIDIA GPU."""

from __future__ import annotations

import importlib.util

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import cuda_sink as payload_cuda
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import native_fill
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.hydrate import (
    hydrate_native,
    hydrate_recovery,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.pack import write_pack_from_resident
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import PayloadVerifier
from payload_testlib import capture, make_worker

HAVE_CUDA_PYTHON = importlib.util.find_spec("cuda") is not None


def _gpu_present() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_gpu_present(), reason="a GPU is present")
def test_without_gpu_stack_the_error_is_clear():
    """No cuda-python -> 'needs cuda-python'; cuda-python without a driver -> 'NVIDIA driver'."""
    with pytest.raises(ColdSnapError, match="cuda-python" if not HAVE_CUDA_PYTHON else "NVIDIA driver"):
        payload_cuda.CudaSink({"a": 0}, 0)


def _device_buffers(w, torch):
    return {a.id: torch.full((a.size,), 0xA5, dtype=torch.uint8, device="cuda") for a in w.allocations}


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["native", "pread"])
def test_cuda_sink_native_and_recovery_match_the_capture(tmp_path, strategy):
    import torch

    if strategy == "native":
        native_fill.ensure_built()
    w = make_worker(tmp_path)
    wp, out, cache = capture(tmp_path, w)
    for provider in ("native", "recovery"):
        bufs = _device_buffers(w, torch)
        ptrs = {k: t.data_ptr() for k, t in bufs.items()}
        with payload_cuda.CudaSink(ptrs, torch.cuda.current_device(), threads=3, chunk=4096,
                                   strategy=strategy) as sink:
            assert sink.engine == ("native" if strategy == "native" else "python")
            if provider == "native":
                with PayloadVerifier().verify(cache, wp.pack.sha256, wp.pack.size) as v:
                    hydrate_native(out / "native-manifest.json", v, out / "weights.blob", sink)
            else:
                hydrate_recovery(out / "native-manifest.json", out / "replay-plan.json", w.ckpt_dir,
                                 out / "weights.blob", sink)
        torch.cuda.synchronize()
        for a in w.allocations:
            assert bytes(bufs[a.id].cpu().numpy()) == bytes(w.buffers[a.id]), (provider, a.id)


@pytest.mark.gpu
def test_cuda_sink_refuses_a_smaller_device_allocation(tmp_path):
    import torch

    w = make_worker(tmp_path)
    wp, out, cache = capture(tmp_path, w)
    sizes = {a.id: a.size for a in w.allocations}
    sizes[w.allocations[0].id] -= 1
    bufs = _device_buffers(w, torch)
    with payload_cuda.CudaSink({k: t.data_ptr() for k, t in bufs.items()}, sizes=sizes) as sink, \
            PayloadVerifier().verify(cache, wp.pack.sha256, wp.pack.size) as v, \
            pytest.raises(IntegrityError, match="size change"):
        hydrate_native(out / "native-manifest.json", v, out / "weights.blob", sink)


@pytest.mark.gpu
def test_cuda_reader_materializes_the_same_pack(tmp_path):
    import torch
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache

    w = make_worker(tmp_path)
    wp, out, _cache = capture(tmp_path, w)
    bufs = {a.id: torch.frombuffer(bytearray(w.buffers[a.id]), dtype=torch.uint8).cuda() for a in w.allocations}
    reader = payload_cuda.CudaReader({k: t.data_ptr() for k, t in bufs.items()}, torch.cuda.current_device())
    try:
        ref = write_pack_from_resident(out / "native-manifest.json", reader, NodeCache(tmp_path / "gpu-host"))
    finally:
        reader.close()
    assert ref == wp.pack
