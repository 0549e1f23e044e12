#!/usr/bin/python
# Copyright: ColdSnap maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module coldsnap.fleet.job_wait."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: job_wait
short_description: Wait for a long ColdSnap step that runs as an async job, with live progress
version_added: "0.1.0"
description:
  - Takes the registered result of a task that ran with C(async) and C(poll=0) and looks at the job once.
    Run it with C(until), C(retries) and C(delay). Every retry returns C(coldsnap_progress) (what the step
    reports while it runs, read from O(progress_dir)), which the C(coldsnap) controller shows live.
  - Once the job has ended it returns the job's own result unchanged (C(failed), C(msg), C(changed) and
    every return value), so a register or a failure message reads the same as when the step ran in the
    foreground, and removes the job file and the progress directory.
  - Every look refreshes the job's lease; a job whose lease runs out (the run was cancelled and nobody
    waits any more) stops itself.
  - A O(job) without C(ansible_job_id) (the step ran in the foreground, or was skipped) is returned as it is.
  - Runs on the host that runs the job.
author:
  - ColdSnap maintainers (@coldsnap)
extends_documentation_fragment:
  - coldsnap.fleet.attributes
  - coldsnap.fleet.attributes.ACTION_GROUP
  - coldsnap.fleet.state.UNUSED
options:
  job:
    description: The registered result of the async task (C(ansible_job_id) and C(results_file)).
    type: dict
    required: true
  progress_dir:
    description: The progress directory the async step was given (its O(progress_dir) option).
    type: path
  cleanup:
    description: Remove the job file and O(progress_dir) once the job has ended.
    type: bool
    default: true
attributes:
  check_mode:
    support: full
    details:
      - Reads the job (and refreshes its lease); the step's own check mode decides what it changes.
      - With O(cleanup), the async job's own files (its results file and O(progress_dir), which the step
        wrote in this same run) are removed in check mode too, as C(ansible.builtin.async_status) with
        C(mode=cleanup) does; nothing else is touched.
  diff_mode:
    support: full
    details: Returns the step's own C(diff).
  idempotent:
    support: full
    details: Changes nothing itself; C(changed) is the step's.
notes:
  - The controller renders C(coldsnap_progress) of every C(runner_retry) event; other callers see it in
    the retry's result.
"""

EXAMPLES = r"""
- name: Stage the payload (async, with live progress)
  coldsnap.fleet.payload_stage:
    sha256: "{{ worker.payload.sha256 }}"
    size: "{{ worker.payload.size }}"
    source: {kind: local, path: /srv/exports/model-weights.pack}
    progress_dir: "{{ progress_root }}/stage-{{ worker.worker }}"
  async: 7200
  poll: 0
  register: staged_job

- name: Stage the payload (wait)
  coldsnap.fleet.job_wait:
    job: "{{ staged_job }}"
    progress_dir: "{{ progress_root }}/stage-{{ worker.worker }}"
  register: staged
  until: staged.finished | default(true)
  retries: 14400
  delay: 0.5
"""

RETURN = r"""
finished:
  description: The job has ended (then every other key is the step's own result).
  returned: always
  type: bool
  sample: false
ansible_job_id:
  description: The async job's id.
  returned: when O(job) is an async job
  type: str
  sample: "j312337413706.4242"
coldsnap_progress:
  description: While the job runs, the step's progress records (phase, message, done, total, unit, elapsed_s).
  returned: while the job runs and has reported progress
  type: list
  elements: dict
  sample: [{phase: stage, message: copy model-weights.pack, done: 1048576, total: 3440640, unit: bytes}]
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.async_job import ARGUMENT_SPEC, look
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    p = module.params
    try:
        result = look(p["job"], progress_dir=p["progress_dir"], remove=p["cleanup"])
    except ColdSnapError as exc:
        module.fail_json(msg=str(exc), finished=True)
    # The step's own result went through its module's exit_json already (no_log values masked); its
    # warnings are handed on as this module's, so Ansible shows them once.
    for warning in result.pop("warnings", None) or []:
        module.warn(warning if isinstance(warning, str) else str(warning.get("msg") or warning))
    result.pop("deprecations", None)
    if result.get("failed"):
        result.pop("failed")
        module.fail_json(msg=result.pop("msg"), **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
