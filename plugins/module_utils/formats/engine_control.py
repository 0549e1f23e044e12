"""The engine control API: the one contract between the activation runtime (client) and
every engine integration (server, inside the engine process).

Transport: HTTP/1.0 on 127.0.0.1, one request per connection,
``Authorization: Bearer <token>``. ``GET /status``; ``POST`` to the routes in
:data:`ROUTES` with a JSON object body. Replies are JSON objects
``{"ok": true, "state": ..., "monotonic_ns": ...}`` (200), or
``{"ok": false, "error": ...}`` with 400 (bad body), 401 (token), 404 (route),
409 (wrong state) or 500 (the step failed).

Where to connect: the 0600 *control file* the engine writes at start-up, at the
path the activation runtime names in :data:`ENV_CONTROL_FILE`
(``<workload dir>/control-<worker>.json``), holding :class:`ControlInfo`.

The bodies of ``/export``, ``/release`` and of ``/resume``, ``/finish-warm`` and
``/wake`` are :class:`ExportBody`, :class:`ReleaseBody` and :class:`HydrationBody`;
both ends build and read them only through these classes.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import UnitError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import PayloadRef, WorkerFiles

# ------------------------------------------------------------------ environment
ENV_CONTROL_FILE = "COLDSNAP_CONTROL_FILE"
ENV_RANK = "COLDSNAP_RANK"
ENV_WORLD_SIZE = "COLDSNAP_WORLD_SIZE"
ENV_UNIT = "COLDSNAP_UNIT"
ENV_WORKER = "COLDSNAP_WORKER"
ENV_SCOPE = "COLDSNAP_SCOPE"
ENV_COORDINATOR = "COLDSNAP_COORDINATOR"
# The state root the engine was started under: /export writes only below its captures/
# directory and into its node cache (set by the activation runtime; anything else is refused).
ENV_STATE_ROOT = "COLDSNAP_STATE_ROOT"
# "1": start as a context-free template (snapshot driver n580): imports, configuration and the
# control API, then wait in state ``template`` before any CUDA, weight or transport work; ``/start``
# continues with the cold start (capture), ``/resume`` builds the engine from a hydration (restore).
ENV_TEMPLATE = "COLDSNAP_TEMPLATE"
CAPTURES_DIR = "captures"
RUNS_DIR = "runs"

# ------------------------------------------------------------------ states
LOADING, READY, QUIESCING, QUIESCED, RELEASED, WARM, SLEEPING, TEMPLATE = (
    "loading", "ready", "quiescing", "quiesced", "released", "warm", "sleeping", "template")
STATES = (LOADING, READY, QUIESCING, QUIESCED, RELEASED, WARM, SLEEPING, TEMPLATE)

# ------------------------------------------------------------------ routes
STATUS = "/status"
QUIESCE = "/quiesce"
EXPORT = "/export"
RELEASE = "/release"
RESUME = "/resume"
FINISH_WARM = "/finish-warm"
SLEEP = "/sleep"
WAKE = "/wake"
START = "/start"
ROUTES = (QUIESCE, EXPORT, RELEASE, RESUME, FINISH_WARM, SLEEP, WAKE, START)

CONTROL_HOST = "127.0.0.1"
MAX_BODY = 1 << 20
CONTROL_FILE_NAME = "control-{worker}.json"
LOG_FILE_NAME = "target.log"


# An engine's search path when the unit's environment sets none: the runtime interpreter's directory
# first, then the system's. The command's first word is looked up there (as ``execvp`` does).
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def engine_search_path(python: str, unit_environment: dict | None = None) -> str:
    """The ``PATH`` a unit's engine starts with (the unit's own ``PATH`` wins)."""
    return (unit_environment or {}).get("PATH") or f"{os.path.dirname(python)}:{SYSTEM_PATH}"


def require_can_sleep(unit: str, states) -> None:
    """A warm restore has not served yet (its weights are not hydrated): there is nothing to put to sleep.
    The one refusal both a sleep and its check mode give."""
    if WARM in states:
        raise UnitError(f"unit {unit} is warm (restored, its weights not hydrated yet), so it cannot sleep",
                        fix="wake it to finish the restore (coldsnap wake), then sleep it; or stop it")


def require_step_states(unit: str, action: str, states) -> None:
    """The refusals a sleep, wake or finish-warm and its check mode give before any worker is asked.

    The step runs on every worker at once (engines with several workers step collectively); workers in
    different states (a step that failed on some of them) would have the step refused by some and waited
    for by the others, every time. Refused by name instead, with the way out."""
    if action == "sleep":
        require_can_sleep(unit, states)
    seen = sorted(set(states))
    if len(seen) > 1:
        raise UnitError(f"unit {unit}'s workers are in different states ({', '.join(map(str, seen))}), so they "
                        f"cannot {action} together",
                        fix="stop the workload (coldsnap stop) and restore it; its captures and payloads stay")


def control_file_path(workload_dir: Path | str, worker: str) -> Path:
    """The control file of ``worker`` in its workload directory."""
    return Path(workload_dir) / CONTROL_FILE_NAME.format(worker=worker)


@dataclass(frozen=True)
class ControlInfo:
    """What the control file says: where the engine listens, its token, its pid."""

    port: int
    token: str
    pid: int

    @classmethod
    def from_json(cls, data: Any) -> ControlInfo:
        if not isinstance(data, dict):
            raise ValueError("the control file must hold a JSON object")
        try:
            port, token, pid = int(data["port"]), str(data["token"]), int(data["pid"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"the control file lacks a valid port/token/pid ({exc})") from None
        if not 0 < port < 65536 or pid <= 0 or len(token) < 16:
            raise ValueError("the control file holds an invalid port, pid or token")
        return cls(port, token, pid)

    @classmethod
    def load(cls, path: Path | str) -> ControlInfo:
        return cls.from_json(json.loads(Path(path).read_text()))

    def to_json(self) -> dict:
        return {"port": self.port, "token": self.token, "pid": self.pid}

    @property
    def authorization(self) -> str:
        return f"Bearer {self.token}"


@dataclass(frozen=True)
class ExportBody:
    """``POST /export``: write the worker's residual, manifest, replay plan (and the pack)."""

    out_dir: str
    model: dict
    export_pack: bool = True
    state_root: str | None = None
    verify_extents: bool = True
    # Live progress of the export (module_utils.common.progress records); None: none.
    progress_dir: str | None = None

    @classmethod
    def from_json(cls, data: dict) -> ExportBody:
        if not isinstance(data.get("out_dir"), str) or not isinstance(data.get("model"), dict):
            raise ValueError("/export needs out_dir (a path) and model ({id, revision})")
        progress = data.get("progress_dir")
        return cls(out_dir=data["out_dir"], model=data["model"], export_pack=bool(data.get("export_pack", True)),
                   state_root=data.get("state_root"), verify_extents=bool(data.get("verify_extents", True)),
                   progress_dir=progress if isinstance(progress, str) else None)

    def to_json(self) -> dict:
        return asdict(self)

    def check_paths(self, state_root: str | None) -> None:
        """Refuse an export outside ``<state_root>/captures``, into another node cache, or with its
        progress outside ``<state_root>/runs``.

        ``state_root`` is the engine's :data:`ENV_STATE_ROOT` (None: an engine started outside
        ColdSnap, which trusts its caller)."""
        if not state_root:
            return
        root = os.path.realpath(state_root)
        captures = os.path.join(root, CAPTURES_DIR)
        out = os.path.realpath(self.out_dir)
        if os.path.commonpath([out, captures]) != captures or out == captures:
            raise ValueError(f"/export may write only below {captures}, not {self.out_dir}")
        if self.state_root is not None and os.path.realpath(self.state_root) != root:
            raise ValueError(f"/export writes the pack into the node cache of {root}, not {self.state_root}")
        if self.progress_dir is not None:
            runs = os.path.join(root, RUNS_DIR)
            if os.path.commonpath([os.path.realpath(self.progress_dir), runs]) != runs:
                raise ValueError(f"/export writes its progress only below {runs}, not {self.progress_dir}")


