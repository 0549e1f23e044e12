#!/usr/bin/python
# Copyright: ColdSnap maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module coldsnap.fleet.transfer_serve."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: transfer_serve
short_description: Serve a payload or a capsule from the host that has it to the host that needs it
version_added: "0.1.0"
description:
  - Starts (O(state=started)) or stops (O(state=stopped)) one transfer server on the host that has the files.
    The destination pulls them with M(coldsnap.fleet.payload_stage) (C(source.kind=peer)) or
    M(coldsnap.fleet.transfer_fetch), so multi-GB files go host to host and never through the control node.
  - The server serves a fixed table of regular files under O(root), built when it starts (symlinks are not
    served), answers only requests signed with O(token) (HMAC; a replayed request is refused), binds the one
    O(address) given, honours byte ranges (an interrupted transfer resumes), and stops by itself after
    O(idle_timeout) seconds without a request or O(lifetime) seconds in all.
  - The server is recorded in C(<state_root>/runs/transfers/<name>.json) (mode 0600, no token in it);
    O(state=stopped) stops it and is a no-op when none runs.
author:
  - ColdSnap maintainers (@coldsnap)
extends_documentation_fragment:
  - coldsnap.fleet.attributes
  - coldsnap.fleet.attributes.ACTION_GROUP
  - coldsnap.fleet.state
options:
  name:
    description: Name of this transfer (letters, digits, C(.), C(_), C(-)); one server per name.
    type: str
    required: true
  state:
    description: Whether the server should run.
    type: str
    choices: [started, stopped]
    default: started
  root:
    description: Directory whose files are served (required with O(state=started)).
    type: path
  include:
    description: Names relative to O(root) to serve; by default every regular file under it.
    type: list
    elements: str
  token:
    description:
      - Secret of this transfer, at least 32 characters, that the receiving side signs its requests with.
        Never logged or returned. The roles generate a fresh one per transfer.
    type: str
  address:
    description:
      - The one address to listen on, an address of this host that the destination reaches (an IP, or a
        name that resolves to one). Required with O(state=started).
    type: str
  port:
    description: Port to listen on; C(0) picks a free one (returned as RV(port)).
    type: int
    default: 0
  idle_timeout:
    description: Seconds without a request after which the server stops by itself.
    type: float
    default: 300
  lifetime:
    description: Seconds after which the server stops whatever it is doing.
    type: float
    default: 14400
attributes:
  check_mode:
    support: full
    details: Checks O(root) and the files to serve and reports what would be served; starts and stops nothing.
  diff_mode:
    support: none
  idempotent:
    support: full
    details:
      - Starting again with the same files, O(token), O(address), O(port) and limits keeps the running server
        (no change); anything else replaces the server of the same O(name) (a fresh port unless O(port) is set).
"""

EXAMPLES = r"""
- name: Serve the payload on the host that has it
  coldsnap.fleet.transfer_serve:
    name: "restore-42-worker-0-to-{{ inventory_hostname }}"
    root: /var/lib/coldsnap/model-payloads/sha256
    include: ["{{ payload_hex }}.pack"]
    address: "{{ hostvars[source].ansible_host }}"
    token: "{{ transfer_token }}"
  delegate_to: "{{ source }}"
  register: served

- name: Stop it once the destination has the payload
  coldsnap.fleet.transfer_serve:
    name: "restore-42-worker-0-to-{{ inventory_hostname }}"
    state: stopped
  delegate_to: "{{ source }}"
"""

RETURN = r"""
address:
  description: Address the server listens on.
  returned: O(state=started)
  type: str
  sample: 10.0.0.11
port:
  description: Port the server listens on.
  returned: O(state=started)
  type: int
  sample: 41235
pid:
  description: Process id of the server (null in check mode).
  returned: O(state=started)
  type: int
files:
  description: Number of files served.
  returned: O(state=started)
  type: int
  sample: 1
bytes:
  description: Their total size in bytes.
  returned: O(state=started)
  type: int
  sample: 1104150528
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.modutil import run_guarded
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import (
    STATE_ROOT_ARG,
    StateLayout,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.transfer.server import (
    run_file_for,
    start_server,
    stop_server,
)


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            state_root=dict(STATE_ROOT_ARG),
            name=dict(type="str", required=True),
            state=dict(type="str", choices=["started", "stopped"], default="started"),
            root=dict(type="path"),
            include=dict(type="list", elements="str"),
            token=dict(type="str", no_log=True),
            address=dict(type="str"),
            port=dict(type="int", default=0),
            idle_timeout=dict(type="float", default=300.0),
            lifetime=dict(type="float", default=14400.0),
        ),
        required_if=[("state", "started", ("root", "token", "address"))],
        supports_check_mode=True,
    )
    p = module.params

    def run() -> dict:
        run_file = run_file_for(p["state_root"], p["name"])
        if p["state"] == "stopped":
            return {"changed": stop_server(run_file, check_mode=module.check_mode)}
        if not module.check_mode:
            StateLayout(p["state_root"]).ensure_private_root()  # as every module that writes below it
        served = start_server(p["root"], token=p["token"], address=p["address"], port=p["port"],
                              run_file=run_file, include=p["include"], idle_timeout=p["idle_timeout"],
                              lifetime=p["lifetime"], check_mode=module.check_mode)
        return served

    run_guarded(module, run, what="transfer_serve")


if __name__ == "__main__":
    main()
