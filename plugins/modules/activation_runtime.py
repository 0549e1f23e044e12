#!/usr/bin/python
# Copyright: ColdSnap maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module coldsnap.fleet.activation_runtime."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: activation_runtime
short_description: Stage the ColdSnap activation runtime content-addressed on a host
version_added: "0.1.0"
description:
  - Copies the activation runtime (the per-unit rank controller) from O(src), or writes it from O(files), into
    C(<state_root>/activation-runtime/sha256/<digest>/), where the digest covers every file's path,
    executable bit and bytes. Units run it from there (runtime C(host)) or mount it read-only
    (runtime C(docker)), so it can be fixed without recapturing a capsule while its ABI matches.
  - With O(digest), the staged copy must have exactly that digest (the module fails otherwise).
  - With O(digest) and neither O(src) nor O(files), nothing is staged; the module reports whether that
    digest is already staged (and intact) on the host, so a role sends the files only when they are missing.
extends_documentation_fragment:
  - coldsnap.fleet.attributes
  - coldsnap.fleet.attributes.ACTION_GROUP
  - coldsnap.fleet.state
options:
  src:
    description:
      - Directory on the host holding the runtime files.
      - Omit it (with O(digest)) to only ask whether that digest is staged.
    type: path
  files:
    description:
      - The runtime's files themselves, as the P(coldsnap.fleet.activation_files#lookup) lookup returns them
        on the control node (relative path to C(content), base64, and C(executable)); they travel in this task's
        arguments, so staging takes one task instead of a copy of each file.
      - Written under a temporary name and checked against O(digest) (required with it) before anything is
        staged; a name that is not a plain relative path of the runtime is refused.
      - Mutually exclusive with O(src).
    type: dict
  digest:
    description: Expected digest C(sha256:<hex>); refuse anything else.
    type: str
attributes:
  check_mode:
    support: full
    details: Reports whether the runtime would be staged.
  diff_mode:
    support: none
  idempotent:
    support: full
    details: An already staged digest reports no change.
author:
  - ColdSnap maintainers (@coldsnap)
"""

EXAMPLES = r"""
- name: Is this runtime already staged here? (copy the files only if not)
  coldsnap.fleet.activation_runtime:
    digest: "{{ lookup('coldsnap.fleet.activation_digest') }}"
    state_root: /var/lib/coldsnap
  register: runtime_check

- name: Stage the activation runtime from the control node in one task
  coldsnap.fleet.activation_runtime:
    files: "{{ lookup('coldsnap.fleet.activation_files') }}"
    digest: "{{ lookup('coldsnap.fleet.activation_digest') }}"
    state_root: /var/lib/coldsnap
  when: not runtime_check.staged
  register: runtime

- name: Stage the activation runtime from files already on the host
  coldsnap.fleet.activation_runtime:
    src: /var/lib/coldsnap/activation-runtime/incoming
    state_root: /var/lib/coldsnap
"""

RETURN = r"""
staged:
  description: Whether the digest is staged and intact on the host (after this run).
  returned: success
  type: bool
  sample: true
digest:
  description: Content digest of the staged runtime.
  returned: success
  type: str
  sample: sha256:5b2e8a0c7d1f4e3b9a6c2d8e0f1a3b5c7d9e2f4a6b8c0d1e3f5a7b9c2d4e6f80
path:
  description: Where it is staged.
  returned: success
  type: str
  sample: /var/lib/coldsnap/activation-runtime/sha256/5b2e8a0c7d1f4e3b9a6c2d8e0f1a3b5c7d9e2f4a6b8c0d1e3f5a7b9c2d4e6f80
cleaned:
  description:
    - Leftovers of killed operations removed from the state root (temporary extraction and staging names whose
      writer is gone, payloads copied from another host but never staged for an hour).
  returned: success
  type: list
  elements: str
  sample: [/var/lib/coldsnap/capsules/extracted/.9f3e....tmp-4242]
"""

from pathlib import Path

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import IntegrityError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.modutil import run_guarded
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import STATE_ROOT_ARG
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import activation_stage as activation
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.housekeeping import clean_stale_temps


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            src=dict(type="path"),
            files=dict(type="dict"),
            digest=dict(type="str"),
            state_root=dict(STATE_ROOT_ARG),
        ),
        required_one_of=[("src", "digest")],
        mutually_exclusive=[("src", "files")],
        required_by={"files": "digest"},
        supports_check_mode=True,
    )
    p = module.params

    def stage_files() -> dict:
        state_root = Path(p["state_root"])
        if module.check_mode:
            activation.decode_files(p["files"], p["digest"])  # what a real run would refuse, refused here
            looked = activation.look(state_root, p["digest"], check_mode=True)
            return {**looked, "changed": not looked["staged"] or looked["changed"]}
        cleaned = clean_stale_temps(state_root)
        digest, path, changed = activation.stage_files(p["files"], state_root, p["digest"])
        return {"changed": changed or bool(cleaned), "staged": True, "digest": digest, "path": str(path),
                "cleaned": cleaned}

    def run() -> dict:
        if p["files"] is not None:
            return stage_files()
        if not p["src"]:
            # Only ask: is this digest staged here (intact, no stray bytecode)?
            return activation.look(Path(p["state_root"]), p["digest"], check_mode=module.check_mode)
        activation.require_runtime_dir(Path(p["src"]))
        digest = activation.tree_digest(Path(p["src"]))
        if p["digest"] and digest != p["digest"]:
            raise IntegrityError(f"activation runtime at {p['src']} has digest {digest}, expected {p['digest']}",
                                 fix="copy the runtime files of the matching collection version")
        path = activation.staged_path(Path(p["state_root"]), digest)
        # What killed operations left behind (temporary names nothing reads) goes first.
        cleaned = clean_stale_temps(Path(p["state_root"]), check_mode=module.check_mode)
        if module.check_mode:
            staged = activation.is_staged(path, digest)
            return {"changed": not staged or bool(cleaned), "staged": staged, "digest": digest, "path": str(path),
                    "cleaned": cleaned}
        digest, path, changed = activation.stage(Path(p["src"]), Path(p["state_root"]))
        return {"changed": changed or bool(cleaned), "staged": True, "digest": digest, "path": str(path),
                "cleaned": cleaned}

    run_guarded(module, run, what="activation_runtime")


if __name__ == "__main__":
    main()
