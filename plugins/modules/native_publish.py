#!/usr/bin/python
# Copyright: ColdSnap maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module coldsnap.fleet.native_publish."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: native_publish
short_description: Publish a capture's native model payloads to a Hugging Face repository
version_added: "0.1.0"
description:
  - O(state=uploaded) runs on each capture host. It re-hashes every payload this host's units captured
    (the ColdSnap payload verifier with a forced full hash, not a validation record) and uploads each
    distinct object this host owns - the capture host of the first worker naming a digest, so an object
    several workers share is uploaded once - to C(model-payloads/sha256/<hex>.pack) on O(branch) with
    C(huggingface_hub) (C(HfApi.create_commit)), one commit per host at most. An object the branch already
    holds with the same LFS SHA-256 and size is not uploaded again. The pack stays locked from the re-hash to
    the end of the upload.
  - O(state=resolved) runs on the control node after every host uploaded. It resolves O(branch) to its
    immutable commit (C(HfApi.list_repo_refs)) and checks that every payload of the descriptor is at that
    commit with its SHA-256 and size (C(HfApi.get_paths_info)). The commit id, never the branch, is what
    the published descriptor records.
extends_documentation_fragment:
  - coldsnap.fleet.attributes
  - coldsnap.fleet.attributes.ACTION_GROUP
  - coldsnap.fleet.state
options:
  state:
    description: Upload on a capture host, or resolve on the control node.
    type: str
    choices: [uploaded, resolved]
    default: uploaded
  artifact:
    description: The descriptor being published (format 9, as a dict).
    type: dict
    required: true
  host:
    description: Inventory hostname of this capture host (O(state=uploaded)).
    type: str
  repository:
    description: Hugging Face repository (C(policy.weights.native.repository)), C(org/name).
    type: str
    required: true
  branch:
    description: The mutable upload branch.
    type: str
    default: main
  create_branch:
    description: Create O(branch) when the repository does not have it yet.
    type: bool
    default: true
  token:
    description: Hub token with write access. Never logged, stored or shown in messages.
    type: str
  endpoint:
    description: Hub endpoint URL; defaults to the library's (C(HF_ENDPOINT) or the public Hub).
    type: str
attributes:
  check_mode:
    support: full
    details: Re-hashes read-only and reports what would be uploaded; uploads nothing. Resolving a branch that
      does not hold the payloads yet answers RV(pending) instead of failing.
  diff_mode:
    support: none
  idempotent:
    support: full
    details: Objects the branch already holds are not uploaded again; resolving changes nothing.
requirements:
  - huggingface_hub
notes:
  - The token stays a task parameter (no_log); it is not written to the host, the descriptor or a receipt.
author:
  - ColdSnap maintainers (@coldsnap)
"""

EXAMPLES = r"""
- name: Re-hash and upload this capture host's payloads
  coldsnap.fleet.native_publish:
    artifact: "{{ source.artifact }}"
    host: "{{ inventory_hostname }}"
    repository: acme/coldsnap-payloads
    branch: main
    token: "{{ coldsnap_hf_token }}"

- name: Resolve the branch to its commit
  coldsnap.fleet.native_publish:
    state: resolved
    artifact: "{{ source.artifact }}"
    repository: acme/coldsnap-payloads
    token: "{{ coldsnap_hf_token }}"
  delegate_to: localhost
"""

RETURN = r"""
objects:
  description: The payload objects handled, with C(action) (uploaded, present, verified, would-upload) per object.
  returned: always
  type: list
  elements: dict
commit:
  description: The commit this host's upload created (O(state=uploaded)); null when nothing was uploaded.
  returned: when state is uploaded
  type: str
revision:
  description:
    - The immutable commit the branch resolved to (O(state=resolved)).
    - Null in check mode when the branch does not hold the payloads yet (RV(pending) is then true).
  returned: when state is resolved
  type: str
pending:
  description: Check mode only. The branch does not hold the payloads yet; the upload a real run makes comes
    first, so the revision it resolves to is not known in advance.
  returned: when state is resolved in check mode and the upload is still to be made
  type: bool
  sample: true
repository:
  description: The repository the revision belongs to.
  returned: when state is resolved
  type: str
branch:
  description: The branch that was resolved.
  returned: when state is resolved
  type: str
"""

from pathlib import Path

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.modutil import run_guarded
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import STATE_ROOT_ARG
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import validate_artifact
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import publish


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            state=dict(type="str", choices=["uploaded", "resolved"], default="uploaded"),
            artifact=dict(type="dict", required=True),
            host=dict(type="str"),
            state_root=dict(STATE_ROOT_ARG),
            repository=dict(type="str", required=True),
            branch=dict(type="str", default="main"),
            create_branch=dict(type="bool", default=True),
            token=dict(type="str", no_log=True),
            endpoint=dict(type="str"),
        ),
        required_if=[("state", "uploaded", ("host",))],
        supports_check_mode=True,
    )
    p = module.params

    def run() -> dict:
        art = validate_artifact(p["artifact"], document="artifact (module option)")
        if p["state"] == "resolved":
            return {"changed": False, **publish.resolve_revision(
                artifact=art, repository=p["repository"], branch=p["branch"], token=p["token"],
                endpoint=p["endpoint"], check_mode=module.check_mode)}
        return publish.upload_host_payloads(
            artifact=art, host=p["host"], state_root=Path(p["state_root"]), repository=p["repository"],
            branch=p["branch"], token=p["token"], endpoint=p["endpoint"], check_mode=module.check_mode,
            create_branch=p["create_branch"])

    run_guarded(module, run, what="native_publish")


if __name__ == "__main__":
    main()
