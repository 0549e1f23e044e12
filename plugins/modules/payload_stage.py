#!/usr/bin/python
# Copyright: ColdSnap maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module coldsnap.fleet.payload_stage."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: payload_stage
short_description: Stage one worker's model payload into the host's node cache and verify it
version_added: "0.1.0"
description:
  - Puts exactly one payload, C(<state_root>/model-payloads/sha256/<hex>.pack), on the host that owns
    the worker, from a local file or from a Hugging Face repository pinned to an immutable commit, and
    verifies it (full SHA-256) before it becomes visible under its final name.
  - Holds the payload's per-digest lock, so duplicate workers on one host converge on one object; the
    second waits and reuses the first's result.
  - A payload that is already present and verified is left alone (C(changed=false)); one that fails
    verification is quarantined and staged again.
  - Partial writes live under a temporary name; leftovers of a killed writer are removed on the next run.
  - What an interrupted peer transfer kept for its resume is removed once the payload is in the node cache,
    whichever source brought it.
author:
  - ColdSnap maintainers (@coldsnap)
extends_documentation_fragment:
  - coldsnap.fleet.attributes
  - coldsnap.fleet.attributes.ACTION_GROUP
  - coldsnap.fleet.state
  - coldsnap.fleet.progress
options:
  sha256:
    description: Digest of the payload, C(sha256:<64 lower-case hex>).
    type: str
    required: true
  size:
    description: Size of the payload in bytes.
    type: int
    required: true
  source:
    description: Where the payload comes from.
    type: dict
    required: true
    suboptions:
      kind:
        description:
          - C(local) reads O(source.path) on the host; C(huggingface) downloads with huggingface_hub.
          - C(peer) pulls from the transfer server (M(coldsnap.fleet.transfer_serve)) of the host that has the
            payload, resuming an interrupted transfer and hashing the bytes as they arrive; nothing passes
            through the control node.
        type: str
        required: true
        choices: [local, huggingface, peer]
      path:
        description: Pack file on the host (kind C(local)).
        type: path
      repository:
        description: Hugging Face repository C(org/name) that holds the payloads (kind C(huggingface)).
        type: str
      revision:
        description: Immutable 40-hex commit id of that repository (branch and tag names are refused).
        type: str
      filename:
        description:
          - File inside the repository; defaults to C(model-payloads/sha256/<hex>.pack).
          - For kind C(peer), the name the server serves it under; defaults to C(<hex>.pack).
        type: str
      token:
        description:
          - Hugging Face access token (kind C(huggingface)), or the transfer's token (kind C(peer)); never logged
            or returned.
        type: str
      address:
        description: Address of the transfer server (kind C(peer)).
        type: str
      port:
        description:
          - Port of the transfer server (kind C(peer)).
          - In check mode C(0) (what M(coldsnap.fleet.transfer_serve) reports when, in check mode, it starts no
            server) asks no server and reports that a real run would stage; a real run refuses it.
        type: int
      endpoint:
        description: Hub endpoint URL (a mirror); defaults to the library's (C(HF_ENDPOINT) or the public Hub).
        type: str
  lock_timeout:
    description: Seconds to wait for another worker holding the payload's lock.
    type: float
    default: 1800
attributes:
  check_mode:
    support: full
    details:
      - Verifies an existing payload without writing anything and reports whether a real run would stage.
      - When it would, asks the source whether it can deliver, writing nothing and moving no payload byte (the
        local file is opened; a peer's transfer server is asked for its file listing; the Hub for the file's
        metadata at the pinned revision), and fails as the real run would when it cannot.
  diff_mode:
    support: none
  idempotent:
    support: full
requirements:
  - huggingface_hub on the host for O(source.kind=huggingface)
"""

EXAMPLES = r"""
- name: Stage from a file the data-owning host already has
  coldsnap.fleet.payload_stage:
    state_root: /var/lib/coldsnap
    sha256: "{{ worker.payload.sha256 }}"
    size: "{{ worker.payload.size }}"
    source:
      kind: local
      path: /srv/exports/model-weights.pack

