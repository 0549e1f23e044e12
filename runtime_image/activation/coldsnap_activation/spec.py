"""The unit spec: what the unit_capture / unit_restore / lifecycle modules hand the runtime."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SPEC_KIND = "coldsnap-unit-spec"


@dataclass
class UnitSpec:
    """One launch unit's activation, as decided by the control node."""

    operation: str
    operation_id: str
    capture_id: str
    unit: dict
    workers: list[dict]
    world_size: int
    unit_count: int
    state_root: str
    unit_dir: str
    workload_dir: str
    python: str
    model: dict
    driver: dict
    service: dict | None = None
    coordinator: dict | None = None
    validation: dict | None = None
    weights: dict = field(default_factory=dict)
    timeouts: dict = field(default_factory=dict)
    transport_env: dict = field(default_factory=dict)
    criu_binary: str | None = None
    warm: bool = False
    t0_ns: int | None = None
    supervise: bool = False
    host: str = "localhost"

    @property
    def unit_id(self) -> str:
        return self.unit["id"]

    @property
    def index(self) -> int:
        return self.unit["index"]

    def timeout(self, name: str, default: float) -> float:
        return float(self.timeouts.get(name, default))

    @classmethod
    def load(cls, path: Path) -> UnitSpec:
        data = json.loads(Path(path).read_text())
        if data.pop("kind", None) != SPEC_KIND or data.pop("format", None) != 1:
            raise ValueError(f"{path} is not a {SPEC_KIND} format 1 document")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown fields {unknown}")
        return cls(**data)

    def to_json(self) -> dict:
        out = {"format": 1, "kind": SPEC_KIND}
        out.update({k: getattr(self, k) for k in self.__dataclass_fields__})
        return out
