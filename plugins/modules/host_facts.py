#!/usr/bin/python
# Copyright: ColdSnap maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module coldsnap.fleet.host_facts."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: host_facts
short_description: Gather the host facts ColdSnap admission compares
version_added: "0.1.0"
description:
  - Reports the CPU architecture, kernel release, CPU model, GPUs (through NVML when C(nvidia-ml-py) is
    installed, else C(nvidia-smi)) with model, compute capability, memory and UUID, the NVIDIA driver
    version, the CRIU version and the result of C(criu check).
  - The facts are returned under RV(ansible_facts.coldsnap_host) so later plays read them from hostvars.
extends_documentation_fragment:
  - coldsnap.fleet.attributes
  - coldsnap.fleet.attributes.ACTION_GROUP
  - coldsnap.fleet.state
options:
  check_criu:
    description: Run C(criu check) (a second or two). Disable for a quick inventory.
    type: bool
    default: true
  criu_binary:
    description: CRIU to use; defaults to C(COLDSNAP_CRIU), then C(criu) on PATH, then C(/usr/local/sbin/criu).
    type: path
  activation_digest:
    description:
      - Also look whether the activation runtime with this digest (C(sha256:<hex>)) is staged, intact, under
        O(state_root), and remove what killed runs left there (as M(coldsnap.fleet.activation_runtime) without
        C(src) does), returned as RV(activation). Saves a second task per host and operation.
    type: str
  payloads:
    description:
      - Also verify these model payloads in the node cache under O(state_root), as M(coldsnap.fleet.payload_verify)
        does (a valid validation record spares the hash; a pack that fails is quarantined), returned as
        RV(payloads). This is the restore's first look - a payload found here stages nothing, saving a task
        per host and restore.
    type: list
    elements: dict
    default: []
    suboptions:
      sha256:
        description: The pack's digest, C(sha256:<hex>).
        type: str
        required: true
      size:
        description: The pack's size in bytes.
        type: int
        required: true
attributes:
  check_mode:
    support: full
    details: The facts are the same; in check mode nothing is cleaned, recorded or quarantined.
  diff_mode:
    support: none
  idempotent:
    support: full
    details: >-
      The facts change nothing. With O(activation_digest) or O(payloads) a first run may clean leftovers,
      write a validation record or quarantine a corrupt pack; a second run finds nothing to do.
author:
  - ColdSnap maintainers (@coldsnap)
"""

EXAMPLES = r"""
- name: Gather ColdSnap facts on every GPU host
  coldsnap.fleet.host_facts:

- name: Refuse hosts whose kernel fails criu check
  ansible.builtin.assert:
    that: ansible_facts.coldsnap_host.criu.check
    fail_msg: "{{ ansible_facts.coldsnap_host.criu.check_output }}"
"""

RETURN = r"""
activation:
  description: With O(activation_digest), whether that runtime is staged here (as M(coldsnap.fleet.activation_runtime)).
  returned: when O(activation_digest) is given
  type: dict
  contains:
    staged:
      description: The digest is staged and intact.
      type: bool
    digest:
      description: O(activation_digest).
      type: str
    path:
      description: Where it is (or would be) staged.
      type: str
    cleaned:
      description: Leftovers of killed runs removed (or, in check mode, that would be).
      type: list
      elements: str
payloads:
  description: With O(payloads), what the node cache holds of each, by digest.
  returned: when O(payloads) is given
  type: dict
  sample:
    "sha256:6d34...dddc": {verified: true, record_status: valid, bytes_hashed: 0}
    "sha256:0a1b...77ee": {verified: false, msg: "payload sha256:0a1b...77ee is not in the node cache", quarantined: null}
ansible_facts:
  description: Facts under the key C(coldsnap_host).
  returned: always
  type: dict
  contains:
    coldsnap_host:
      description: Architecture, kernel, CPU, GPUs, NVIDIA driver, CRIU.
      type: dict
      sample:
        arch: x86_64
        kernel: 6.8.0-60-generic
        cpu_model: AMD EPYC 9654
        cpus: 192
        gpus:
          - {index: 0, model: NVIDIA H200, compute_capability: "9.0", memory_mib: 143771, nvidia_driver: "580.159.03"}
        nvidia_driver: "580.159.03"
        criu: {installed: true, version: 4.1.1, check: true, binary: /usr/local/sbin/criu}
"""

from pathlib import Path

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.modutil import run_guarded
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import STATE_ROOT_ARG
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import first_look
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import activation_stage as activation
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.host_facts import gather


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            check_criu=dict(type="bool", default=True),
            criu_binary=dict(type="path"),
            state_root=dict(STATE_ROOT_ARG),
            activation_digest=dict(type="str"),
            payloads=dict(type="list", elements="dict", default=[], options=dict(
                sha256=dict(type="str", required=True),
                size=dict(type="int", required=True),
            )),
        ),
        supports_check_mode=True,
    )
    p = module.params

    def run() -> dict:
        out = {"changed": False, "ansible_facts": {
            "coldsnap_host": gather(check_criu=p["check_criu"], criu_binary=p["criu_binary"])}}
        if p["activation_digest"]:
            found = activation.look(Path(p["state_root"]), p["activation_digest"], check_mode=module.check_mode)
            out["changed"] = found.pop("changed")
            out["activation"] = found
        if p["payloads"]:
            out["payloads"] = first_look(Path(p["state_root"]), p["payloads"], check_mode=module.check_mode)
            out["changed"] = out["changed"] or any(v.get("changed") for v in out["payloads"].values())
        return out

    run_guarded(module, run, what="host_facts")


if __name__ == "__main__":
    main()
