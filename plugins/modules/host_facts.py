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
  - coldsnap.fleet.state.UNUSED
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
attributes:
  check_mode:
    support: full
    details: Read-only; runs the same in check mode.
  diff_mode:
    support: none
  idempotent:
    support: full
    details: Never changes anything.
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
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import activation_stage as activation
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.host_facts import gather


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            check_criu=dict(type="bool", default=True),
            criu_binary=dict(type="path"),
            state_root=dict(STATE_ROOT_ARG),
            activation_digest=dict(type="str"),
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
        return out

    run_guarded(module, run, what="host_facts")


if __name__ == "__main__":
    main()
