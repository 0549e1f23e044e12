#!/usr/bin/python
# Copyright: ColdSnap maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module coldsnap.fleet.artifact_publish."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: artifact_publish
short_description: Verify a descriptor for publication, or commit the separate published descriptor
version_added: "0.1.0"
description:
  - Runs on the control node, where descriptors live.
  - O(state=verified) reads the descriptor at O(source), validates it (artifact format 9, state C(accepted) or
    C(published)), checks its digest against O(source_sha256) when given and that O(request) describes the
    captured workload, and returns it with its digest and capture hosts.
  - O(state=committed) derives the published descriptor from O(source) (which must still have
    O(source_sha256)) and commits it as C(<artifact_dir>/artifact.json) with an atomic, exclusive commit.
    With O(capsules) (the entries a M(coldsnap.fleet.capsule_publish) push returned) every unit's
    C(repository_digest) is set and the state becomes C(published); with O(native) the native provider
    records the repository and the immutable commit. C(parent) is the source descriptor's digest. The source
    is never modified.
  - Content-idempotent - the same derived content already committed there reports no change; a different
    descriptor there, or the source itself, is never replaced.
extends_documentation_fragment:
  - coldsnap.fleet.attributes
  - coldsnap.fleet.attributes.ACTION_GROUP
  - coldsnap.fleet.state.UNUSED
options:
  state:
    description: What to do.
    type: str
    choices: [verified, committed]
    default: verified
  source:
    description: The descriptor being published (an accepted or already published C(artifact.json)).
    type: path
    required: true
  source_sha256:
    description: Expected C(sha256:<hex>) of the source descriptor's bytes; required to commit.
    type: str
  request:
    description: The operation request; O(state=verified) checks that it describes the captured workload.
    type: dict
  artifact_dir:
    description: Directory of the published descriptor (C(output.artifact_dir)); required to commit.
    type: path
  capsules:
    description: Pushed capsule entries (C(unit), C(image_id), C(repository_digest)), one per unit.
    type: list
    elements: dict
  repository:
    description: The registry repository the capsules were pushed to (C(policy.capsule.repository)).
    type: str
  native:
    description: The native provider, C({repository, revision}) with the resolved commit id as revision.
    type: dict
attributes:
  check_mode:
    support: full
    details: Verifies and derives the descriptor without writing it. Where the push or upload before it only
      said what it would do (no repository digest or commit yet), answers the would-be descriptor with
      RV(pending) true.
  diff_mode:
    support: none
  idempotent:
    support: full
    details: Committing the same published content again reports no change.
author:
  - ColdSnap maintainers (@coldsnap)
"""

EXAMPLES = r"""
- name: Verify the accepted local descriptor
  coldsnap.fleet.artifact_publish:
    source: /var/lib/coldsnap/artifacts/demo/capture-1/artifact.json
    request: "{{ coldsnap_request }}"
  register: source

- name: Commit the published descriptor
  coldsnap.fleet.artifact_publish:
    state: committed
    source: "{{ source.path }}"
    source_sha256: "{{ source.sha256 }}"
    artifact_dir: /var/lib/coldsnap/artifacts/demo/published-1
    repository: registry.example:5000/coldsnap/capsules
    capsules: "{{ pushed.capsules }}"
"""

RETURN = r"""
path:
  description: The source descriptor (verified) or the committed published descriptor.
  returned: always
  type: str
sha256:
  description: Digest of the descriptor file at RV(path).
  returned: when the file exists
  type: str
artifact:
  description: The verified source descriptor, or the published descriptor.
  returned: always
  type: dict
hosts:
  description: Capture hosts of the source descriptor (where its capsules and payloads are).
  returned: when state is verified
  type: list
  elements: str
parent:
  description: Digest of the source descriptor (the published descriptor's C(parent)).
  returned: when state is committed
  type: str
pending:
  description: Check mode only. Capsules still to be pushed (their C(repository_digest) null in RV(artifact)) or
    a native revision still to be uploaded; a real run records them.
  returned: when state is committed in check mode and a push or upload is still to be made
  type: bool
  sample: true
"""

from pathlib import Path

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts import publication
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.modutil import run_guarded
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import STATE_ROOT_ARG
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            state=dict(type="str", choices=["verified", "committed"], default="verified"),
            source=dict(type="path", required=True),
            source_sha256=dict(type="str"),
            request=dict(type="dict"),
            artifact_dir=dict(type="path"),
            capsules=dict(type="list", elements="dict"),
            repository=dict(type="str"),
            native=dict(type="dict"),
            state_root=dict(STATE_ROOT_ARG),
        ),
        required_if=[("state", "committed", ("source_sha256", "artifact_dir"))],
        required_by={"capsules": ("repository",)},
        supports_check_mode=True,
    )
    p = module.params

    def run() -> dict:
        if p["state"] == "verified":
            req = validate_request(p["request"], document="request (module option)") if p["request"] else None
            art, digest = publication.load_source(Path(p["source"]), expected_sha256=p["source_sha256"],
                                                  request=req)
            return {"changed": False, "path": p["source"], "sha256": digest, "artifact": art,
                    "hosts": publication.capture_hosts(art)}
        if p["capsules"] is None and p["native"] is None:
            raise ColdSnapError("nothing to commit", fix="pass capsules (publish) or native (publish-native)")
        return publication.publish_descriptor(
            source=Path(p["source"]), source_sha256=p["source_sha256"], artifact_dir=Path(p["artifact_dir"]),
            capsules=p["capsules"], repository=p["repository"], native=p["native"], check_mode=module.check_mode)

    run_guarded(module, run, what="artifact_publish")


if __name__ == "__main__":
    main()
