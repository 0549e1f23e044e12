"""Worker-side collective-RPC methods (``--worker-extension-cls
coldsnap_engines.vllm.worker.ColdSnapWorkerExtension``).

vLLM mixes this class into its GPU ``Worker`` and refuses attribute clashes,
so every method is prefixed ``coldsnap_``. The control plane reaches them with
``EngineClient.collective_rpc("coldsnap_<name>", kwargs=...)``; each runs in
every worker process, between engine steps.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import TRANSPORT_PREFIXES

from coldsnap_engines.common import cpu_state, gpu_context
from coldsnap_engines.common import worker as payload_worker
from coldsnap_engines.vllm import cpu_packed
from coldsnap_engines.vllm.loader import LOAD_FORMAT, named_tensors, weights_table
from coldsnap_engines.vllm.state import STATE


def for_rank(spec: dict | None, rank: int) -> dict | None:
    """A worker's part of a request: ``spec['workers'][rank]`` when the unit holds several workers."""
    if spec and spec.get("workers"):
        return {**{k: v for k, v in spec.items() if k != "workers"}, **spec["workers"][rank]}
    return spec


class ColdSnapWorkerExtension:
    """Methods vLLM adds to each worker for ColdSnap."""

    def _coldsnap_model(self):
        return self.model_runner.model  # type: ignore[attr-defined]

    def coldsnap_describe(self) -> dict:
        """Rank, device and the stable weight allocations of this worker."""
        table = weights_table(self._coldsnap_model())
        return {"rank": int(self.rank), "local_rank": int(self.local_rank),  # type: ignore[attr-defined]
                "device": table.device, "load_format": STATE.load_format,
                "allocations": {a.id: {"address": a.address, "size": a.size, "device": a.device}
                                for a in table.allocations}}

    def coldsnap_export(self, body: dict) -> dict:
        """Write this worker's residual, manifest, replay plan (and pack) while the weights are resident.

        ``body['out_dirs']`` (one per global rank) or ``body['out_dir']`` (one worker).
        """
        rank = int(self.rank)  # type: ignore[attr-defined]
        out_dirs = body.get("out_dirs")
        out_dir = Path(out_dirs[rank]) if out_dirs else Path(body["out_dir"])
        model = self._coldsnap_model()
        table = weights_table(model)
        observer = STATE.observer
        if observer is None:
            from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError

            raise ColdSnapError("this vLLM worker loaded its weights without the ColdSnap observer",
                                fix="start vLLM under ColdSnap (COLDSNAP_CONTROL_FILE) with VLLM_PLUGINS naming "
                                    "coldsnap and a safetensors-backed --load-format")
        extents = observer.resolve(table)
        layout = {"engine": "vllm", "tensors": payload_worker.tensor_layout(named_tensors(model), table)}
        out = payload_worker.export(table, extents, out_dir, export_pack=bool(body.get("export_pack", True)),
                                    state_root=body.get("state_root"), model=body["model"],
                                    model_dir=STATE.model_dir, verify=bool(body.get("verify_extents", True)),
                                    layout=layout)
        out["rank"] = rank
        out["observer"] = dict(observer.stats)
        return out

    def coldsnap_arm(self, spec: dict | None) -> None:
        """Hydrate from ``spec`` on the next weights wake (restore, or reload after level 2)."""
        STATE.last_hydration = None
        STATE.arm(for_rank(spec, int(self.rank)))  # type: ignore[attr-defined]

    def coldsnap_transport_env(self, env: dict) -> None:
        """Replace the captured transport variables (NCCL/UCX/interface) with the destination's."""
        for name in [n for n in os.environ if n.startswith(TRANSPORT_PREFIXES)]:
            if name not in env:
                del os.environ[name]
        os.environ.update({str(k): str(v) for k, v in env.items()})

    def coldsnap_last_hydration(self) -> dict | None:
        return STATE.last_hydration

    def coldsnap_switch_load_format(self) -> str:
        """Point the live load config at the recovery-capable ``coldsnap`` loader (before checkpoint)."""
        cfg = self.vllm_config.load_config  # type: ignore[attr-defined]
        cfg.load_format = LOAD_FORMAT
        runner_cfg = getattr(self.model_runner, "load_config", None)  # type: ignore[attr-defined]
        if runner_cfg is not None and runner_cfg is not cfg:
            runner_cfg.load_format = LOAD_FORMAT
        return cfg.load_format

    def coldsnap_shrink_context(self) -> None:
        """After the level-2 sleep, before the CUDA checkpoint: free what the snapshot need not carry."""
        cpu_state.remember()
        STATE.shrunk = gpu_context.shrink()

    def coldsnap_restore_context(self) -> None:
        """First thing on resume, before any kernel runs: the CPU state permissions a restore drops (AMX),
        and the CUDA context's stack reservation."""
        cpu_state.regrant()
        gpu_context.restore(STATE.shrunk)  # type: ignore[arg-type]
        STATE.shrunk = None

    # ---- CPU: no sleep mode; the weight arena and the KV cache are released in place ----------
    def coldsnap_release(self, tags: list[str]) -> dict:
        """Drop the pages of the weight arena and/or the KV cache (addresses kept; they read back as
        zeros): what a snapshot, or a level-2 sleep, must not carry. ``packed`` (with ``weights``) also
        frees vLLM's packed copies of the linear weights; the next hydration packs them again."""
        from coldsnap_engines.common.arena import free_host_memory
        from coldsnap_engines.vllm.cpu import release_kv

        out = {"weights": 0, "kv_cache": 0}
        cpu_state.remember()
        if "weights" in tags and STATE.arena is not None:
            if "packed" in tags:
                if STATE.packed is None:
                    STATE.packed = cpu_packed.find(self._coldsnap_model(), STATE.arena.entries)
                out["packed_weights"] = cpu_packed.release(STATE.packed)
            out["weights"] = STATE.arena.release()
            payload_worker.check_released()
        if "kv_cache" in tags:
            out["kv_cache"] = release_kv(self.model_runner)  # type: ignore[attr-defined]
        free_host_memory()
        return out

    def coldsnap_hydrate(self, spec: dict) -> dict:
        """Fill the weight arena at its captured address from the pack + residual or the replay plan."""
        mine = for_rank(spec, int(self.rank))  # type: ignore[attr-defined]
        stats = payload_worker.hydrate(weights_table(self._coldsnap_model()), mine or {})
        if STATE.packed and STATE.arena is not None and any(c.released for c in STATE.packed):
            # vLLM's packed copies of the linear weights were dropped with the arena: pack them again.
            t0 = time.monotonic()
            stats["repacked_layers"] = cpu_packed.repack(STATE.packed, STATE.arena.arena)
            stats["repack_s"] = round(time.monotonic() - t0, 4)
        STATE.last_hydration = stats
        return stats

    def coldsnap_materialize(self, spec: dict) -> dict:
        """Write the resident model bytes into the node cache (recovery read-through cache)."""
        mine = for_rank(spec, int(self.rank))  # type: ignore[attr-defined]
        return payload_worker.materialize(weights_table(self._coldsnap_model()), mine or {})
