"""On a GPU, a restore's sink page-locks its staging in the background from its creation on: the
fill that follows (its lanes start as their own staging is ready) lands every byte, says how much
staging was still running when it started, and a sink closed while its staging is still being
page-locked waits for it before it frees everything."""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.gpu]


def _pack(tmp_path, size: int) -> tuple[bytes, int]:
    data = os.urandom(size)
    path = tmp_path / "pack"
    path.write_bytes(data)
    return data, os.open(path, os.O_RDONLY)


def test_a_restore_sink_stages_ahead_and_fills_every_byte(tmp_path, native_fill_built):
    import torch
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import cuda_sink as pcuda
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.hydrate import FillJob, Piece

    size = 96 << 20
    data, fd = _pack(tmp_path, size)
    dst = torch.zeros(size, dtype=torch.uint8, device="cuda:0")
    try:
        with pcuda.CudaSink.for_restore({"a": dst.data_ptr()}, 0, sizes={"a": size}, threads=16) as sink:
            assert sink.engine == ("native" if native_fill_built else "python")
            half = size // 2
            sink.fill([FillJob("a", 0, half, (Piece(fd, 0, half),)),
                       FillJob("a", half, size - half, (Piece(fd, half, size - half),))])
            torch.cuda.synchronize()
            if native_fill_built:
                assert sink.staging_wait is not None and sink.staging_wait >= 0
    finally:
        os.close(fd)
    assert torch.equal(dst, torch.frombuffer(bytearray(data), dtype=torch.uint8).to("cuda:0"))


def test_a_restore_sink_closed_while_staging_frees_it(native_fill_built):
    import torch
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import cuda_sink as pcuda

    if not native_fill_built:
        pytest.skip("staging ahead of the fill is the native fill's (no C compiler here)")
    dst = torch.zeros(4096, dtype=torch.uint8, device="cuda:0")
    for _attempt in range(3):
        sink = pcuda.CudaSink.for_restore({"a": dst.data_ptr()}, 0, sizes={"a": 4096}, threads=8)
        sink.close()  # the helper may still be page-locking: close waits for it, then frees everything
        assert sink.native is None and sink.staging_wait is None
