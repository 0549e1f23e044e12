"""An :class:`EngineControl` for one worker that lives in the control server's own
process (SGLang's scheduler process; CPU tests over real mmap arenas).

Subclasses supply the memory operations of their allocator (pause/resume with
the address kept) and, where the engine has them, serving and transport hooks.
The payload work (export, hydrate, materialize) is :mod:`coldsnap_engines.common.worker`.
"""

from __future__ import annotations

from pathlib import Path

from coldsnap_engines.common import gpu_context, worker
from coldsnap_engines.common.allocations import AllocationTable, zero


class LocalControl:
    """Template for a single in-process worker; override the ``_`` hooks."""

    engine = "local"
    # Re-hash each observed extent against the checkpoint at export (an engine whose loader may
    # transform weights after writing them must; one that copies exact slices may skip it).
    verify_extents = True

    def __init__(self, *, rank: int = 0, world: int = 1, device: str = "cpu", relocatable: bool = False) -> None:
        self.rank = rank
        self.world = world
        self.device = device
        self.relocatable = relocatable
        self.extents: list = []
        self.model_dir: Path | None = None
        self.hydration_spec: dict | None = None
        self._alloc_view: dict | None = None
        self.hydration: dict | None = None  # {done, total} bytes of the last (or running) hydration
        self._shrunk: gpu_context.Shrunk | None = None

    @property
    def device_index(self) -> int:
        return int(self.device.split(":", 1)[1]) if ":" in self.device else 0

    # ---- hooks for subclasses -------------------------------------------
    def weights_table(self) -> AllocationTable:
        raise NotImplementedError

    def kv_table(self) -> AllocationTable | None:
        return None

    def named_tensors(self):
        return ()

    def _pause_serving(self) -> None:
        pass

    def _resume_serving(self) -> None:
        pass

    def _release_transport(self) -> None:
        pass

    def _rebuild_transport(self, spec: dict) -> None:
        pass

    def _release(self, tags: tuple[str, ...]) -> None:
        """Free the memory of these tags ('weights', 'kv_cache'), keeping the addresses."""
        raise NotImplementedError

    def _recreate(self, tags: tuple[str, ...]) -> None:
        """Map fresh memory at the kept addresses (contents undefined)."""
        raise NotImplementedError

    def _switch_load_format(self) -> None:
        """Point later reloads at the recovery-capable ``coldsnap`` loader."""

    # ---- EngineControl ----------------------------------------------------
    def describe(self) -> dict:
        return {"engine": self.engine, "rank": self.rank, "world": self.world, "device": self.device}

    def allocations(self) -> dict:
        """The status view of the weight allocations (computed once: addresses are stable by design)."""
        if self._alloc_view is None:
            try:
                table = self.weights_table()
            except Exception:
                return {}
            self._alloc_view = {a.id: {"address": a.address, "size": a.size, "device": a.device}
                                for a in table.allocations}
        return self._alloc_view

    def pause_serving(self) -> None:
        self._pause_serving()

    def resume_serving(self) -> None:
        self._resume_serving()

    def release_transport(self) -> None:
        self._release_transport()

    def rebuild_transport(self, spec: dict) -> None:
        self._rebuild_transport(spec)

    def discard_kv(self) -> None:
        if self.kv_table() is not None:
            self._release(("kv_cache",))

    def export(self, body: dict) -> dict:
        table = self.weights_table()
        layout = None
        tensors = list(self.named_tensors())
        if tensors:
            layout = {"engine": self.engine, "tensors": worker.tensor_layout(tensors, table)}
        return worker.export(table, self.extents, Path(body["out_dir"]),
                             export_pack=bool(body.get("export_pack", True)), state_root=body.get("state_root"),
                             model=body["model"], model_dir=self.model_dir,
                             verify=self.verify_extents and bool(body.get("verify_extents", True)), layout=layout,
                             progress_dir=body.get("progress_dir"), progress_name=f"export-rank{self.rank}")

    def release_weights(self) -> None:
        self._release(("weights",))
        worker.check_released()
        self._switch_load_format()
        if self.device != "cpu":
            self._shrunk = gpu_context.shrink(self.device_index)

    def recreate_memory(self) -> None:
        gpu_context.restore(self._shrunk)
        self._shrunk = None
        tags = ("weights", "kv_cache") if self.kv_table() is not None else ("weights",)
        self._recreate(tags)

    def hydrate(self, spec: dict) -> dict:
        self.hydration_spec = dict(spec)  # the JSON body (Lifecycle hands integrations plain dicts)
        self.hydration = {"done": 0, "total": None}
        return worker.hydrate(self.weights_table(), spec, relocatable=self.relocatable,
                              progress=self._hydration_progress)

    def _hydration_progress(self, done: int, total: int | None) -> None:
        """The bytes hydrated so far (``GET /status`` -> ``hydration``: the activation runtime shows them)."""
        self.hydration = {"done": int(done), "total": int(total) if total is not None else None}

    def zero_kv(self) -> None:
        kv = self.kv_table()
        if kv is not None and len(kv):
            zero(kv)

    def materialize(self, spec: dict) -> dict:
        return worker.materialize(self.weights_table(), spec)

    def sleep(self) -> None:
        self._pause_serving()
        tags = ("weights", "kv_cache") if self.kv_table() is not None else ("weights",)
        self._release(tags)
        worker.check_released()

    def wake(self, spec: dict) -> dict:
        self.recreate_memory()
        return self.hydrate(spec)
