#!/usr/bin/python
# Copyright: ColdSnap maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module coldsnap.fleet.artifact_leftovers."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: artifact_leftovers
short_description: Remove a host's copies of what dropped artifact descriptors alone referenced
version_added: "0.1.0"
description:
  - Host side of C(coldsnap delete) and of generation retention. For each dropped descriptor (the
    RV(coldsnap.fleet.artifact_store#module:cleanup) entries) it removes, when present on this host, the
    capture directory C(<state_root>/captures/<capture id>/), the unit capsules (OCI layouts under the state
    root, docker images by id, extracted capsule state) and the capture-local model payloads in the node cache
    with their validation records.
  - A payload is kept when a retained descriptor references it (O(keep_payloads)), when another capture
    directory on this host references it, or when the dropped descriptor pins a published native provider -
    shared published objects are never deleted implicitly. A payload a running engine maps (CPU weights hydrated
    by mapping the pack) is kept and reported. Registries and the Hugging Face Hub are never
    touched. A docker capsule image that a container still uses is kept and reported.
  - Convergent - what is already gone reports no change.
extends_documentation_fragment:
  - coldsnap.fleet.attributes
  - coldsnap.fleet.attributes.ACTION_GROUP
  - coldsnap.fleet.state
options:
  state:
    description: Only C(absent) is supported.
    type: str
    choices: [absent]
    default: absent
  refs:
    description: Host-local references of the dropped descriptors (capture id, capsules, payloads).
    type: list
    elements: dict
    required: true
  keep_payloads:
    description: Payload digests that retained descriptors still reference.
    type: list
    elements: str
    default: []
  keep_capsules:
    description:
      - Capsule image ids (docker image ids or OCI manifest digests) that retained descriptors still
        reference; never removed. OCI-layout capsules are only removed at the path derived from their digest.
    type: list
    elements: str
    default: []
  host:
    description: Inventory hostname of this host (capsule locations are only trusted on their capture host).
    type: str
    required: true
attributes:
  check_mode:
    support: full
    details: Reports what would be removed and removes nothing.
  diff_mode:
    support: none
  idempotent:
    support: full
    details: A second run finds nothing left and reports no change.
author:
  - ColdSnap maintainers (@coldsnap)
"""

EXAMPLES = r"""
- name: Remove what the deleted descriptors alone referenced on this host
  coldsnap.fleet.artifact_leftovers:
    refs: "{{ hostvars['localhost'].coldsnap_deleted.cleanup }}"
    keep_payloads: "{{ hostvars['localhost'].coldsnap_deleted.keep_payloads }}"
    host: "{{ inventory_hostname }}"
    state_root: /var/lib/coldsnap
"""

RETURN = r"""
removed:
  description: What was (or would be) removed, by kind.
  returned: success
  type: dict
  sample:
    captures: [/var/lib/coldsnap/captures/chat-capture-7]
    capsules: [{unit: unit-0, image_id: "sha256:1c2d...", location: /var/lib/coldsnap/capsules/oci/sha256/1c2d...}]
    extracted: []
    payloads: [{sha256: "sha256:9f3e...", path: /var/lib/coldsnap/model-payloads/sha256/9f3e....pack}]
kept:
  description: Payloads and capsules that stayed, with the reason.
  returned: success
  type: dict
  sample:
    payloads: [{sha256: "sha256:9f3e...", reason: still referenced by a retained descriptor or capture}]
    capsules: []
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.leftovers import remove_local
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.modutil import run_guarded
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import STATE_ROOT_ARG


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            state=dict(type="str", default="absent", choices=["absent"]),
            state_root=dict(STATE_ROOT_ARG),
            refs=dict(type="list", elements="dict", required=True),
            keep_payloads=dict(type="list", elements="str", default=[]),
            keep_capsules=dict(type="list", elements="str", default=[]),
            host=dict(type="str", required=True),
        ),
        supports_check_mode=True,
    )
    p = module.params
    run_guarded(module, lambda: remove_local(p["state_root"], p["refs"], keep_payloads=p["keep_payloads"],
                                             keep_capsules=p["keep_capsules"], host=p["host"],
                                             check_mode=module.check_mode), what="artifact_leftovers")


if __name__ == "__main__":
    main()
