# Copyright: ColdSnap maintainers
# Apache License 2.0 (see LICENSE)
"""Shared option documentation for coldsnap.fleet modules.

Every module of the action group ``coldsnap.fleet.coldsnap`` (meta/runtime.yml) accepts the
options the group shares, so that ``module_defaults`` for ``group/coldsnap.fleet.coldsnap``
can set them once for all of its modules: ``DOCUMENTATION`` for a module that uses them,
``UNUSED`` for one that only accepts them. Their argument-spec entries come from
``module_utils/common/state_layout.py`` (``STATE_ROOT_ARG``).
"""

from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  state_root:
    description:
      - ColdSnap's state directory on the host. It holds C(model-payloads/sha256/),
        C(activation-runtime/sha256/), C(captures/), C(capsules/), C(workloads/) and C(runs/).
      - An absolute path, the same on every host of a workload (restored processes keep their paths); an
        empty or relative one is refused.
      - Shared by the modules of the action group C(coldsnap.fleet.coldsnap); set it once for all of
        them with C(module_defaults).
    type: path
    default: /var/lib/coldsnap
"""

    UNUSED = r"""
options:
  state_root:
    description:
      - ColdSnap's state directory, shared by the modules of the action group C(coldsnap.fleet.coldsnap).
      - This module accepts it so that C(module_defaults) for C(group/coldsnap.fleet.coldsnap) can set it
        for the whole group, and does not use it.
    type: path
    default: /var/lib/coldsnap
"""

    REQUEST = r"""
options:
  request:
    description:
      - The normalized operation request (format 4), as the C(coldsnap) controller passes it in
        the extra variable C(coldsnap_request). It is validated again strictly on the host.
    type: dict
    required: true
"""

    CLAIM = r"""
options:
  run_id:
    description:
      - This run's id (the playbooks pass C(coldsnap_run_id), drawn once per run; the C(coldsnap)
        controller passes its own). Each step that changes the workload holds the host's claim on it, and
        the claim tells an operation by its request id and this run id, so two runs of one request (an AWX
        job launched twice) are two operations. Omitted, the request id alone names the operation.
    type: str
"""

    TIMEOUTS = r"""
options:
  timeouts:
    description:
      - Seconds the unit's activation waits for each step, each a finite number greater than 0; an unset one
        keeps its default. Checked before anything runs (a restore checks them in C(prepare), before any eviction).
    type: dict
    default: {}
    suboptions:
      start:
        description: The engine's start (capture).
        type: float
      ready:
        description: The engine's readiness (its health and first validation).
        type: float
      phase:
        description: Each barrier between the units of one operation.
        type: float
      cuda_lock:
        description: The CUDA lock before a checkpoint.
        type: float
"""