- name: Stage from the pinned Hugging Face repository
  coldsnap.fleet.payload_stage:
    state_root: /var/lib/coldsnap
    sha256: "{{ worker.payload.sha256 }}"
    size: "{{ worker.payload.size }}"
    source:
      kind: huggingface
      repository: my-org/llama-payloads
      revision: 0123456789abcdef0123456789abcdef01234567
      token: "{{ hf_token }}"
- name: Pull from the transfer server of the host that has it
  coldsnap.fleet.payload_stage:
    state_root: /var/lib/coldsnap
    sha256: "{{ worker.payload.sha256 }}"
    size: "{{ worker.payload.size }}"
    source:
      kind: peer
      address: "{{ served.address }}"
      port: "{{ served.port }}"
      token: "{{ transfer_token }}"
  no_log: true
"""

RETURN = r"""
path:
  description: Path of the staged, verified pack.
  returned: success
  type: str
  sample: /var/lib/coldsnap/model-payloads/sha256/6d3421ea50b46ddbdd2bee6af7f19d59c2b08fcd4717960983309346adc2dddc.pack
sha256:
  description: Digest of the payload (O(sha256)).
  returned: success
  type: str
size:
  description: Size of the payload in bytes (O(size)).
  returned: success
  type: int
verified:
  description: The payload is present and passed verification (in check mode, when it was already present).
  returned: success
  type: bool
  sample: true
record_reused:
  description: An existing validation record let the verifier skip the hash.
  returned: success
  type: bool
  sample: true
bytes_hashed:
  description: Bytes hashed by this run.
  returned: success
  type: int
  sample: 0
bytes_copied:
  description: Bytes copied or downloaded by this run.
  returned: success
  type: int
  sample: 0
source:
  description: The source, described without credentials.
  returned: success
  type: str
  sample: huggingface my-org/llama-payloads@0123456789abcdef0123456789abcdef01234567
quarantined:
  description: Where a previously present but corrupt copy was moved before staging.
  returned: success
  type: str
  sample: null
"""

import traceback

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.progress import (
    LEASE_ARG,
    PROGRESS_DIR_ARG,
    ProgressSession,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import STATE_ROOT_ARG
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.stage import StageSource, stage_payload


def run_module() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            state_root=dict(STATE_ROOT_ARG),
            sha256=dict(type="str", required=True),
            size=dict(type="int", required=True),
            lock_timeout=dict(type="float", default=1800.0),
            progress_dir=dict(PROGRESS_DIR_ARG),
            progress_lease=dict(LEASE_ARG),
            source=dict(
                type="dict",
                required=True,
                options=dict(
                    kind=dict(type="str", required=True, choices=["local", "huggingface", "peer"]),
                    path=dict(type="path"),
                    repository=dict(type="str"),
                    revision=dict(type="str"),
                    filename=dict(type="str"),
                    token=dict(type="str", no_log=True),
                    endpoint=dict(type="str"),
                    address=dict(type="str"),
                    port=dict(type="int"),
                ),
                required_if=[
                    ("kind", "local", ("path",)),
                    ("kind", "huggingface", ("repository", "revision")),
                    ("kind", "peer", ("address", "port", "token")),
                ],
            ),
        ),
        supports_check_mode=True,
    )
    p = module.params
    try:
        source = StageSource.from_dict(p["source"], check_mode=module.check_mode)
        with ProgressSession(None if module.check_mode else p["progress_dir"], lease_s=p["progress_lease"]) as session:
            writer = session.writer(f"stage-{p['sha256'][-12:]}", phase="payload staging",
                                    message=source.describe())
            result = stage_payload(p["state_root"], p["sha256"], p["size"], source, check_mode=module.check_mode,
                                   lock_timeout=p["lock_timeout"], progress=writer)
            writer.done()
        out = result.as_result()
        if module.check_mode and result.changed:
            out["verified"] = False
        module.exit_json(**out)
    except ColdSnapError as exc:
        quarantined = exc.details.get("quarantined")
        module.fail_json(msg=str(exc), quarantined=quarantined, changed=bool(quarantined))
    except Exception as exc:  # unexpected: keep the traceback for -vvv
        module.fail_json(msg=f"payload_stage failed unexpectedly: {exc}", exception=traceback.format_exc())


def main() -> None:
    run_module()


if __name__ == "__main__":
    main()
