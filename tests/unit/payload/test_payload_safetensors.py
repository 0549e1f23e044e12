"""The stdlib safetensors reader against files written by the real safetensors library."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import IntegrityError
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import slice_geometry
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.safetensors import (
    SafetensorsFile,
    slice_ranges,
)
from safetensors.torch import save_file

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
          "I32": torch.int32, "U8": torch.uint8}


def _tensor(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 200, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_slices_along_every_dim_match_torch(tmp_path, name):
    dtype = DTYPES[name]
    shape = (6, 5, 4)
    t = _tensor(dtype, shape, seed=len(name))
    path = tmp_path / "m.safetensors"
    save_file({"w": t, "other": _tensor(torch.float32, (3,), 9)}, str(path))
    with SafetensorsFile(path) as st:
        info = st.tensor("w")
        assert (info.dtype, info.shape) == (name, shape)
        for sl in [None, (0, 1, 4), (1, 0, 5), (1, 2, 3), (2, 1, 3), (2, 0, 4)]:
            ranges = slice_ranges(info, sl)
            got = b"".join(os.pread(st.fd, n, off) for off, n in ranges)
            ref = t if sl is None else t.narrow(sl[0], sl[1], sl[2] - sl[1])
            assert got == ref.contiguous().view(torch.uint8).numpy().tobytes(), (name, sl)
            assert len(got) == slice_geometry(name, shape, sl)[3]
        assert len(slice_ranges(info, (0, 1, 4))) == 1, "dim-0 slices are one contiguous range"


def test_scalar_and_empty_tensors(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"s": torch.tensor(3.5), "e": torch.zeros((0, 4))}, str(path))
    with SafetensorsFile(path) as st:
        s = st.tensor("s")
        assert s.shape == () and b"".join(os.pread(st.fd, n, o) for o, n in slice_ranges(s, None)) == \
            np.float32(3.5).tobytes()
        assert slice_ranges(st.tensor("e"), None) == []


@pytest.mark.parametrize("damage", ["short", "huge-header", "not-json", "bad-offsets", "dup"])
def test_malformed_files_are_refused(tmp_path, damage):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(4)}, str(path))
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    if damage == "short":
        data = data[:5]
    elif damage == "huge-header":
        data = (10**12).to_bytes(8, "little") + data[8:]
    elif damage == "not-json":
        data = data[:8] + b"{" * n + data[8 + n:]
    elif damage == "bad-offsets":
        data = data.replace(b"[0,16]", b"[0,32]")
    else:
        header = b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},' \
                 b'"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'
        data = len(header).to_bytes(8, "little") + header + bytes(16)
    path.write_bytes(data)
    with pytest.raises(IntegrityError):
        SafetensorsFile(path)


def test_unknown_tensor_is_named(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(4)}, str(path))
    with SafetensorsFile(path) as st, pytest.raises(IntegrityError, match="no tensor 'x'"):
        st.tensor("x")


def test_a_named_pipe_under_a_checkpoints_name_is_refused_without_hanging(tmp_path):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(IntegrityError, match="is not a regular file"):
        SafetensorsFile(fifo)  # no writer ever opens the pipe: a blocking open would wait forever
