#!/usr/bin/python
# Copyright: ColdSnap maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module coldsnap.fleet.overlay_capture."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: overlay_capture
short_description: Capture this host's running, restored launch units in place (target-local overlay)
version_added: "0.1.0"
description:
  - The one-time capture behind a target-local residual overlay. Nothing is started - the running engines
    of the workload are adopted, validated, quiesced, exported (the model payload converges on the object
    already in the node cache, which proves it is the shared one), released and dumped with CRIU leaving
    them running; then they are resumed in place from the payload and validated again, so the workload keeps
    serving.
  - Every worker's payload must already be in this host's node cache with a valid validation record (a
    background materialization is waited for up to O(payload_wait) seconds).
  - The result is a capture directory like M(coldsnap.fleet.unit_capture)'s; build its capsules with
    M(coldsnap.fleet.capsule_build) and record it with M(coldsnap.fleet.artifact_store) O(coldsnap.fleet.artifact_store#module:state=overlay).
extends_documentation_fragment:
  - coldsnap.fleet.attributes
  - coldsnap.fleet.attributes.ACTION_GROUP
  - coldsnap.fleet.state
  - coldsnap.fleet.state.REQUEST
  - coldsnap.fleet.state.CLAIM
  - coldsnap.fleet.state.TIMEOUTS
options:
  artifact:
    description: The portable artifact the workload was restored from.
    type: dict
    required: true
  host:
    description: Inventory hostname of this host.
    type: str
    required: true
  capture_id:
    description: Identity of the in-place capture.
    type: str
    required: true
  activation_digest:
    description: Digest of the staged activation runtime.
    type: str
    required: true
  coordinator_endpoint_file:
    description: Endpoint descriptor of the activation coordinator (needed with several units).
    type: path
  python:
    description: Python that runs the activation runtime.
    type: path
  payload_wait:
    description: Seconds to wait for a background materialization to complete and verify.
    type: float
    default: 600
attributes:
  check_mode:
    support: full
    details: Reports whether a capture would run.
  diff_mode:
    support: none
  idempotent:
    support: full
    details: A completed capture id is reported again without changes.
author:
  - ColdSnap maintainers (@coldsnap)
"""

EXAMPLES = r"""
- name: Capture the restored units in place
  coldsnap.fleet.overlay_capture:
    request: "{{ coldsnap_request }}"
    artifact: "{{ coldsnap_artifact }}"
    host: "{{ inventory_hostname }}"
    capture_id: "{{ coldsnap_request.id }}.overlay"
    activation_digest: "{{ coldsnap_host_activation.digest }}"
    coordinator_endpoint_file: /var/lib/coldsnap/runs/op-1/coordinator.json
"""

RETURN = r"""
capture_id:
  description: Identity of the in-place capture.
  returned: success
  type: str
  sample: chat-restore-7.overlay
units:
  description: Evidence of each unit captured in place (empty in check mode).
  returned: success
  type: list
  elements: dict
coldsnap_timing:
  description: Spans of each unit on its own clock.
  returned: when this host has units to capture, not in check mode
  type: dict
"""

from pathlib import Path

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.modutil import run_guarded
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import STATE_ROOT_ARG
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import validate_artifact
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import TIMEOUTS_ARG
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.capture import capture_running_units


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            state_root=dict(STATE_ROOT_ARG),
            request=dict(type="dict", required=True),
            artifact=dict(type="dict", required=True),
            host=dict(type="str", required=True),
            capture_id=dict(type="str", required=True),
            activation_digest=dict(type="str", required=True),
            coordinator_endpoint_file=dict(type="path"),
            python=dict(type="path"),
            payload_wait=dict(type="float", default=600.0),
            timeouts=dict(TIMEOUTS_ARG),
            run_id=dict(type="str"),
        ),
        supports_check_mode=True,
    )
    p = module.params

    def run() -> dict:
        req = validate_request(p["request"], document="request (module option)")
        art = validate_artifact(p["artifact"], document="artifact (module option)")
        return capture_running_units(req, art, host=p["host"], capture_id=p["capture_id"],
                                     state_root=Path(p["state_root"]), activation_digest=p["activation_digest"],
                                     coordinator_endpoint=p["coordinator_endpoint_file"], python=p["python"],
                                     check_mode=module.check_mode, payload_wait=p["payload_wait"],
                                     timeouts=p["timeouts"], run_id=p["run_id"])

    run_guarded(module, run, what="overlay_capture")


if __name__ == "__main__":
    main()
