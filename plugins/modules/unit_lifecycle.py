#!/usr/bin/python
# Copyright: ColdSnap maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module coldsnap.fleet.unit_lifecycle."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: unit_lifecycle
short_description: Sleep, wake, stop or inspect the running launch units on this host
version_added: "0.1.0"
description:
  - Live, node-local lifecycle of a running workload, not a snapshot. O(state=sleeping) discards the KV
    cache and releases the weight memory while the process, its CUDA context and its distributed
    transport stay. O(state=running) re-creates the weights at their addresses from the verified model
    payload (or the pinned safetensors), zeroes the KV cache and runs the exact validation request; it also
    finishes a warm restore. O(state=stopped) ends the unit's engines (each whole process tree, or the
    unit container) and keeps everything on disk - captures, artifacts, payloads, the model cache - so
    the workload can be restored again. O(state=status) only reports.
  - One operation at a time per workload on each host - while this step runs it holds the host's claim on
    the workload (a lock under C(<state_root>/locks/)), and a step of another operation (another controller,
    another AWX job) fails at once naming the holder's operation, step and pid, having changed nothing. O(state=status)
    takes no claim.
  - Convergent - a unit already in the wanted state is left alone and reports no change.
extends_documentation_fragment:
  - coldsnap.fleet.attributes
  - coldsnap.fleet.attributes.ACTION_GROUP
  - coldsnap.fleet.state
  - coldsnap.fleet.state.REQUEST
  - coldsnap.fleet.state.CLAIM
options:
  state:
    description: Wanted state of the units.
    type: str
    choices: [sleeping, running, stopped, status]
    default: status
  artifact:
    description:
      - The workload's artifact descriptor (format 9) - the weight provider and the accepted reply.
      - Required when O(state=running) (the weights come back from its payloads); optional for
        O(state=sleeping), O(state=stopped) and O(state=status).
    type: dict
  host:
    description: Inventory hostname of this host.
    type: str
    required: true
  activation_digest:
    description: Digest of the staged activation runtime.
    type: str
    required: true
  activation_required:
    description:
      - When false and no activation runtime with O(activation_digest) is staged on the host, change nothing
        and return RV(activation_staged=false), so the caller can stage it and run the module again.
      - When true such a host fails with the fix.
    type: bool
    default: true
  python:
    description: Python that runs the activation runtime.
    type: path
  owner:
    description:
      - Runtime C(docker) only. The invoking user, as C({uid, gid}) or C("uid:gid"). Every state path the
        step wrote as root - the spec and evidence files and whatever the activation runtime wrote in the
        unit's workload directory (it runs as root inside the unit container), and the validation records
        and locks of the node payload cache when the module itself runs as root - is given to this user
        afterwards, also when the step failed; mode bits are kept. Omitted, the files stay as written.
      - O(state=stopped) writes nothing; runtime C(host) units run as the module's own user.
    type: raw
attributes:
  check_mode:
    support: full
    details: Reports whether a unit would change state.
  diff_mode:
    support: none
  idempotent:
    support: full
    details: A second run reports no change.
author:
  - ColdSnap maintainers (@coldsnap)
"""

EXAMPLES = r"""
- name: Put the workload to sleep
  coldsnap.fleet.unit_lifecycle:
    state: sleeping
    request: "{{ coldsnap_request }}"
    artifact: "{{ coldsnap_artifact }}"
    host: "{{ inventory_hostname }}"
    activation_digest: "{{ coldsnap_host_activation.digest }}"
    owner: "1000:1000"

- name: Stop the workload (a later restore brings it back)
  coldsnap.fleet.unit_lifecycle:
    state: stopped
    request: "{{ coldsnap_request }}"
    host: "{{ inventory_hostname }}"
    activation_digest: "{{ coldsnap_host_activation.digest }}"
"""

RETURN = r"""
activation_staged:
  description:
    - Whether the activation runtime this run needed was staged. False only with O(activation_required=false)
      when a run that executes it (O(state=sleeping), O(state=running)) found it missing, and
      then nothing was done.
    - O(state=status), O(state=stopped) and check mode never run it, and answer true without looking.
  returned: success
  type: bool
  sample: true
units:
  description: Per-unit state after the run (C(ready), C(sleeping), C(warm), C(stopped), C(crashed) when its
    engine died without being stopped); C(ok) is true for every unit the run could report on. A stopped
    unit lists the engine it ended under C(stopped) (null when none ran) and C(was_crashed) (its engine had
    died without being stopped; the stop still changed its state, from crashed to stopped).
  returned: success
  type: list
  elements: dict
  sample:
    - unit: unit-0
      state: sleeping
      workers: [{worker: worker-0, pid: 4242, state: sleeping}]
coldsnap_timing:
  description:
    - Spans and marks of each unit on its own clock (C(spans), C(marks)), which the controller imports into
      the operation's timing.
  returned: when this host has units and state is not stopped, not in check mode
  type: dict
"""

from pathlib import Path

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.modutil import run_guarded
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import STATE_ROOT_ARG
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import validate_artifact
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.lifecycle import lifecycle_units

ACTIONS = {"sleeping": "sleep", "running": "wake", "stopped": "stop", "status": "status"}


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            state=dict(type="str", default="status", choices=list(ACTIONS)),
            request=dict(type="dict", required=True),
            artifact=dict(type="dict"),
            host=dict(type="str", required=True),
            activation_digest=dict(type="str", required=True),
            activation_required=dict(type="bool", default=True),
            python=dict(type="path"),
            owner=dict(type="raw"),
            state_root=dict(STATE_ROOT_ARG),
            run_id=dict(type="str"),
        ),
        required_if=[("state", "running", ["artifact"])],
        supports_check_mode=True,
    )
    p = module.params

    def run() -> dict:
        req = validate_request(p["request"], document="request (module option)")
        art = validate_artifact(p["artifact"], document="artifact (module option)") if p["artifact"] else None
        out = lifecycle_units(req, art, host=p["host"], action=ACTIONS[p["state"]], state_root=Path(p["state_root"]),
                              activation_digest=p["activation_digest"], python=p["python"],
                              check_mode=module.check_mode, activation_required=p["activation_required"],
                              owner=p["owner"], run_id=p["run_id"])
        return {"activation_staged": True, **out}

    run_guarded(module, run, what="lifecycle")


if __name__ == "__main__":
    main()
