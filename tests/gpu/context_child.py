"""Helper process for the context-shrink test: a cuBLAS matmul, then shrink / restore on command."""

import sys

import torch
from coldsnap_engines.common import gpu_context

a = torch.randn(1024, 1024, device="cuda")
want = (a @ a).sum().item()
torch.cuda.synchronize()
print("ready", flush=True)
assert sys.stdin.readline().strip() == "shrink"
saved = gpu_context.shrink()
from cuda.bindings import driver as cu  # noqa: E402

print(f"shrunk {saved.stack_bytes} {int(cu.cuCtxGetLimit(cu.CUlimit.CU_LIMIT_STACK_SIZE)[1])}", flush=True)
assert sys.stdin.readline().strip() == "restore"
gpu_context.restore(saved)
got = (a @ a).sum().item()
print(f"restored {int(cu.cuCtxGetLimit(cu.CUlimit.CU_LIMIT_STACK_SIZE)[1])} {got == want}", flush=True)
