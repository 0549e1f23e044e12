#!/usr/bin/python
# Copyright: ColdSnap maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module coldsnap.fleet.native_status."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: native_status
short_description: Report which native model payloads of an artifact this host holds, per worker
version_added: "0.1.0"
description:
  - For every worker whose launch unit the request places on this host, reports the state of the worker's
    native model payload in the node cache C(<state_root>/model-payloads/sha256/) -
    C(verified) (a validation record still proves it; the next restore takes native without hashing),
    C(present) (no record yet), C(stale) (the record no longer matches the file - size, inode, mtime or
    ctime changed - or is racy, malformed or not private), C(missing), or C(none) (the capture exported no
    payload for the worker).
  - Reads validation records only; nothing is hashed unless O(verify) is set, which runs the full verifier on
    present and stale packs (a fresh record is written, a corrupt pack is quarantined and reported C(corrupt)).
extends_documentation_fragment:
  - coldsnap.fleet.attributes
  - coldsnap.fleet.attributes.ACTION_GROUP
  - coldsnap.fleet.state
  - coldsnap.fleet.state.REQUEST
options:
  artifact:
    description: The artifact descriptor (format 9) whose payloads to report.
    type: dict
    required: true
  host:
    description: Inventory hostname of this host.
    type: str
    required: true
  verify:
    description: Fully verify present and stale packs (SHA-256 of every byte) and refresh their records.
    type: bool
    default: false
attributes:
  check_mode:
    support: full
    details: With O(verify), verifies read-only (no record written, nothing quarantined).
  diff_mode:
    support: none
  idempotent:
    support: full
    details: Reporting changes nothing; a second O(verify) run finds the records valid and reports no change.
author:
  - ColdSnap maintainers (@coldsnap)
"""

EXAMPLES = r"""
- name: Report the native payload state on each unit host
  coldsnap.fleet.native_status:
    request: "{{ coldsnap_request }}"
    artifact: "{{ coldsnap_artifact }}"
    host: "{{ inventory_hostname }}"
  register: native
"""

RETURN = r"""
host:
  description: The inventory hostname reported on (O(host)).
  returned: success
  type: str
workers:
  description: One entry per worker owned by this host.
  returned: success
  type: list
  elements: dict
  sample:
    - {worker: worker-0, unit: unit-0, rank: 0, host: gpu-a, state: verified, sha256: "sha256:9f3e...",
       size: 3440640, path: /var/lib/coldsnap/model-payloads/sha256/9f3e....pack, reason: valid}
summary:
  description: Number of workers in each state.
  returned: success
  type: dict
  sample: {verified: 1, stale: 1}
"""

from pathlib import Path

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.modutil import run_guarded
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import STATE_ROOT_ARG
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import validate_artifact
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.status import native_status


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            state_root=dict(STATE_ROOT_ARG),
            request=dict(type="dict", required=True),
            artifact=dict(type="dict", required=True),
            host=dict(type="str", required=True),
            verify=dict(type="bool", default=False),
        ),
        supports_check_mode=True,
    )
    p = module.params

    def run() -> dict:
        req = validate_request(p["request"], document="request (module option)")
        art = validate_artifact(p["artifact"], document="artifact (module option)")
        return native_status(req, art, host=p["host"], state_root=Path(p["state_root"]), verify=p["verify"],
                             check_mode=module.check_mode)

    run_guarded(module, run, what="native_status")


if __name__ == "__main__":
    main()
