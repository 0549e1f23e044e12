"""The host <-> unit contract: what the per-host modules hand the activation runtime (the
unit spec), what it hands back (unit evidence), and the payload reference both sides and
the engine use for every file of a worker's captured state.

One definition, used by the library (``units/``), the activation runtime
(``runtime_image/activation``) and the engine integrations.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.seconds import is_seconds
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import identifiers as ids
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.versions import (
    EVIDENCE_FORMAT,
    EVIDENCE_KIND,
    UNIT_SPEC_FORMAT,
    UNIT_SPEC_KIND,
)

# A worker's captured files, beside each other in ``<unit dir>/workers/<worker>/``.
RESIDUAL_NAME = "weights.blob"
MANIFEST_NAME = "native-manifest.json"
REPLAY_PLAN_NAME = "replay-plan.json"
PACK_DIR = "model-payloads/sha256"
PACK_SUFFIX = ".pack"
EVIDENCE_FILE = "evidence.json"
# Per worker, where its engine listened for control and which control file it reads (never its token):
# ``<unit dir>/control/<worker>.json``.
CONTROL_DIR = "control"
UNIT_OPERATIONS = ("capture", "capture-running", "restore", "warm", "status", "sleep", "wake", "finish-warm", "stop")

# The per-phase timeouts a unit's activation knows (seconds): engine start, engine ready, a phase barrier
# between units, the CUDA lock before a checkpoint. The modules' ``timeouts`` option (doc fragment
# coldsnap.fleet.state.TIMEOUTS) takes these and nothing else.
TIMEOUT_NAMES = ("start", "ready", "phase", "cuda_lock")
TIMEOUTS_ARG = {"type": "dict", "default": {}, "options": {name: {"type": "float"} for name in TIMEOUT_NAMES}}


def check_timeouts(timeouts: Any, *, option: str = "timeouts") -> dict[str, float]:
    """The given timeouts (None values dropped: the argument spec fills unset ones with None), each a finite
    number of seconds > 0; ColdSnapError naming ``option.<name>`` and the fix otherwise."""
    if timeouts is None:
        return {}
    if not isinstance(timeouts, dict):
        raise ColdSnapError(f"{option} must be a mapping of timeout names to seconds, not {type(timeouts).__name__}",
                            fix="give e.g. {phase: 120}")
    out = {}
    for name, value in timeouts.items():
        if name not in TIMEOUT_NAMES:
            raise ColdSnapError(f"{option}.{name} is not a timeout ColdSnap knows",
                                fix=f"give {', '.join(TIMEOUT_NAMES[:-1])} or {TIMEOUT_NAMES[-1]}")
        if value is None:
            continue
        if not is_seconds(value, zero=False):
            raise ColdSnapError(f"{option}.{name} is {value!r}", fix="give a finite number of seconds greater than 0")
        out[name] = float(value)
    return out


def pack_relpath(hex_digest: str) -> str:
    """``model-payloads/sha256/<hex>.pack`` (relative to the state root)."""
    return f"{PACK_DIR}/{hex_digest}{PACK_SUFFIX}"


@dataclass(frozen=True)
class UnitSwitch:
    """A yes/no choice a unit's environment makes for ColdSnap: the words it accepts (case and
    surrounding blanks ignored) with what each means, and what request validation says of another."""

    name: str
    values: dict[str, bool]
    problem: str  # "{value!r} is neither ..." ends the message
    fix: str

    def read(self, environment: dict | None, default: bool) -> bool:
        value = (environment or {}).get(self.name)
        return default if value is None else self.values.get(str(value).strip().lower(), default)


HUGE_PAGES_ENV = "COLDSNAP_HUGE_PAGES"
VLLM_CPU_PACKED_ENV = "COLDSNAP_VLLM_CPU_PACKED"
UNIT_SWITCHES = {
    # Off: the unit's processes come back in the pages they had, not transparent huge pages
    # (docs/user-guide.md, "GPU hosts").
    HUGE_PAGES_ENV: UnitSwitch(
        HUGE_PAGES_ENV,
        {"on": True, "1": True, "true": True, "yes": True, "off": False, "0": False, "false": False, "no": False},
        "is neither on nor off",
        "write 'on' (the unit's memory is restored into transparent huge pages), 'off' (in the pages it "
        "had), or leave it out (the host decides)"),
    # Release: a vLLM CPU unit's snapshot leaves vLLM's packed copies of the linear weights out
    # (docs/engines.md, "Packed linear weights"): smaller capsule, the copies packed again on resume.
    VLLM_CPU_PACKED_ENV: UnitSwitch(
        VLLM_CPU_PACKED_ENV,
        {"keep": False, "release": True},
        "is neither keep nor release",
        "write 'keep' (the default: the snapshot carries vLLM's packed linear weights) or 'release' "
        "(they are left out and packed again on resume)"),
}


def vllm_cpu_packed_released(environment: dict | None) -> bool:
    """Whether a snapshot of a vLLM CPU unit with this (validated) environment leaves the packed copies out."""
    return UNIT_SWITCHES[VLLM_CPU_PACKED_ENV].read(environment, False)


def huge_pages_wanted(environment: dict | None, *, default: bool = True) -> bool:
    """Whether a unit with this (validated) environment is restored into huge pages; ``default`` when it
    does not say (the host's choice: ``process.criu.huge_pages_by_default``)."""
    return UNIT_SWITCHES[HUGE_PAGES_ENV].read(environment, default)


@dataclass(frozen=True)
class PayloadRef:
    """A file of a worker's payload: ``path`` (relative to its directory, or to the state root
    for a pack), byte ``size``, ``sha256`` (``sha256:<hex>``)."""

    path: str
    size: int
    sha256: str

    @classmethod
    def for_pack(cls, sha256: str, size: int) -> PayloadRef:
        """The node-cache object of a model pack: its path derives from its digest."""
        return cls(path=pack_relpath(ids.parse_digest(sha256, what="model payload digest")), size=size, sha256=sha256)

    # The pack writers' historical name.
    for_digest = for_pack

    @classmethod
    def from_json(cls, data: Any) -> PayloadRef:
        if isinstance(data, PayloadRef):
            return data
        if not isinstance(data, dict):
            raise ValueError("a payload reference is an object {path, size, sha256}")
        try:
            ref = cls(path=str(data["path"]), size=int(data["size"]), sha256=str(data["sha256"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a payload reference needs path, size and sha256 ({exc})") from None
        if ref.size < 0:
            raise ValueError("a payload reference has a negative size")
        return ref

    def to_json(self) -> dict:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}

    as_dict = to_json


@dataclass(frozen=True)
class WorkerFiles:
    """Where one worker's captured payload files are: ``<unit dir>/workers/<worker>/``."""

    directory: Path

    @classmethod
    def of(cls, unit_dir: Path | str, worker: str) -> WorkerFiles:
        return cls(Path(unit_dir) / "workers" / worker)

    @property
    def residual(self) -> Path:
        return self.directory / RESIDUAL_NAME

    @property
    def manifest(self) -> Path:
        return self.directory / MANIFEST_NAME

    @property
    def replay(self) -> Path:
        return self.directory / REPLAY_PLAN_NAME


@dataclass
class UnitSpec:
    """One launch unit's activation, as decided on its host (written 0600 for the runtime)."""

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
    launcher: dict = field(default_factory=dict)
    # Restore only: how the captured listeners move (process.placement.Placement.to_json()).
    placement: dict = field(default_factory=dict)
    # Where the unit writes its live progress (module option progress_dir); None: nowhere.
    progress_dir: str | None = None

    @property
    def unit_id(self) -> str:
        return self.unit["id"]

    @property
    def index(self) -> int:
        return self.unit["index"]

    def timeout(self, name: str, default: float) -> float:
        return float(self.timeouts.get(name, default))

    def worker_files(self, worker: str) -> WorkerFiles:
        return WorkerFiles.of(self.unit_dir, worker)

    @classmethod
    def from_json(cls, data: dict, *, source: str = "unit spec") -> UnitSpec:
        data = dict(data)
        if data.pop("kind", None) != UNIT_SPEC_KIND or data.pop("format", None) != UNIT_SPEC_FORMAT:
            raise ValueError(f"{source} is not a {UNIT_SPEC_KIND} format {UNIT_SPEC_FORMAT} document")
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"{source}: unknown fields {unknown}")
        if data.get("operation") not in UNIT_OPERATIONS:
            raise ValueError(f"{source}: unknown unit operation {data.get('operation')!r}")
        return cls(**data)

    @classmethod
    def load(cls, path: Path | str) -> UnitSpec:
        return cls.from_json(json.loads(Path(path).read_text()), source=str(path))

    def to_json(self) -> dict:
        out: dict = {"format": UNIT_SPEC_FORMAT, "kind": UNIT_SPEC_KIND}
        out.update({k: getattr(self, k) for k in self.__dataclass_fields__})
        return out

    def replace(self, **changes: Any) -> UnitSpec:
        return UnitSpec(**{**{k: getattr(self, k) for k in self.__dataclass_fields__}, **changes})


def new_evidence(*, operation: str, operation_id: str, capture_id: str, unit: str, host: str, **fields: Any) -> dict:
    """A unit evidence document (the runtime's answer for one unit)."""
    return {"format": EVIDENCE_FORMAT, "kind": EVIDENCE_KIND, "operation": operation, "operation_id": operation_id,
            "capture_id": capture_id, "unit": unit, "host": host, **fields}


def load_evidence(path: Path | str) -> dict:
    """A unit's capture evidence (``evidence.json``), checked for its kind and format."""
    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict) or doc.get("kind") != EVIDENCE_KIND or doc.get("format") != EVIDENCE_FORMAT:
        raise ValueError(f"{path} is not {EVIDENCE_KIND} format {EVIDENCE_FORMAT}")
    return doc
