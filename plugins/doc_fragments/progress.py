# Copyright: ColdSnap maintainers
# Apache License 2.0 (see LICENSE)
"""Shared documentation of the live-progress options of long-running coldsnap.fleet modules.

Their argument-spec entries come from ``module_utils/common/progress.py``
(``PROGRESS_DIR_ARG``, ``LEASE_ARG``).
"""

from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  progress_dir:
    description:
      - A private directory (created mode 0700) where the step writes its live progress while it runs
        (small JSON records, replaced atomically about twice a second, mode 0600).
      - Run the task with C(async) and C(poll=0) and wait for it with M(coldsnap.fleet.job_wait) given the
        same directory; every retry returns the records as C(coldsnap_progress).
      - Without it, and in check mode, nothing is written.
    type: path
  progress_lease:
    description:
      - Under C(async), seconds the job runs on without a M(coldsnap.fleet.job_wait) look at it (each look
        refreshes the lease). When it runs out (the run was cancelled), the job stops itself and the
        processes it started, instead of running on unattended. C(0) turns this off.
      - Only used with O(progress_dir), and only when the task runs with C(async).
    type: float
    default: 120
"""
