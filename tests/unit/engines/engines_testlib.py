"""Shared helpers for the engine-integration tests: the reference engine's model and a
vLLM-style load of it (full tensors from the checkpoint iterator, narrowed per tensor-parallel
shard, copied into stable CPU arenas) that the observer must classify."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def free_port() -> int:
    """A free loopback port (imported late: the engine probes load this module where tests/ is not on the
    path)."""
    from netports import free_port as pick

    return pick()


ENV_SCRIPT = REPO / "scripts" / "engine-contract-env.sh"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def make_reference_model(out: Path) -> dict:
    from coldsnap_engines.reference.config import PRESETS
    from coldsnap_engines.reference.weights import make_model

    return make_model(out, PRESETS["tiny"], model_id="coldsnap/reference-tiny", seed=0)


def model_identity(ident: dict) -> dict:
    """The model identity the payload writer binds (what the activation runtime passes)."""
    return {"id": ident["id"], "revision": ident["revision"]}


def arenas_for(model_dir: Path, rank: int, world: int):
    """The reference engine's layout for one rank: (config, plan, {id: CpuArena})."""
    from coldsnap_engines.common.arena import make_arena
    from coldsnap_engines.reference.config import ModelConfig
    from coldsnap_engines.reference.loader import plan_layout, tensor_index

    cfg = ModelConfig.load(model_dir)
    plan, size = plan_layout(cfg, tensor_index(model_dir), rank, world)
    return cfg, plan, {"params": make_arena("params", size, "cpu"), "derived": make_arena("derived", 4096, "cpu")}


def table_of(arenas: dict):
    from coldsnap_engines.common.allocations import AllocationTable, LiveAllocation

    return AllocationTable(LiveAllocation(a.id, "cpu", a.address, a.size, a.view()) for a in arenas.values())


def vllm_style_load(model_dir: Path, weights, plan, arenas, dtype, *, observer, contiguous_first: bool = False) -> None:
    """Copy each planned shard from the yielded full tensors into its arena slot (inside ``observer``).

    ``weights`` yields (name, full tensor) like a checkpoint iterator; each is registered with the
    observer first, exactly as the integrations' iterator wrappers do.
    """
    from coldsnap_engines.common.observer import SourceIndex

    index = SourceIndex(model_dir)
    by_name = {p.name: p for p in plan}
    with observer:
        for name, full in weights:
            observer.register(full, index.lookup(name))
            p = by_name.get(name)
            if p is None:
                continue
            src = full
            if p.slice is not None:
                dim, start, stop = p.slice
                src = full.narrow(dim, start, stop - start)
            if contiguous_first:
                src = src.contiguous()
            dest = arenas["params"].tensor(p.offset, p.shape, dtype)
            dest.copy_(src)


def safetensors_iter(model_dir: Path):
    from safetensors import safe_open

    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def engine_env_root() -> Path | None:
    """The cached real-engine environment (scripts/engine-contract-env.sh), building it in CI."""
    root = Path(subprocess.run(["bash", str(ENV_SCRIPT), "--print-root"], check=True, capture_output=True,
                               text=True).stdout.strip())
    if (root / "READY").exists():
        return root
    if not IN_CI:
        return None
    r = subprocess.run(["bash", str(ENV_SCRIPT)], capture_output=True, text=True, timeout=1200, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"CI must build the engine contract environment: {r.stderr[-2000:]}")
    return Path(r.stdout.strip().splitlines()[-1])


def run_probe(script: Path, pythonpath: list[Path], *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLDSNAP_")}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    env["VLLM_PLUGINS"] = "coldsnap"
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=str(REPO), check=False)
