"""Run ColdSnap operations from Python: what ``coldsnap <operation>`` does, as functions.

One function per operation (``publish-native`` is :func:`publish_native`)::

    from coldsnap import api

    receipt = api.restore("restore.json", prepare_only=True, inventory="hosts.yml")
    if not receipt.succeeded:
        print(receipt.error.message)

Each one validates and normalizes the request (a dict, or the path of a JSON file;
``"-"`` is stdin) as strictly as the command line does, refuses a request of
another operation, checks that every ``launch.units[].host`` is in the inventory,
runs the collection's playbook for the operation through ansible-runner and
returns the run's :class:`Receipt` (also for a failed or cancelled run). Problems
a user can fix before anything runs raise ColdSnapError (FormatError for an
invalid request), naming the field and the fix.

Without the collection coldsnap.fleet, importing this module raises
:class:`~coldsnap._collection.CollectionNotFound` (an ImportError) saying how to
install it.
"""

from __future__ import annotations

import datetime as dt
import os
import stat
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import (
    STATE_ROOT_ENV,
    state_root_from_env,
    user_state_root,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.receipt import load_receipt
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import (
    validate_request,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.strictjson import strict_loads

from coldsnap.commands._io import read_input
from coldsnap.runner import RESERVED_EXTRAVARS, default_state_root, run_playbook
from coldsnap.runner.contract import check_prepare_only
from coldsnap.runner.driver import EventHandler, StatusHandler, require_operation
from coldsnap.runner.drivers import resolve_snapshot_driver
from coldsnap.runner.timing_stream import TimingTarget

RequestSource = Mapping[str, Any] | str | os.PathLike[str]
Inventory = Mapping[str, Any] | str | os.PathLike[str] | None


@dataclass(frozen=True)
class ReceiptError:
    """Why an operation failed: the receipt's ``error``."""

    message: str
    host: str | None
    task: str | None
    phase: str | None


@dataclass(frozen=True)
class Receipt:
    """Receipt format 2 of one run, typed; ``raw`` is the document as written to ``path``."""

    operation_id: str
    operation: str
    state: str  # succeeded | failed | running
    prepare_only: bool
    replay_semantics: str
    request_sha256: str | None
    engine: str | None
    snapshot_driver: str | None
    started_at: dt.datetime
    completed_at: dt.datetime | None
    duration_seconds: float
    timing: dict[str, Any]
    result: dict[str, Any] | None
    error: ReceiptError | None
    raw: dict[str, Any]
    path: Path | None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, path: str | os.PathLike[str] | None = None) -> Receipt:
        doc = dict(raw)
        err = doc["error"]
        return cls(
            operation_id=doc["operation_id"], operation=doc["operation"], state=doc["state"],
            prepare_only=bool(doc["prepare_only"]), replay_semantics=doc["replay_semantics"],
            request_sha256=doc["request_sha256"], engine=doc["engine"], snapshot_driver=doc["snapshot_driver"],
            started_at=dt.datetime.fromisoformat(doc["started_at"]),
            completed_at=dt.datetime.fromisoformat(doc["completed_at"]) if doc["completed_at"] else None,
            duration_seconds=float(doc["duration_seconds"]), timing=doc["timing"], result=doc["result"],
            error=ReceiptError(err["message"], err.get("host"), err.get("task"), err.get("phase")) if err else None,
            raw=doc, path=Path(path) if path is not None else None)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Receipt:
        """Read and validate a receipt file."""
        return cls.from_dict(load_receipt(Path(path).read_bytes()), path=path)

    @property
    def succeeded(self) -> bool:
        return self.state == "succeeded"

    @property
    def cancelled(self) -> bool:
        """Stopped by a cancel event, SIGINT, SIGTERM or SIGHUP (the run failed)."""
        return bool(((self.result or {}).get("runner") or {}).get("cancelled"))

    @property
    def exit_code(self) -> int:
        """What ``coldsnap <operation>`` exits with: 0 succeeded, 1 failed, 130 cancelled."""
        return 130 if self.cancelled else (0 if self.succeeded else 1)


def load(request: RequestSource, *, snapshot_driver: str | None = None, document: str | None = None) -> dict:
    """Validate and normalize a request: a dict, or the path of a JSON file (``"-"``: stdin).
    ``snapshot_driver``: the driver a request that names none is normalized for."""
    raw, name = decoded_request(request)
    return validate_request(raw, document=document or name, snapshot_driver=snapshot_driver)


def decoded_request(request: RequestSource) -> tuple[Any, str]:
    """The request as decoded JSON (not yet validated) and the document name its errors use."""
    if isinstance(request, dict):
        return request, "request"  # as decoded: a strict decoder's record of duplicate keys stays with it
    if isinstance(request, Mapping):
        return dict(request), "request"
    if not isinstance(request, str | os.PathLike):
        return request, "request"  # not an object: validation says so at "$"
    name = os.fspath(request)
    document = f"request {name if name != '-' else '(stdin)'}"
    return strict_loads(read_input(name), document=document), document


def resolve_state_root(value: str | os.PathLike[str] | None) -> Path:
    """``value``, else ``$COLDSNAP_STATE_ROOT``, else the per-user default (/var/lib/coldsnap for root), as an
    absolute path (a relative one is taken from the current directory, here: the playbook runs elsewhere).

    An empty value or variable, and a path that exists and is not a directory, are refused here, before
    anything is written below it; the message names where the path came from."""
    if value is not None and not str(value).strip():
        # an unset shell variable ("$SR") must not mean the default state root, which holds production state
        raise ColdSnapError("--state-root is empty", fix="give a directory, or leave the option out for "
                            f"{_default_state_root_text()}")
    from_env = False
    if value is not None:
        root = Path(value).expanduser()
    else:
        root = state_root_from_env()  # refuses a variable that is set but empty
        from_env = root is not None
        if root is None:
            root = user_state_root()
    root = root.absolute()
    named = f"state root {root}" + (f" (from {STATE_ROOT_ENV})" if from_env else "")
    if from_env:
        elsewhere = f"set {STATE_ROOT_ENV} to the state directory (the one holding runs/), or unset it"
    elif value is not None:
        elsewhere = f"pass --state-root the state directory, or leave it out for {_default_state_root_text()}"
    else:
        elsewhere = f"pass --state-root the state directory (or set {STATE_ROOT_ENV})"
    try:
        st = os.stat(root)
    except FileNotFoundError:
        return root  # made by the first operation
    except OSError as exc:
        raise ColdSnapError(f"{named} cannot be read ({exc.strerror or exc})",
                            fix=f"run as a user who may use it, or {elsewhere}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ColdSnapError(f"{named} is not a directory", fix=elsewhere)
    return root


def _default_state_root_text() -> str:
    """Where the state root is without --state-root, for a message (never raises)."""
    try:
        root = default_state_root()
    except ColdSnapError:  # the variable is set but empty
        return f"{user_state_root()} (once the empty {STATE_ROOT_ENV} is unset)"
    return f"{root.absolute()}" + (f" (from {STATE_ROOT_ENV})" if os.environ.get(STATE_ROOT_ENV) is not None
                                   else f" (or set {STATE_ROOT_ENV})")


def run(operation: str, request: RequestSource, *, prepare_only: bool = False, inventory: Inventory = None,
        state_root: str | os.PathLike[str] | None = None, extravars: Mapping[str, Any] | None = None,
        secrets: Mapping[str, Any] | None = None, playbook: str | os.PathLike[str] | None = None,
        event_handler: EventHandler | None = None, status_handler: StatusHandler | None = None,
        timing_sink: TimingTarget = None, progress: bool | None = False, progress_stream: IO[str] | None = None,
        cancel_event: threading.Event | None = None, envvars: Mapping[str, str] | None = None,
        verbosity: int = 0, rollback: bool = True) -> Receipt:
    """Run ``operation`` on ``request``; the per-operation functions call this.

    ``prepare_only`` (restore and warm): admission, staging and verification, the running
    workload untouched; it is the playbook's ``coldsnap_prepare_only`` and the receipt's
    ``prepare_only``, set once here. ``inventory``: a path (any format Ansible reads) or an
    inventory dict; None builds one from the request (``localhost`` runs locally).
    ``state_root``: default ``$COLDSNAP_STATE_ROOT``, else the per-user default. ``extravars``:
    more extra vars (secret-looking names travel as secrets); ``secrets``: extra vars that always
    do. ``playbook``: another playbook (path or FQCN) instead of the collection's.
    ``event_handler(event)`` / ``status_handler(data, runner_config=...)``: ansible-runner's
    callbacks, given what the artifacts store (known secrets redacted); an exception they raise
    becomes a warning in the receipt. ``timing_sink``: see :mod:`coldsnap.runner.timing_stream`;
    ``progress``: progress lines on ``progress_stream`` (stderr), None = when it is a terminal;
    ``cancel_event``: set it to stop the run (the receipt is still written). ``rollback`` (restore and
    warm): a failure after the evict step restores the workload that ran before, when this state root's
    controller restored it (:mod:`coldsnap.runner.rollback`; the receipt's ``result.rollback``).
    """
    check_prepare_only(operation, prepare_only)  # an argument error comes before the request's
    reserved = sorted((set(extravars or {}) | set(secrets or {})) & set(RESERVED_EXTRAVARS))
    if reserved:
        raise ColdSnapError(f"extra var {', '.join(reserved)} is set by the controller",
                            fix="leave it out: the request, prepare_only and state_root are arguments of their own")
    raw, document = decoded_request(request)
    if isinstance(raw, dict) and isinstance(raw.get("operation"), str):
        require_operation(raw, operation)  # before the snapshot driver's choice asks any host for facts
    notes: dict[str, Any] = {}
    gone = _artifact_gone(operation, raw)
    if gone:
        # status and stop act on what runs, which outlives its artifact (`coldsnap delete` keeps it running)
        raw = {k: v for k, v in raw.items() if k != "artifact"}
        notes["artifact_gone"] = gone
    driver, selection = resolve_snapshot_driver(operation, raw, inventory=inventory, envvars=envvars)
    if selection:
        notes["snapshot_driver_selection"] = selection
    normalized = validate_request(raw, document=document, snapshot_driver=driver)
    result = run_playbook(
        operation=operation, request=normalized, playbook=playbook,
        extravars=dict(extravars or {}), secret_extravars=secrets, inventory=inventory,
        state_root=resolve_state_root(state_root),
        prepare_only=prepare_only, timing_sink=timing_sink, progress=progress, progress_stream=progress_stream,
        cancel_event=cancel_event, envvars=envvars, verbosity=verbosity, event_handler=event_handler,
        status_handler=status_handler, notes=notes or None, rollback=rollback)
    return Receipt.from_dict(result.receipt, path=result.receipt_path)


#: Operations that read the artifact when it is there and act on the running workload without it.
ARTIFACT_OPTIONAL = ("status", "stop")


def _artifact_gone(operation: str, raw: Any) -> str | None:
    """The artifact path a status or stop request names when nothing is there any more."""
    if operation not in ARTIFACT_OPTIONAL or not isinstance(raw, dict) or not isinstance(raw.get("artifact"), dict):
        return None
    path = raw["artifact"].get("path")
    return path if isinstance(path, str) and path and not os.path.lexists(path) else None


def _operation(operation: str, summary: str) -> Callable[..., Receipt]:
    def call(request: RequestSource, **options: Any) -> Receipt:
        return run(operation, request, **options)

    call.__name__ = call.__qualname__ = operation.replace("-", "_")
    call.__doc__ = (f"{summary[0].upper()}{summary[1:]}: :func:`run` with operation {operation!r} "
                    f"(playbooks/{operation.replace('-', '_')}.yml); returns its :class:`Receipt`.")
    return call


# One line per operation: the functions' docstrings and the command line's help.
SUMMARIES = {
    "capture": "capture a running, validated server into an artifact",
    "restore": "restore a captured artifact (admission, staging, evict, restore, validate)",
    "warm": "warm restore: stop after the transport rebuild; a later wake finishes it",
    "publish": "publish the capsules of an artifact to an OCI registry",
    "publish-native": "publish the native model payload of an artifact",
    "sleep": "put a restored workload to sleep",
    "wake": "wake a sleeping (or warm-restored) workload",
    "status": "report the state of a workload",
    "stop": "stop a workload's engines, keeping everything on disk for the next restore",
    "native-status": "report the native payload state of an artifact on each host",
    "delete": "delete an artifact generation and what only it references",
}

capture = _operation("capture", SUMMARIES["capture"])
restore = _operation("restore", SUMMARIES["restore"])
warm = _operation("warm", SUMMARIES["warm"])
wake = _operation("wake", SUMMARIES["wake"])
sleep = _operation("sleep", SUMMARIES["sleep"])
status = _operation("status", SUMMARIES["status"])
stop = _operation("stop", SUMMARIES["stop"])
publish = _operation("publish", SUMMARIES["publish"])
publish_native = _operation("publish-native", SUMMARIES["publish-native"])
delete = _operation("delete", SUMMARIES["delete"])
native_status = _operation("native-status", SUMMARIES["native-status"])

__all__ = [
    "SUMMARIES",
    "Receipt",
    "ReceiptError",
    "capture",
    "decoded_request",
    "delete",
    "load",
    "native_status",
    "publish",
    "publish_native",
    "resolve_state_root",
    "restore",
    "run",
    "sleep",
    "status",
    "stop",
    "wake",
    "warm",
]
