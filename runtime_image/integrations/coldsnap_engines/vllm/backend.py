"""The ``coldsnap`` sleep-mode backend (``--sleep-mode-backend coldsnap``).

vLLM's pluggable sleep-mode backends (``vllm.device_allocator.sleep_mode_backend``)
own the mechanism behind ``/sleep`` -> engine -> executor -> worker. This one is
vLLM's ``cumem`` backend (level 1 offloads weights to host memory, level 2
discards them; the virtual reservations stay) plus two steps inside the
worker's own wake path, before the engine resumes scheduling:

* when a hydration spec was armed (a restore, or a reload after a level-2
  sleep), the woken weight allocations are hydrated from the native pack +
  residual or the pinned safetensors replay plan;
* the woken KV-cache allocations are re-zeroed.

This module imports vLLM; vLLM's backend factory imports it by name.
"""

from __future__ import annotations

from vllm.device_allocator.sleep_mode_backend import CuMemBackend

from coldsnap_engines.common import worker
from coldsnap_engines.common.allocations import zero
from coldsnap_engines.vllm.loader import kv_table, weights_table
from coldsnap_engines.vllm.state import STATE


class ColdSnapSleepBackend(CuMemBackend):
    """cumem sleep/wake with payload hydration and KV re-zero on wake."""

    def resume(self, tags: list[str] | None = None) -> None:
        super().resume(tags)
        if tags is None or "weights" in tags:
            spec = STATE.take_armed()
            if spec:
                STATE.last_hydration = worker.hydrate(weights_table(), spec)
        if tags is None or "kv_cache" in tags:
            kv = kv_table()
            if kv is not None and len(kv):
                zero(kv)
