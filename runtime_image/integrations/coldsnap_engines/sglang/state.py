"""Per-process ColdSnap state inside an SGLang scheduler process (one TP rank each)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from coldsnap_engines.common.observer import LoadObserver


@dataclass
class SchedulerState:
    observer: LoadObserver | None = None
    files: list[str] = field(default_factory=list)
    model_dir: Path | None = None
    control: object | None = None
    lock: threading.RLock = field(default_factory=threading.RLock)


STATE = SchedulerState()
