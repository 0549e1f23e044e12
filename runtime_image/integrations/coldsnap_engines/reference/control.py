"""The reference engine's integration: :class:`ReferenceControl`, the
:class:`~coldsnap_engines.common.local.LocalControl` of one reference worker.

The worker lives in the control server's own process, so this is the same
template SGLang's scheduler uses; its allocator is the engine's arenas (a
private mmap on CPU, a CUDA VMM reservation on GPU), released and re-created at
the same addresses. The state machine, span names, materialization and
rollback are the shared :class:`~coldsnap_engines.common.lifecycle.Lifecycle`'s.
"""

from __future__ import annotations

from coldsnap_engines.common import worker
from coldsnap_engines.common.allocations import AllocationTable, LiveAllocation
from coldsnap_engines.common.arena import free_host_memory
from coldsnap_engines.common.local import LocalControl
from coldsnap_engines.reference.engine import Engine


class ReferenceControl(LocalControl):
    """EngineControl for one rank of the reference engine."""

    engine = "reference"
    # The reference loader copies each checkpoint slice into its arena itself and never
    # transforms it afterwards: the observed extents are exact, no re-hash against the checkpoint.
    verify_extents = False

    def __init__(self, engine: Engine) -> None:
        super().__init__(rank=engine.rank, world=engine.world, device=engine.device)
        self.eng = engine
        self.model_dir = engine.model_dir
        self._generation = 0

    # ---- the allocator: the engine's arenas -------------------------------
    def weights_table(self) -> AllocationTable:
        arenas = self.eng.loaded.arenas.values()
        return AllocationTable(
            LiveAllocation(a.id, "cpu" if a.device == "cpu" else f"cuda:{a.device_index}", a.address, a.size,
                           a.view() if a.device == "cpu" else None, private_mapping=a.device == "cpu")
            for a in arenas)

    @property
    def extents(self) -> list:
        return list(self.eng.loaded.extents) if self.eng.loaded else []

    @extents.setter
    def extents(self, value: list) -> None:  # LocalControl's constructor sets an empty list
        pass

    def allocations(self) -> dict:
        if not self.eng.loaded:
            return {}
        return {a.id: {"address": a.address, "size": a.size, "resident": a.resident, "device": a.device}
                for a in self.eng.loaded.arenas.values()}

    def describe(self) -> dict:
        return {**super().describe(), "config": self.eng.config.to_json()}

    def _release(self, tags: tuple[str, ...]) -> None:
        if "kv_cache" in tags:
            self.eng.drop_kv()
        if "weights" in tags:
            for a in self.eng.loaded.arenas.values():
                a.release()
            free_host_memory()

    def _recreate(self, tags: tuple[str, ...]) -> None:
        from coldsnap_engines.common.lifecycle import EngineStateError

        for a in self.eng.loaded.arenas.values():
            a.recreate()
            if a.current_address() != a.address:
                raise EngineStateError(f"arena {a.id} moved from {a.address:#x} to {a.current_address():#x}")

    # ---- graphs (policy.process.graph_policy) -------------------------------
    def release_graphs(self) -> int:
        return self.eng.drop_graphs()

    def recreate_graphs(self) -> int:
        return self.eng.recreate_graphs()

    # ---- serving and transport ---------------------------------------------
    def _pause_serving(self) -> None:
        self.eng.pause()

    def _resume_serving(self) -> None:
        self.eng.unpause()

    def _release_transport(self) -> None:
        self.eng.release_transport()

    def _rebuild_transport(self, spec: dict) -> None:
        self._generation += 1
        self.eng.rebuild_transport(spec, self._generation)

    # ---- the KV cache is a tensor of the decoder, not an arena ------------
    def discard_kv(self) -> None:
        self.eng.drop_kv()

    def zero_kv(self) -> None:
        self.eng.new_kv()
        self.eng.open_transport()

    def sleep(self) -> None:
        self._pause_serving()
        self.eng.park_followers()
        self._release(("kv_cache", "weights"))
        worker.check_released()

    def recreate_memory(self) -> None:
        from coldsnap_engines.common import gpu_context

        gpu_context.restore(self._shrunk)
        self._shrunk = None
        self._recreate(("weights",))
