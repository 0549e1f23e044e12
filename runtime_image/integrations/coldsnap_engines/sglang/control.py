"""The control plane inside one SGLang scheduler process.

The control server's thread never touches the model: each step is queued and
run by the scheduler thread itself from the ``ingest_requests`` hook, between
scheduler iterations. ``pause_serving`` waits (from the control thread) until
the scheduler is idle and then *holds* it: from that iteration on the hook keeps
the scheduler thread inside it, running control steps, so no batch runs while
memory is released, exported, snapshotted or hydrated. ``resume_serving`` lets
it go. A restored process resumes exactly there.

Memory goes through SGLang's own ``release_memory_occupation`` /
``resume_memory_occupation`` (torch_memory_saver regions ``weights``, ``kv_cache``,
``cuda_graph``: physical memory freed, virtual addresses kept).
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError

from coldsnap_engines.common import gpu_context
from coldsnap_engines.common.allocations import AllocationTable
from coldsnap_engines.common.local import LocalControl
from coldsnap_engines.sglang.loader import named_tensors, weights_table
from coldsnap_engines.sglang.state import STATE

STEP_TIMEOUT = 1800.0
MEMORY_TAGS = ("cuda_graph", "weights", "kv_cache")


def topology(scheduler) -> tuple[int, int, int]:
    """(tp rank, tp size, gpu id): SGLang 0.5.23 publishes them in its runtime context
    (``get_parallel()``, ``get_device()``); older schedulers carried them as attributes."""
    try:
        from sglang.srt.runtime_context import get_device, get_parallel

        par = get_parallel()
        return int(par.tp_rank), int(par.tp_size), int(get_device().gpu_id)
    except (ImportError, AttributeError, ValueError):
        return (int(getattr(scheduler, "tp_rank", 0)), int(getattr(scheduler, "tp_size", 1)),
                int(getattr(scheduler, "gpu_id", 0)))


class SglangControl(LocalControl):
    """EngineControl for one SGLang scheduler (one TP rank, one GPU)."""

    engine = "sglang"

    def __init__(self, scheduler) -> None:
        rank, world, gpu = topology(scheduler)
        super().__init__(rank=rank, world=world, device=f"cuda:{gpu}")
        self.scheduler = scheduler
        self.scheduler_thread: int | None = None
        self.jobs: queue.Queue = queue.Queue()
        self.lifecycle = None
        self.hold = False
        self.released: set[str] = set()

    # ---- scheduler thread ---------------------------------------------------
    def pump(self) -> None:
        """Called by the scheduler thread every iteration: run queued steps; stay while held."""
        self.scheduler_thread = threading.get_ident()
        if self.lifecycle is not None:
            self.lifecycle.mark_ready()
        while True:
            try:
                fut, job = self.jobs.get(timeout=0.05) if self.hold else self.jobs.get_nowait()
            except queue.Empty:
                if self.hold:
                    continue
                return
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(job())
                except BaseException as exc:
                    fut.set_exception(exc)

    def _call(self, fn):
        """Run ``fn()`` on the scheduler thread and wait for its result."""
        if threading.get_ident() == self.scheduler_thread:
            return fn()
        fut: Future = Future()
        self.jobs.put((fut, fn))
        return fut.result(STEP_TIMEOUT)

    def _model(self):
        return self.scheduler.tp_worker.model_runner.model

    def _kv_buffers(self) -> list:
        import torch

        pool = getattr(self.scheduler.tp_worker.model_runner, "token_to_kv_pool", None)
        out = []
        for name in ("k_buffer", "v_buffer", "kv_buffer"):
            val = getattr(pool, name, None)
            if isinstance(val, torch.Tensor):
                out.append(val)
            elif isinstance(val, (list, tuple)):
                out += [t for t in val if isinstance(t, torch.Tensor)]
        return out

    # ---- LocalControl hooks (run on the scheduler thread) --------------------
    def weights_table(self) -> AllocationTable:
        return weights_table(self._model())

    def named_tensors(self):
        return list(named_tensors(self._model()))

    def _release(self, tags: tuple[str, ...]) -> None:
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        # Releasing the weights also releases the CUDA-graph pool: neither belongs in a snapshot.
        wanted = (*tags, "cuda_graph") if "weights" in tags else tags
        want = [t for t in MEMORY_TAGS if t in wanted and t not in self.released]
        if want:
            self.scheduler.weight_updater.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=want))
            self.released |= set(want)

    def _recreate(self, tags: tuple[str, ...]) -> None:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        want = [t for t in MEMORY_TAGS if t in self.released]
        if want:
            self.scheduler.weight_updater.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=want))
            self.released -= set(want)

    def _zero_kv(self) -> None:
        for t in self._kv_buffers():
            t.zero_()

    # ---- EngineControl (called from the control thread) ----------------------
    def pause_serving(self) -> None:
        def try_hold() -> bool:
            if self.scheduler.is_fully_idle():
                self.hold = True
            return self.hold

        deadline = time.monotonic() + STEP_TIMEOUT
        while not self._call(try_hold):
            if time.monotonic() > deadline:
                raise TimeoutError("SGLang did not become idle to quiesce")
            time.sleep(0.05)

    def resume_serving(self) -> None:
        def let_go() -> None:
            self.hold = False

        self._call(let_go)

    def discard_kv(self) -> None:
        self._call(lambda: self._release(("kv_cache",)))

    def export(self, body: dict) -> dict:
        def run() -> dict:
            with STATE.lock:
                observer = STATE.observer
                self.model_dir = STATE.model_dir
            if observer is None:
                raise ColdSnapError("SGLang loaded its weights without the ColdSnap observer",
                                    fix="start SGLang under ColdSnap with the coldsnap plugin enabled (SGLANG_PLUGINS)")
            self.extents = observer.resolve(self.weights_table())
            out = LocalControl.export(self, body)
            out["observer"] = dict(observer.stats)
            return out

        return self._call(run)

    def release_weights(self) -> None:
        self._call(lambda: LocalControl.release_weights(self))

    def recreate_memory(self) -> None:
        def run() -> None:
            gpu_context.restore(self._shrunk)
            self._shrunk = None
            self._recreate(MEMORY_TAGS)

        self._call(run)

    def hydrate(self, spec: dict) -> dict:
        return self._call(lambda: LocalControl.hydrate(self, spec))

    def zero_kv(self) -> None:
        self._call(self._zero_kv)

    def materialize(self, spec: dict) -> dict:
        return self._call(lambda: LocalControl.materialize(self, spec))

    def sleep(self) -> None:
        self.pause_serving()
        self._call(lambda: self._release(("weights", "kv_cache")))

    def wake(self, spec: dict) -> dict:
        def run() -> dict:
            self._recreate(MEMORY_TAGS)
            return LocalControl.hydrate(self, spec)

        return self._call(run)