GRAPH_POLICIES = ("preserve", "recreate-from-plan")


@dataclass(frozen=True)
class ReleaseBody:
    """``POST /release``: free the weights; ``graphs`` is the capture's policy.process.graph_policy
    (``recreate-from-plan``: also drop the compiled/captured graphs, re-created when the engine resumes;
    ``preserve`` or None: they stay in the process image)."""

    graphs: str | None = None

    @classmethod
    def from_json(cls, data: dict | None) -> ReleaseBody:
        data = data or {}
        unknown = sorted(set(data) - {"graphs"})
        if unknown:
            raise ValueError(f"unknown /release fields {unknown}")
        graphs = data.get("graphs")
        if graphs is not None and graphs not in GRAPH_POLICIES:
            raise ValueError(f"/release graphs must be one of {', '.join(GRAPH_POLICIES)}, not {graphs!r}")
        return cls(graphs=graphs)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class HydrationBody:
    """``POST /resume``, ``/finish-warm`` and ``/wake``: where a worker's weights come from.

    ``provider`` is ``native`` (the staged pack + residual) or ``recovery`` (the
    pinned safetensors replayed through the plan + residual).
    """

    provider: str
    manifest: str
    residual: str
    replay: str
    pack: PayloadRef | None = None
    model_dir: str | None = None
    state_root: str | None = None
    materialize: str = "off"
    warm: bool = False
    operation_id: str | None = None
    coordinator_endpoint: str | None = None
    generation: str | None = None
    transport_env: dict = field(default_factory=dict)
    # A unit whose one control endpoint drives several workers (vLLM's in-process tensor
    # parallelism): per-rank overrides of the fields above, indexed by rank.
    workers: list | None = None

    @classmethod
    def for_worker(cls, files: WorkerFiles, *, provider: str, pack: PayloadRef | dict | None, **kw: Any) -> HydrationBody:
        """The body for a worker whose captured files are ``files``."""
        if isinstance(pack, dict):
            pack = PayloadRef.from_json(pack)
        return cls(provider=provider, manifest=str(files.manifest), residual=str(files.residual),
                   replay=str(files.replay), pack=pack, **kw)

    @classmethod
    def from_json(cls, data: dict) -> HydrationBody:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown hydration fields {unknown}")
        for name in ("provider", "manifest", "residual", "replay"):
            if not isinstance(data.get(name), str):
                raise ValueError(f"hydration body needs {name!r}")
        pack = data.get("pack")
        return cls(**{**data, "pack": PayloadRef.from_json(pack) if pack else None})

    def to_json(self) -> dict:
        out = asdict(self)
        out["pack"] = self.pack.to_json() if self.pack else None
        if out["workers"] is None:
            del out["workers"]  # one worker per endpoint: no per-rank overrides
        return out

    def get(self, key: str, default: Any = None) -> Any:
        """Mapping-style access for integrations written against the JSON body."""
        value = getattr(self, key, default)
        if key == "pack" and isinstance(value, PayloadRef):
            return value.to_json()
        return value

    def __getitem__(self, key: str) -> Any:
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return self.get(key)
