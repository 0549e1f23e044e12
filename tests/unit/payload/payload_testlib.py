"""Shared builders for the payload tests: a small checkpoint, a worker's allocations, tree snapshots."""

from __future__ import annotations

import hashlib
import mmap
import os
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import (
    Allocation,
    ModelExtent,
    TensorSource,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.pack import (
    MemoryReader,
    WorkerPayload,
    write_worker_payload,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.safetensors import write_safetensors

MODEL = {"id": "coldsnap/reference-tiny", "revision": "0123456789abcdef0123456789abcdef01234567"}
BAD_DIGESTS = [
    "sha256:../x",
    "sha256:" + "A" * 64,  # upper-case hex
    "sha256:" + "a" * 63,  # wrong length
    "sha256:" + "a" * 65,
    "md5:" + "a" * 32,  # unknown algorithm
    "sha512:" + "a" * 128,
    "a" * 64,  # no algorithm
    "sha256:" + "../" * 21 + "a",
]
_NP = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_ITEM = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U8": 1}

# name: (dtype, shape, slice or None)
TENSORS = {
    "embed": ("F32", (64, 48), None),
    "qkv": ("BF16", (96, 32), (0, 32, 64)),
    "o_proj": ("F16", (32, 96), (1, 48, 96)),
    "conv": ("F32", (4, 6, 10), (1, 2, 5)),
    "pos": ("I64", (40,), None),
    "mask": ("U8", (100,), None),
    "idx": ("I32", (7, 9), None),
}


@dataclass
class Worker:
    """One worker as capture sees it."""

    allocations: list[Allocation]
    extents: list[ModelExtent]
    buffers: dict[str, bytearray]
    ckpt_dir: Path


def tensor_bytes(rng: random.Random, dtype: str, shape: tuple[int, ...]) -> bytes:
    n = int(np.prod(shape)) * _ITEM[dtype]
    return rng.randbytes(n)


def slice_bytes(raw: bytes, dtype: str, shape: tuple[int, ...], sl) -> bytes:
    """Reference slicing with numpy (dtype-agnostic: same item size)."""
    arr = np.frombuffer(raw, dtype=_NP[_ITEM[dtype]]).reshape(shape)
    if sl is None:
        return arr.tobytes()
    dim, start, stop = sl
    idx = [slice(None)] * len(shape)
    idx[dim] = slice(start, stop)
    return np.ascontiguousarray(arr[tuple(idx)]).tobytes()


def make_worker(tmp: Path, *, seed: int = 1, duplicate: bool = True, base: int = 0x7F0000000000,
                order: list[str] | None = None) -> Worker:
    """A checkpoint under tmp/ckpt and two allocations holding every tensor (a tied copy of 'embed').

    Residual gaps (random bytes) sit between and around the extents. ``order``
    permutes where tensors are placed; ``base`` moves the captured addresses.
    """
    rng = random.Random(seed)
    ckpt = tmp / "ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)
    raws = {name: tensor_bytes(rng, dt, shape) for name, (dt, shape, _sl) in TENSORS.items()}
    write_safetensors(ckpt / "model-00001-of-00002.safetensors",
                      {n: (TENSORS[n][0], TENSORS[n][1], raws[n]) for n in ("embed", "qkv", "o_proj")})
    write_safetensors(ckpt / "model-00002-of-00002.safetensors",
                      {n: (TENSORS[n][0], TENSORS[n][1], raws[n]) for n in ("conv", "pos", "mask", "idx")})
    file_of = {n: "model-00001-of-00002.safetensors" if n in ("embed", "qkv", "o_proj")
               else "model-00002-of-00002.safetensors" for n in TENSORS}
    names = order or list(TENSORS)
    placements: dict[str, list[tuple[str, bytes]]] = {"arena0": [], "arena1": []}
    for i, name in enumerate(names):
        dt, shape, sl = TENSORS[name]
        placements["arena0" if i % 2 == 0 else "arena1"].append((name, slice_bytes(raws[name], dt, shape, sl)))
    if duplicate:
        placements["arena1"].append(("embed", slice_bytes(raws["embed"], "F32", (64, 48), None)))
    buffers: dict[str, bytearray] = {}
    extents: list[ModelExtent] = []
    allocations: list[Allocation] = []
    addr = base
    for alloc_id, items in placements.items():
        buf = bytearray()
        for name, data in items:
            buf += rng.randbytes(rng.randrange(1, 300))  # residual before each tensor
            dt, shape, sl = TENSORS[name]
            extents.append(ModelExtent(alloc_id, len(buf), len(data),
                                       TensorSource(file_of[name], name, dt, shape, sl)))
            buf += data
        buf += rng.randbytes(77)
        buffers[alloc_id] = buf
        allocations.append(Allocation(alloc_id, addr, len(buf)))
        addr += (len(buf) + 0xFFFF) // 0x10000 * 0x10000 + 0x10000
    return Worker(allocations, extents, buffers, ckpt)


def capture(tmp: Path, worker: Worker, *, export: bool = True, name: str = "unit",
            state_root: Path | None = None, safetensors: bool = True) -> tuple[WorkerPayload, Path, NodeCache]:
    out = tmp / name
    cache = NodeCache(state_root or tmp / "state")
    wp = write_worker_payload(out, worker.allocations, worker.extents, MemoryReader(worker.buffers),
                              export_pack=export, cache=cache, model=MODEL,
                              safetensors_dir=worker.ckpt_dir if safetensors else None)
    return wp, out, cache


def flip_checkpoint_byte(worker: Worker) -> None:
    """Change one byte near the end of the first checkpoint file (a revision that is not the pinned one)."""
    f = worker.ckpt_dir / "model-00001-of-00002.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x10
    f.write_bytes(bytes(data))


def anon_views(worker: Worker, fill: int = 0xA5) -> dict[str, mmap.mmap]:
    """Fresh anonymous mappings (what the engine's arenas are after restore), pre-filled with a sentinel."""
    out = {}
    for a in worker.allocations:
        m = mmap.mmap(-1, a.size)
        m.write(bytes([fill]) * a.size)
        out[a.id] = m
    return out


def tree_snapshot(root: Path) -> dict[str, tuple]:
    """Every path under root with type, size, mode, mtime and content digest (check-mode comparisons)."""
    snap: dict[str, tuple] = {}
    if not root.exists():
        return snap
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
            snap[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns, digest)
    return snap


def write_pack_file(path: Path, data: bytes) -> str:
    """Write raw bytes as a pack file; return its digest."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return "sha256:" + hashlib.sha256(data).hexdigest()


def outcome_within(call: Callable[[], object], seconds: float, *, fifo: Path | None = None) -> BaseException | None:
    """Run ``call`` in a thread for at most ``seconds``: what it raised (None when it returned). A call still
    running then failed the test as blocked (a call blocked opening ``fifo`` is released first)."""
    import pytest

    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as exc:  # handed to the caller
            outcome.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # release the blocked open
            t.join(5)
        pytest.fail(f"{getattr(call, '__name__', 'the call')} blocked for {seconds:g} s")
    return outcome[0]
