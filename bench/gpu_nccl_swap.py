"""NCCL after a CUDA restore onto swapped GPUs (a diagnostic, no CRIU involved).

Standalone on a host with two GPUs (torch + cuda-python, as root). For each variant, two
rank processes (each sees only its own GPU, as units do) run an NCCL all-reduce, tear
NCCL down, get CUDA-checkpointed, restored with the two GPUs swapped (or not: the control
case), then build a fresh communicator and all-reduce again. Prints JSON: per variant
and rank, the reply, the error, and the PCI bus id CUDA reports before and after.

    python3 bench/gpu_nccl_swap.py [--out swap.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_snapshot import emit, setup_paths

VARIANTS = {
    "identity": ({}, False),
    "swapped": ({}, True),
    "swapped-p2p-off": ({"NCCL_P2P_DISABLE": "1"}, True),
    "swapped-cumem-off": ({"NCCL_CUMEM_ENABLE": "0"}, True),
    "swapped-p2p-shm-off": ({"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}, True),
}


def child(rank: int, store_dir: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    def ring(gen: int) -> dict:
        store = dist.FileStore(f"{store_dir}/store-{gen}", 2)
        torch.cuda.set_device(0)
        out = {"bus_id": torch.cuda.get_device_properties(0).pci_bus_id}
        try:
            dist.init_process_group("nccl", store=store, rank=rank, world_size=2,
                                    timeout=datetime.timedelta(seconds=60))
            x = torch.full((1024,), float(rank + 1), device="cuda")
            dist.all_reduce(x)
            torch.cuda.synchronize()
            out["sum"] = float(x[0].item())
            dist.barrier()
            dist.destroy_process_group()
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {str(exc)[-400:]}"
        return out

    first = ring(0)
    torch.cuda.empty_cache()
    print(json.dumps({"stage": "before", **first}), flush=True)
    if sys.stdin.readline().strip() != "restored":
        sys.exit(3)
    try:
        from cuda.bindings import runtime as rt

        bus = rt.cudaDeviceGetPCIBusId(32, 0)[1]
        live = bus.decode().rstrip("\x00") if isinstance(bus, bytes) else str(bus)
    except Exception as exc:
        live = f"n/a: {exc}"
    print(json.dumps({"stage": "after", "cudart_bus_id": live, **ring(1)}), flush=True)


def _reply(p: subprocess.Popen) -> dict:
    """The child's next JSON line (NCCL writes its own messages to stdout too)."""
    skipped = []
    for line in p.stdout:
        if line.startswith('{"stage"'):
            return json.loads(line)
        skipped.append(line.rstrip()[:200])
    return {"error": "child exited", "stdout": skipped[-5:]}


def run_variant(name: str, env_extra: dict, swap: bool, *, cuda, uuids: list[str], work: Path) -> dict:
    store_dir = tempfile.mkdtemp(prefix=f"{name}-", dir=work)
    procs = []
    for rank in range(2):
        env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": str(rank),
               "NCCL_NVLS_ENABLE": "0", "NCCL_DEBUG": "WARN", **env_extra}
        log = open(work / f"{name}-rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, __file__, "--child", str(rank), store_dir], env=env,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True), log))
    out: dict = {"env": env_extra, "swap": swap}
    try:
        for rank, (p, _log) in enumerate(procs):
            out[f"rank{rank}.before"] = _reply(p)
        t = time.perf_counter()
        for p, _log in procs:
            cuda.checkpoint(p.pid)
        out["checkpoint_s"] = round(time.perf_counter() - t, 3)
        remap = ({uuids[0]: uuids[1], uuids[1]: uuids[0]} if swap else None)
        t = time.perf_counter()
        for p, _log in procs:
            cuda.restore(p.pid, remap=remap)
            cuda.unlock(p.pid)
        out["restore_s"] = round(time.perf_counter() - t, 3)
        for p, _log in procs:
            p.stdin.write("restored\n")
            p.stdin.flush()
        for rank, (p, _log) in enumerate(procs):
            out[f"rank{rank}.after"] = _reply(p)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for p, log in procs:
            p.kill()
            p.wait()
            log.close()
    for rank in range(2):
        tail = (work / f"{name}-rank{rank}.log").read_text(errors="replace").splitlines()[-6:]
        out[f"rank{rank}.log_tail"] = tail
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.child:
        child(int(args.child[0]), args.child[1])
        return 0
    setup_paths()
    from ansible_collections.coldsnap.fleet.plugins.module_utils.process import cuda_checkpoint as cuda

    uuids = cuda.device_uuids()
    if len(uuids) < 2:
        print("needs two GPUs", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="coldsnap-nccl-swap-"))
    result = {"gpus": uuids[:2], "variants": {}}
    for name in args.variants.split(","):
        env_extra, swap = VARIANTS[name]
        result["variants"][name] = run_variant(name, env_extra, swap, cuda=cuda, uuids=uuids, work=work)
        print(json.dumps({name: result["variants"][name]}), file=sys.stderr, flush=True)
    return emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
