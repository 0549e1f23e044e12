#!/usr/bin/python
# Copyright: ColdSnap maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module coldsnap.fleet.unit_capture."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: unit_capture
short_description: Capture the launch units of a request that run on this host
version_added: "0.1.0"
description:
  - For every unit of O(request) placed on O(host), starts the engine with the unit's exact command,
    waits for readiness, runs the exact validation request, quiesces the engine (distributed transport
    torn down through the coordinator, KV discarded), writes the residual, native manifest, replay plan
    and (with export) the model payload into the node cache, releases the weight memory, takes the CUDA
    checkpoint when the unit uses a GPU, and dumps the process with CRIU.
  - Units of one activation meet at coordinator phases, so every host's task must run at the same time
    (one play over all unit hosts). Any unit can fail the whole capture; the others stop at their next phase.
  - One operation at a time per workload on each host - while this step runs it holds the host's claim on
    the workload (a lock under C(<state_root>/locks/)), and a step of another operation (another controller,
    another AWX job) fails at once naming the holder's operation, step and pid, having changed nothing.
  - The evidence (readiness timings, validation reply, payload identities, CRIU image size) is written to
    C(<state_root>/captures/<capture_id>/units/<unit>/evidence.json) and returned.
extends_documentation_fragment:
  - coldsnap.fleet.attributes
  - coldsnap.fleet.attributes.ACTION_GROUP
  - coldsnap.fleet.state
  - coldsnap.fleet.state.REQUEST
  - coldsnap.fleet.state.CLAIM
  - coldsnap.fleet.state.TIMEOUTS
  - coldsnap.fleet.progress
options:
  host:
    description: Inventory hostname of this host, as C(launch.units[].host) names it.
    type: str
    required: true
  capture_id:
    description: Identity of this capture (the capture request's id by default).
    type: str
  activation_digest:
    description: Digest of the staged activation runtime (from M(coldsnap.fleet.activation_runtime)).
    type: str
    required: true
  coordinator_endpoint_file:
    description: The activation's coordinator endpoint descriptor on this host (mode 0600).
    type: path
  python:
    description: Python that runs the activation runtime (the host runtime's environment).
    type: path
  owner:
    description:
      - Runtime C(docker) only. The invoking user, as C({uid, gid}) or C("uid:gid"). Every state path the
        unit's rank container wrote (it runs as root) is given to this user afterwards, also when the run
        failed; mode bits are kept. Omitted, the files stay as written.
    type: raw
attributes:
  check_mode:
    support: full
    details: Reports what would be captured; starts nothing.
  diff_mode:
    support: none
  idempotent:
    support: full
    details: A capture id whose units all have evidence on this host reports no change.
notes:
  - Needs root (CRIU) and CRIU >= 4 on the host.
author:
  - ColdSnap maintainers (@coldsnap)
"""

EXAMPLES = r"""
- name: Capture this host's units
  coldsnap.fleet.unit_capture:
    request: "{{ coldsnap_request }}"
    host: "{{ inventory_hostname }}"
    state_root: /var/lib/coldsnap
    activation_digest: "{{ coldsnap_host_activation.digest }}"
    coordinator_endpoint_file: /var/lib/coldsnap/runs/op-1/coordinator.json
  register: captured
"""

RETURN = r"""
units:
  description: Evidence of each captured unit on this host.
  returned: success
  type: list
  elements: dict
  sample:
    - unit: unit-0
      readiness: {ttr_port_open_s: 9.8, ttr_http_ready_s: 9.9, ttft_s: 10.1}
      reply: "2VD{D{DDDDDDDDDD"
      workers:
        - worker: worker-0
          pid: 4242
          payload: {pack: {sha256: "sha256:bfc7...", size: 3440640, path: model-payloads/sha256/bfc7....pack}}
coldsnap_timing:
  description: Spans of each unit on its own clock (C(unit:<id>)), imported into the receipt.
  returned: when this host has units to capture, not in check mode
  type: dict
"""

from pathlib import Path

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.modutil import run_guarded
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.progress import (
    LEASE_ARG,
    PROGRESS_DIR_ARG,
    ProgressSession,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import STATE_ROOT_ARG
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import TIMEOUTS_ARG
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.capture import capture_units


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            request=dict(type="dict", required=True),
            host=dict(type="str", required=True),
            capture_id=dict(type="str"),
            activation_digest=dict(type="str", required=True),
            coordinator_endpoint_file=dict(type="path"),
            python=dict(type="path"),
            state_root=dict(STATE_ROOT_ARG),
            timeouts=dict(TIMEOUTS_ARG),
            owner=dict(type="raw"),
            progress_dir=dict(PROGRESS_DIR_ARG),
            progress_lease=dict(LEASE_ARG),
            run_id=dict(type="str"),
        ),
        supports_check_mode=True,
    )
    p = module.params

    def run() -> dict:
        req = validate_request(p["request"], document="request (module option)")
        with ProgressSession(None if module.check_mode else p["progress_dir"], lease_s=p["progress_lease"]) as session:
            return capture_units(req, host=p["host"], capture_id=p["capture_id"] or req["id"],
                                 state_root=Path(p["state_root"]), activation_digest=p["activation_digest"],
                                 coordinator_endpoint=p["coordinator_endpoint_file"], python=p["python"],
                                 check_mode=module.check_mode, timeouts=p["timeouts"], owner=p["owner"],
                                 progress_dir=session.directory, run_id=p["run_id"])

    run_guarded(module, run, what="unit_capture")


if __name__ == "__main__":
    main()
