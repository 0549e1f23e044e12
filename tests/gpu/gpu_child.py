"""Helper process for the CUDA fault tests: holds GPU memory, optionally keeps the GPU busy."""

import sys
import time

import torch

mode, gib = sys.argv[1], float(sys.argv[2])
x = torch.full((int(gib * (1 << 30)) // 4,), 7.0, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
if mode == "busy":
    while True:
        torch.cuda._sleep(4_000_000_000)  # a long kernel keeps the CUDA API busy
elif mode == "hold":
    while True:
        time.sleep(0.1)
        if x[0].item() != 7.0:
            print("corrupted", flush=True)
