# Copyright: ColdSnap maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Action plugin of coldsnap.fleet.job_wait: hand a foreground step's result on without a host round trip.

A step that ran in the foreground (``async: 0``) or was skipped has no job to look at: its
result is handed on here, on the control node, as the module would return it (warnings,
deprecations and the step's spans were reported by the step's own task). Only a real async job runs the module on the
host, where the job file and the progress records are.
"""

from __future__ import annotations

from ansible.plugins.action import ActionBase
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.async_job import ARGUMENT_SPEC, TIMING_KEY

# Reported by the step's own task already: warnings shown once, its spans in the receipt once.
_SHOWN_BY_THE_STEP = ("warnings", "deprecations", "invocation", TIMING_KEY)


class ActionModule(ActionBase):
    """Run the job_wait module only when there is an async job to look at."""

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        # The module's own options, checked here too: a misspelt option or a wrong type fails the same way
        # whether or not the step ran as a job.
        _validation, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        job = args["job"]
        if "ansible_job_id" not in job:
            handed = {k: v for k, v in job.items() if k not in _SHOWN_BY_THE_STEP}
            handed["finished"] = True
            result.update(handed)
            if handed.get("failed"):
                result["msg"] = handed.get("msg") or "the step failed"
            return result
        # A copy: the module call adds Ansible's internal arguments to the dict it is given, and an until-loop
        # runs this same task again.
        result.update(self._execute_module(module_name="coldsnap.fleet.job_wait", module_args=dict(self._task.args),
                                           task_vars=task_vars))
        return result
