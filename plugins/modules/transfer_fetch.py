#!/usr/bin/python
# Copyright: ColdSnap maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module coldsnap.fleet.transfer_fetch."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: transfer_fetch
short_description: Pull every file a transfer server serves into a directory, resumable and verified
version_added: "0.1.0"
description:
  - Runs on the host that needs the files and pulls them from the M(coldsnap.fleet.transfer_serve) server of
    the host that has them, host to host (nothing passes through the control node).
  - Each file lands under a partial name and reaches its final name only after its size and SHA-256 matched
    (the digest its name states, C(blobs/sha256/<hex>), or the one the server listed). A dropped connection
    resumes where it stopped; the partial file of an interrupted run is continued by the next run.
  - A file already present with the right size and digest is kept (C(changed=false) when all are).
  - Used for OCI-layout capsules; payloads go straight into the node cache with M(coldsnap.fleet.payload_stage).
author:
  - ColdSnap maintainers (@coldsnap)
extends_documentation_fragment:
  - coldsnap.fleet.attributes
  - coldsnap.fleet.attributes.ACTION_GROUP
  - coldsnap.fleet.state.UNUSED
  - coldsnap.fleet.progress
options:
  dest:
    description:
      - Directory the files go to (created when missing), keeping their relative names.
      - The served files arrive together (a pull cut short leaves nothing half-written under O(dest)); what
        O(dest) held besides them is kept (returned as RV(kept)), its mode too.
    type: path
    required: true
  address:
    description: Address of the transfer server.
    type: str
    required: true
  port:
    description: Port of the transfer server.
    type: int
    required: true
  token:
    description: The transfer's token (the one the server was started with); never logged or returned.
    type: str
    required: true
attributes:
  check_mode:
    support: full
    details: Asks the server for its listing and reports in RV(fetched) the files a real run would bring
      (C(changed) when any, or when O(dest) is not yet a directory); nothing is written or downloaded.
  diff_mode:
    support: none
  idempotent:
    support: full
"""

EXAMPLES = r"""
- name: Bring the capsule's OCI layout from its capture host
  coldsnap.fleet.transfer_fetch:
    dest: /var/lib/coldsnap/capsules/oci/sha256-1234
    address: "{{ served.address }}"
    port: "{{ served.port }}"
    token: "{{ transfer_token }}"
"""

RETURN = r"""
files:
  description: Number of files the server serves.
  returned: success, except in check mode when no server answers
  type: int
  sample: 4
fetched:
  description: Relative names of the files this run brought (in check mode, would bring).
  returned: success
  type: list
  elements: str
bytes_received:
  description: Bytes received by this run (less than the files' size when it resumed partial files).
  returned: success
  type: int
kept:
  description: Relative names of files O(dest) held that the server does not serve (kept as they were).
  returned: when a real run brought files into an existing O(dest)
  type: list
  elements: str
bytes:
  description: Total size of the files.
  returned: success, except in check mode when no server answers
  type: int
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.modutil import run_guarded
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.progress import (
    LEASE_ARG,
    PROGRESS_DIR_ARG,
    ProgressSession,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import STATE_ROOT_ARG
from ansible_collections.coldsnap.fleet.plugins.module_utils.transfer.client import (
    Peer,
    PeerUnreachable,
    fetch_tree,
    plan_tree,
)


def _plan(p: dict) -> dict:
    """Check mode: the files a real run would bring, when the server runs (transfer_serve starts none in
    check mode; it returns port 0 then)."""
    why = "transfer_serve starts no server in check mode (port 0)"
    if p["port"]:
        try:
            return plan_tree(Peer(p["address"], p["port"], p["token"], timeout=10.0, attempts=1), p["dest"])
        except PeerUnreachable:
            why = f"no transfer server answers at {p['address']}:{p['port']}"
    return {"changed": True, "fetched": [], "bytes_received": 0,
            "msg": f"{why}: the files cannot be listed; a real run pulls every file that {p['dest']} lacks"}


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            state_root=dict(STATE_ROOT_ARG),
            dest=dict(type="path", required=True),
            address=dict(type="str", required=True),
            port=dict(type="int", required=True),
            token=dict(type="str", required=True, no_log=True),
            progress_dir=dict(PROGRESS_DIR_ARG),
            progress_lease=dict(LEASE_ARG),
        ),
        supports_check_mode=True,
    )
    p = module.params

    def run() -> dict:
        if module.check_mode:
            return _plan(p)
        peer = Peer(p["address"], p["port"], p["token"])
        with ProgressSession(p["progress_dir"], lease_s=p["progress_lease"]) as session:
            writer = session.writer("transfer", phase="transfer", message=peer.describe())
            out = fetch_tree(peer, p["dest"], progress=writer)
            writer.done()
        return {**out, "changed": bool(out["fetched"]) or out["changed"]}

    run_guarded(module, run, what="transfer_fetch")


if __name__ == "__main__":
    main()
