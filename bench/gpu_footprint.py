"""What a GPU engine process carries into a snapshot, step by step (a diagnostic).

Standalone on a GPU host (plain ``python3`` with torch + cuda-python, as root): runs one
reference-engine worker (TP1) in a child process and, at each lifecycle step (CUDA
initialised, ready, quiesced, exported, released and shrunk), reports the
child's anonymous host memory, GPU memory in use (NVML), torch's allocator figures and
the largest anonymous mappings. Then it CUDA-checkpoints the child (driver API, as a
capture does), reports the host memory the checkpoint produced, restores it and checks
the engine still gives the same reply. The CRIU image is roughly the anonymous memory
after the checkpoint, so this shows which step (or trim) moves the capsule's size.

    python3 bench/gpu_footprint.py --preset 1g-bf16 [--out footprint.json]
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
from gpu_snapshot import emit, env_arg, preset_arg, setup_paths


def anon_maps(pid: int, top: int = 10) -> list[dict]:
    """The largest anonymous (non-file) mappings of ``pid`` by resident anonymous bytes."""
    rows, cur = [], None
    with open(f"/proc/{pid}/smaps") as fh:
        for line in fh:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                cur = {"range": head[0], "size_mib": round((hi - lo) / 2**20, 1),
                       "name": head[5] if len(head) > 5 else "", "perms": head[1], "anon_mib": 0.0}
                rows.append(cur)
            elif head[0] == "Anonymous:" and cur is not None:
                cur["anon_mib"] = round(int(head[1]) / 1024, 1)
            elif head[0] == "VmFlags:" and cur is not None:
                cur["flags"] = " ".join(head[1:])
    rows = [r for r in rows if r["anon_mib"] > 0]
    rows.sort(key=lambda r: -r["anon_mib"])
    files = sum(r["anon_mib"] for r in rows if r["name"].startswith("/"))
    return [*rows[:top], {"dirty_private_file_pages_mib": round(files, 1)}]


def memory(pid: int) -> dict:
    out: dict = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("RssAnon:", "RssFile:", "VmRSS:")):
            k, v = line.split(":", 1)
            out[k.lower() + "_mib"] = round(int(v.split()[0]) / 1024, 1)
    r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                       check=False, capture_output=True, text=True, timeout=30)
    for line in r.stdout.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            out["gpu_used_mib"] = int(parts[1])
    out.setdefault("gpu_used_mib", 0)
    return out


# ---------------------------------------------------------------- child side
def child(model_dir: str, out_dir: str) -> None:
    import gc

    import torch
    from coldsnap_engines.common import gpu_context
    from coldsnap_engines.reference.engine import Engine, _malloc_trim
    from coldsnap_engines.reference.transport import Transport

    def mark(name: str, **extra) -> None:
        stats = {"mark": name, "torch_allocated_mib": round(torch.cuda.memory_allocated() / 2**20, 1),
                 "torch_reserved_mib": round(torch.cuda.memory_reserved() / 2**20, 1), **extra}
        print(json.dumps(stats), flush=True)
        if sys.stdin.readline().strip() != "next":
            sys.exit(3)

    torch.zeros(1, device="cuda")
    mark("cuda-init")
    eng = Engine(Path(model_dir), device="cuda", rank=0, world=1, served_model_name="probe")
    eng.start(Transport(rank=0, world=1, device="cuda", endpoint_file=None, scope="probe"))
    reply = eng.generate("ColdSnap says:", 16)
    mark("ready", reply=reply)
    eng.quiesce()
    mark("quiesced")
    state = Path(out_dir) / "state"
    payload = eng.export({"out_dir": out_dir, "export_pack": True, "state_root": str(state),
                          "model": {"id": "coldsnap/probe", "revision": "0" * 40}})["payload"]
    mark("exported")
    eng.release()  # weights unmapped, CUDA context shrunk (coldsnap_engines.common.gpu_context)
    mark("released", shrunk=str(eng._shrunk))
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()
        gc.collect()
        _malloc_trim()
        mark("trim:host-caching-allocator")
    # Candidates not (yet) in gpu_context.shrink: the device printf FIFO and malloc heap.
    from cuda.bindings import driver as cu

    tried = {}
    for name in ("CU_LIMIT_PRINTF_FIFO_SIZE", "CU_LIMIT_MALLOC_HEAP_SIZE"):
        lim = getattr(cu.CUlimit, name)
        before = int(cu.cuCtxGetLimit(lim)[1])
        err = cu.cuCtxSetLimit(lim, 0)[0]
        tried[name] = {"before": before, "set_0": str(err), "after": int(cu.cuCtxGetLimit(lim)[1])}
    mark("trim:printf-and-malloc-limits", limits=tried)
    print(json.dumps({"mark": "ready-for-checkpoint"}), flush=True)
    if sys.stdin.readline().strip() != "restored":
        sys.exit(3)
    gpu_context.restore(eng._shrunk)
    for name, t in tried.items():
        cu.cuCtxSetLimit(getattr(cu.CUlimit, name), t["before"])
    for a in eng.loaded.arenas.values():
        a.recreate()
    t = time.perf_counter()
    pack = {**payload["pack"], "path": str(state / payload["pack"]["path"])}
    eng._hydrate_and_open({"provider": "native", "manifest": f"{out_dir}/{payload['manifest']['path']}",
                           "residual": f"{out_dir}/{payload['residual']['path']}", "pack": pack})
    hyd = time.perf_counter() - t
    again = eng.generate("ColdSnap says:", 16)
    print(json.dumps({"mark": "after-restore", "reply": again, "same_reply": again == reply,
                      "hydrate_s": round(hyd, 3)}), flush=True)


# --------------------------------------------------------------- parent side
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="1g-bf16")
    ap.add_argument("--work", default="/tmp/coldsnap-footprint")
    ap.add_argument("--out", default=None)
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="extra environment for the engine process (repeatable)")
    ap.add_argument("--child", nargs=2, metavar=("MODEL_DIR", "OUT_DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    extra_env = env_arg(ap, args.env)
    setup_paths()
    if args.child:
        child(*args.child)
        return 0
    config = preset_arg(ap, args.preset)
    from ansible_collections.coldsnap.fleet.plugins.module_utils.process import cuda_checkpoint as cuda
    from coldsnap_engines.reference.weights import make_model

    work = Path(args.work)
    model_dir = work / f"model-{args.preset}"
    make_model(model_dir, config, model_id=f"coldsnap/reference-{args.preset}")
    out_dir = Path(tempfile.mkdtemp(prefix="payload-", dir=work))
    env = {**os.environ, **extra_env}
    proc = subprocess.Popen([sys.executable, __file__, "--child", str(model_dir), str(out_dir)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    steps = []
    try:
        while True:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"child exited ({proc.wait()})")
            msg = json.loads(line)
            if msg["mark"] == "ready-for-checkpoint":
                break
            msg.update(memory(proc.pid))
            if msg["mark"] in ("cuda-init", "ready", "released"):
                msg["top_anon"] = anon_maps(proc.pid)
            steps.append(msg)
            print(json.dumps(msg), file=sys.stderr, flush=True)
            proc.stdin.write("next\n")
            proc.stdin.flush()
        t = time.perf_counter()
        cuda.checkpoint(proc.pid)
        ck = time.perf_counter() - t
        after = {"mark": "checkpointed", "checkpoint_s": round(ck, 3), **memory(proc.pid),
                 "top_anon": anon_maps(proc.pid)}
        steps.append(after)
        t = time.perf_counter()
        cuda.restore(proc.pid)
        cuda.unlock(proc.pid)
        after["restore_unlock_s"] = round(time.perf_counter() - t, 3)
        proc.stdin.write("restored\n")
        proc.stdin.flush()
        steps.append(json.loads(proc.stdout.readline()))
    finally:
        proc.kill()
        proc.wait()
    result = {"preset": args.preset, "env": args.env, "steps": steps}
    return emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
