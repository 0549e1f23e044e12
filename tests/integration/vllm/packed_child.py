"""Run in vLLM's engine environment by test_vllm_packed_weights.py: vLLM's own CPU linear dispatch packs
three layers (one keeping its weight, as the LM head does), ColdSnap drops the packed copies and the
arena as before a snapshot, hydration refills the arena, and the copies are packed again. Prints JSON.
The weights' dtype is the first argument: bfloat16 (vLLM's CPU default) packs only with AVX-512; float32
packs with AVX2 too."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch
from coldsnap_engines.common.arena import free_host_memory
from coldsnap_engines.vllm import cpu_packed
from coldsnap_engines.vllm.cpu import relocate_parameters
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

DTYPE = getattr(torch, sys.argv[1])


class Linear(torch.nn.Module):
    def __init__(self, n: int, k: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, k, dtype=DTYPE), requires_grad=False)


def rss_anon() -> int:
    return int(re.search(r"RssAnon:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def forward(model) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [layer.cpu_linear(torch.randn(3, layer.k, dtype=DTYPE, generator=gen), layer.weight, None)
            for layer in model]


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(Linear(64, 512), Linear(4096, 2048), Linear(4096, 2048), Linear(8192, 1024))
    for layer in model:
        layer.k = layer.weight.shape[1]
    arena = relocate_parameters(model)
    for i, layer in enumerate(model):
        dispatch_cpu_unquantized_gemm(layer, remove_weight=i != 3)  # the last keeps its weight (LM head)
    # A layer whose weight is gone and that the arena does not know cannot be packed again: left alone.
    stray = Linear(4096, 1024)
    stray.k = 1024
    dispatch_cpu_unquantized_gemm(stray, remove_weight=True)
    model.append(stray)
    before = forward(model)

    copies = cpu_packed.find(model, arena.entries)
    saved = bytes(arena.arena.view())  # what the pack holds
    anon0 = rss_anon()
    freed = cpu_packed.release(copies)
    free_host_memory()
    anon1 = rss_anon()  # the copies alone
    arena.release()
    emptied = all((c.holder.untyped_storage().nbytes() == 0) if c.kind == "sgl" else int(c.holder.handler_tensor) == 0
                  for c in copies)
    arena.arena.view()[:] = saved  # hydration
    repacked = cpu_packed.repack(copies, arena.arena)
    same = [torch.equal(a, b) for a, b in zip(before, forward(model), strict=True)]
    cpu_packed.release(copies)  # a sleep after the restore, then wake
    arena.release()
    arena.arena.view()[:] = saved
    again = cpu_packed.repack(copies, arena.arena)
    same_again = [torch.equal(a, b) for a, b in zip(before, forward(model), strict=True)]
    print(json.dumps({"found": [[c.name, c.kind] for c in copies], "freed": freed, "emptied": emptied,
                      "anon_dropped": anon0 - anon1, "arena": arena.arena.size, "repacked": repacked,
                      "same": same, "again": again, "same_again": same_again,
                      "amx": bool(torch.cpu._is_amx_tile_supported()), "itemsize": DTYPE.itemsize}))


if __name__ == "__main__":
    main()
