#!/usr/bin/python
# Copyright: ColdSnap maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module coldsnap.fleet.artifact_commit."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: artifact_commit
short_description: Assemble and atomically commit a capture's artifact descriptor (format 9)
version_added: "0.1.0"
description:
  - Builds artifact format 9 from the request, each unit's capture evidence, each unit host's facts and
    each unit's capsule, validates it strictly and commits it as C(<output.artifact_dir>/artifact.json)
    (temporary name, fsync, exclusive link, directory fsync).
  - Capture semantics are conflict-on-existing-output - an existing different artifact is never replaced
    (the task fails); committing the identical artifact again reports no change.
  - Runs on the control node (C(delegate_to) localhost) after every unit was captured and its capsule built.
  - With O(promote), the committed descriptor also becomes the current generation of its workload identity
    in the descriptor store under O(state_root), in the same task (as M(coldsnap.fleet.artifact_store) with
    O(coldsnap.fleet.artifact_store#module:state=promoted) does), returned as RV(promotion).
extends_documentation_fragment:
  - coldsnap.fleet.attributes
  - coldsnap.fleet.attributes.ACTION_GROUP
  - coldsnap.fleet.state
  - coldsnap.fleet.state.REQUEST
options:
  capture_id:
    description: Identity of the capture (the request id by default).
    type: str
  evidence:
    description: Capture evidence of every unit (the C(units) of each host's M(coldsnap.fleet.unit_capture) result).
    type: list
    elements: dict
    required: true
  facts:
    description: C(coldsnap_host) facts per inventory hostname (from M(coldsnap.fleet.host_facts)).
    type: dict
    required: true
  capsules:
    description: Capsule reference of every unit (the C(capsule) of each M(coldsnap.fleet.capsule_build) result).
    type: list
    elements: dict
    required: true
  activation_digest:
    description: Digest of the activation runtime used for the capture.
    type: str
    required: true
  promote:
    description: Also promote the committed descriptor to the current generation of its identity.
    type: bool
    default: false
  retention:
    description: With O(promote), how many generations to keep (default the request's C(policy.retention.generations)).
    type: int
attributes:
  check_mode:
    support: full
    details: Builds and validates the artifact without writing it (so nothing is promoted either).
  diff_mode:
    support: none
  idempotent:
    support: full
    details: The same artifact committed twice reports no change.
author:
  - ColdSnap maintainers (@coldsnap)
"""

EXAMPLES = r"""
- name: Commit the artifact
  coldsnap.fleet.artifact_commit:
    request: "{{ coldsnap_request }}"
    evidence: "{{ unit_hosts | map('extract', hostvars, ['coldsnap_capture_units', 'units']) | flatten }}"
    facts: "{{ dict(unit_hosts | zip(unit_hosts | map('extract', hostvars, ['ansible_facts', 'coldsnap_host']))) }}"
    capsules: "{{ unit_hosts | map('extract', hostvars, ['coldsnap_capture_capsules', 'results']) | flatten
                  | map(attribute='capsule') | list }}"
    activation_digest: "{{ coldsnap_activation_digest }}"
    promote: true
  delegate_to: localhost
"""

RETURN = r"""
path:
  description: The committed descriptor.
  returned: success
  type: str
  sample: /var/lib/coldsnap/artifacts/pending/op-20261129-0001/artifact.json
sha256:
  description: Digest of the descriptor file.
  returned: success, not in check mode
  type: str
  sample: sha256:9f3e4c0d8b7a6f5e4d3c2b1a0f9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f10
artifact:
  description: The artifact document.
  returned: success
  type: dict
promotion:
  description:
    - With O(promote), the promotion (as M(coldsnap.fleet.artifact_store) returns it for
      O(coldsnap.fleet.artifact_store#module:state=promoted)) - C(generation), C(created), C(current),
      C(pruned), and the host-local C(cleanup) of pruned generations with C(cleanup_hosts),
      C(keep_payloads), C(keep_capsules).
  returned: when O(promote) is true, not in check mode
  type: dict
"""

import hashlib
from pathlib import Path

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.commit import (
    build_artifact,
    by_unit,
    commit_artifact,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.store import ArtifactStore
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.modutil import run_guarded
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import STATE_ROOT_ARG
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            request=dict(type="dict", required=True),
            capture_id=dict(type="str"),
            evidence=dict(type="list", elements="dict", required=True),
            facts=dict(type="dict", required=True),
            capsules=dict(type="list", elements="dict", required=True),
            activation_digest=dict(type="str", required=True),
            promote=dict(type="bool", default=False),
            retention=dict(type="int"),
            state_root=dict(STATE_ROOT_ARG),
        ),
        supports_check_mode=True,
    )
    p = module.params

    def run() -> dict:
        # Refused before anything is written: a commit whose promotion cannot succeed would be left behind.
        if p["retention"] is not None:
            if not p["promote"]:
                raise ColdSnapError("retention takes effect only when the descriptor is promoted",
                                    fix="set promote: true, or leave retention out")
            if p["retention"] < 1:
                raise ColdSnapError(f"retention of {p['retention']} generations keeps nothing",
                                    fix="set retention to 1 or more (or leave it out for the request's policy)")
        req = validate_request(p["request"], document="request (module option)")
        evidence, facts, capsules = by_unit(req, p["evidence"], p["facts"], p["capsules"])
        art = build_artifact(req, capture_id=p["capture_id"] or req["id"], evidence=evidence, facts=facts,
                             capsules=capsules, activation_digest=p["activation_digest"])
        path, changed = commit_artifact(Path(req["output"]["artifact_dir"]), art, check_mode=module.check_mode)
        result: dict = {"changed": changed, "path": str(path), "artifact": art}
        if not path.exists():  # check mode, nothing committed yet: the commit (and any promotion) would change
            return result
        result["sha256"] = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
        if p["promote"]:
            promotion = ArtifactStore(Path(p["state_root"])).promote(str(path), request=req, retention=p["retention"],
                                                                     check_mode=module.check_mode).as_dict()
            result["changed"] = changed or promotion["changed"]
            result["promotion"] = promotion
        return result

    run_guarded(module, run, what="artifact_commit")


if __name__ == "__main__":
    main()
