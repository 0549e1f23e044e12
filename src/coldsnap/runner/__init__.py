"""The controller's ansible-runner driver: run an operation's playbook with ansible-runner, write receipt and timing.

Public entry points:

* :func:`run_playbook` -> :class:`OperationResult` (:class:`RunConfig` + :class:`PlaybookRun`)
* :func:`operation_extravars`, :func:`set_stats_artifacts` (the CLI/AWX contract)
* :func:`inventory_from_request`, :func:`default_state_root`
"""

from __future__ import annotations

from coldsnap.runner.contract import (
    EXTRAVAR_PREPARE_ONLY,
    EXTRAVAR_REQUEST,
    EXTRAVAR_STATE_ROOT,
    PREPARE_ONLY_OPERATIONS,
    RESERVED_EXTRAVARS,
    RESULT_PROGRESS_KEY,
    RESULT_TIMING_KEY,
    STATS_RESULT_KEY,
    operation_extravars,
    playbook_for,
    resolve_playbook,
    set_stats_artifacts,
)
from coldsnap.runner.driver import OperationResult, PlaybookRun, RunConfig, default_state_root, run_playbook
from coldsnap.runner.inventory import UNITS_GROUP, inventory_from_request

__all__ = [
    "EXTRAVAR_PREPARE_ONLY",
    "EXTRAVAR_REQUEST",
    "EXTRAVAR_STATE_ROOT",
    "PREPARE_ONLY_OPERATIONS",
    "RESERVED_EXTRAVARS",
    "RESULT_PROGRESS_KEY",
    "RESULT_TIMING_KEY",
    "STATS_RESULT_KEY",
    "UNITS_GROUP",
    "OperationResult",
    "PlaybookRun",
    "RunConfig",
    "default_state_root",
    "inventory_from_request",
    "operation_extravars",
    "playbook_for",
    "resolve_playbook",
    "run_playbook",
    "set_stats_artifacts",
]
