"""The contract between the controller (or an AWX job template) and the playbooks.

Everything a playbook may rely on, and everything it reports back, is named
here once:

* extra vars in: ``coldsnap_request`` (the normalized request), ``coldsnap_prepare_only``
  and ``coldsnap_state_root``: the CLI passes exactly these, and an AWX job
  template passes the same three (plus AWX's own ``awx_*``/``tower_*`` vars);
* the operation's result out: ``set_stats`` key ``coldsnap_result`` (with the
  default ``per_host: false``), which ansible-runner and AWX both surface as the
  ``playbook_on_stats`` event's ``artifact_data``;
* unit timing out: a module result key ``coldsnap_timing`` =
  ``{"spans": [...], "marks": [...]}`` recorded on ``unit:<id>`` clocks;
* live progress out: a module result key ``coldsnap_progress``.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.progress import RESULT_PROGRESS_KEY

from coldsnap._collection import CollectionNotFound, collection_root

EXTRAVAR_REQUEST = "coldsnap_request"
EXTRAVAR_PREPARE_ONLY = "coldsnap_prepare_only"
EXTRAVAR_STATE_ROOT = "coldsnap_state_root"
RESERVED_EXTRAVARS = (EXTRAVAR_REQUEST, EXTRAVAR_PREPARE_ONLY, EXTRAVAR_STATE_ROOT)
# Long steps run as async jobs waited for with live progress (the playbooks' default); the controller sets
# it false when nobody watches (no terminal, --quiet): the steps then run in the foreground, without the
# launch and the looks that live progress costs. A caller's own -e value wins.
EXTRAVAR_LIVE_PROGRESS = "coldsnap_live_progress"
# This run's id (units/claim.py): drawn by the controller, else by the playbooks' first play.
EXTRAVAR_RUN_ID = "coldsnap_run_id"
# The restore playbook keeps an unused hand-over for the controller's rollback instead of giving it back.
EXTRAVAR_KEEP_HANDOVER = "coldsnap_keep_handover"

STATS_RESULT_KEY = "coldsnap_result"
RESULT_TIMING_KEY = "coldsnap_timing"
__all__ = ["RESULT_PROGRESS_KEY", "RESULT_TIMING_KEY", "STATS_RESULT_KEY"]
# RESULT_PROGRESS_KEY ("coldsnap_progress") is defined once, in module_utils.common.progress: the modules write it.

PREPARE_ONLY_OPERATIONS = ("restore", "warm")
COLLECTION_NAMESPACE = "coldsnap.fleet"


def operation_extravars(request: Mapping[str, Any] | None, *, prepare_only: bool = False,
                        state_root: str | Path | None = None) -> dict[str, Any]:
    """The extra vars an operation's playbook receives (CLI and AWX job templates alike).

    :func:`~coldsnap.runner.run_playbook` sets them itself from its own ``request``,
    ``prepare_only`` and ``state_root``; an AWX job template passes them as launch vars."""
    out: dict[str, Any] = {EXTRAVAR_PREPARE_ONLY: bool(prepare_only)}
    if request is not None:
        out[EXTRAVAR_REQUEST] = dict(request)
    if state_root is not None:
        out[EXTRAVAR_STATE_ROOT] = str(state_root)
    return out


def check_prepare_only(operation: str, prepare_only: bool) -> None:
    """prepare_only is for restore and warm only."""
    if prepare_only and operation not in PREPARE_ONLY_OPERATIONS:
        raise ColdSnapError(f"prepare_only (--prepare-only) does not apply to operation {operation!r}",
                            fix=f"use it with {' or '.join(PREPARE_ONLY_OPERATIONS)}, or leave it out")


def with_contract_extravars(extravars: Mapping[str, Any], contract: Mapping[str, Any]) -> dict[str, Any]:
    """``extravars`` plus the contract's; a contract var the caller set to another value is refused, so
    what the playbook reads (``coldsnap_prepare_only``...) and what the controller records cannot differ."""
    for key, value in contract.items():
        if key in extravars and extravars[key] != value:
            raise ColdSnapError(
                f"extra var {key} = {reprlib.repr(extravars[key])} disagrees with the run's own value "
                f"{reprlib.repr(value)}",
                fix=f"leave {key} out of the extra vars: the controller sets {', '.join(RESERVED_EXTRAVARS)} "
                    "from the request, prepare_only and state_root it is given")
    return {**extravars, **contract}


def collection_dir() -> Path:
    """The installed (or linked) ``ansible_collections/coldsnap/fleet`` directory."""
    try:
        root = collection_root()
    except CollectionNotFound as exc:
        raise ColdSnapError(str(exc)) from None
    return (root / "ansible_collections" / "coldsnap" / "fleet").resolve()


def playbook_name(operation: str) -> str:
    """``publish-native`` -> ``publish_native``: the playbook's file stem."""
    return operation.replace("-", "_")


def playbook_for(operation: str) -> Path:
    """Absolute path of the collection playbook that runs ``operation``; error when it is missing."""
    return resolve_playbook(f"playbooks/{playbook_name(operation)}.yml", from_cwd=False)


def resolve_playbook(playbook: str | Path, *, from_cwd: bool = True) -> Path:
    """Turn a playbook reference into an absolute, existing path.

    Accepted: an FQCN (``coldsnap.fleet.capture`` -> ``<collection>/playbooks/capture.yml``),
    an absolute path, or a relative path: from the current directory when a file is there (unless
    ``from_cwd`` is false: the operation's own playbook), else from the collection directory
    (``playbooks/capture.yml``).
    """
    text = str(playbook)
    prefix = COLLECTION_NAMESPACE + "."
    fqcn = text.startswith(prefix) and "/" not in text
    if fqcn:
        path = collection_dir() / "playbooks" / f"{text[len(prefix):]}.yml"
    else:
        path = Path(text)
        if not path.is_absolute():  # a user's: from the current directory first, else the collection's
            here = Path.cwd() / path
            path = here if from_cwd and here.is_file() else collection_dir() / path
    if not path.is_file():
        raise ColdSnapError(
            f"playbook {text} does not exist ({path})",
            fix="the operation's playbook is not part of this collection yet; update the collection, "
                "or pass --playbook PATH to run another playbook" if fqcn or not from_cwd else
                f"give an existing playbook: an absolute path, a path from the current directory ({Path.cwd()}) "
                "or from the collection, or a name such as coldsnap.fleet.capture",
        )
    return path.resolve()


def set_stats_artifacts(events: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The ``set_stats`` data of a run: what AWX shows as the job's artifacts.

    AWX (and ansible-runner) take it from the ``playbook_on_stats`` event's
    ``event_data.artifact_data``; only ``per_host: false`` stats land there. The
    last such event wins (a run has one).
    """
    artifacts: dict[str, Any] = {}
    for event in events:
        if event.get("event") == "playbook_on_stats":
            data = (event.get("event_data") or {}).get("artifact_data")
            artifacts = dict(data) if isinstance(data, Mapping) else {}
    return artifacts
