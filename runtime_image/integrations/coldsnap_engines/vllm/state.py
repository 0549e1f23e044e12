"""Per-process ColdSnap state inside a vLLM worker process.

The observing loader fills it at capture, the worker extension and the
sleep-mode backend read it. One vLLM worker per process, so one state.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from coldsnap_engines.common.observer import LoadObserver


@dataclass
class WorkerState:
    observer: LoadObserver | None = None
    model_dir: Path | None = None
    load_format: str | None = None  # the normal loader capture used
    armed: dict | None = None  # hydration spec for the next wake (set through collective RPC)
    last_hydration: dict | None = None
    shrunk: object | None = None  # gpu_context.Shrunk: what release took from the CUDA context
    arena: object | None = None  # cpu.WeightArena: the parameters' stable allocation on CPU
    packed: list | None = None  # cpu_packed.PackedCopy: vLLM's packed linear weights on CPU (found at release)
    lock: threading.RLock = field(default_factory=threading.RLock)

    def arm(self, spec: dict | None) -> None:
        with self.lock:
            self.armed = dict(spec) if spec else None

    def take_armed(self) -> dict | None:
        with self.lock:
            spec, self.armed = self.armed, None
            return spec


STATE = WorkerState()
