#!/usr/bin/python
# Copyright: ColdSnap maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module coldsnap.fleet.payload_verify."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: payload_verify
short_description: Verify a model payload in the node cache and keep its validation record current
version_added: "0.1.0"
description:
  - Verifies C(<state_root>/model-payloads/sha256/<hex>.pack) on the data-owning host with the one
    ColdSnap payload verifier (the same code the in-unit runtime and C(coldsnap payload verify) use).
  - The size is checked first. A private validation record that still matches the file's device, inode,
    size, mtime and ctime (and was not written within one timestamp tick of the file's last change)
    skips the hash; otherwise the whole file is hashed with SHA-256 and a fresh record is written.
  - A pack whose size or digest is wrong is moved to C(<state_root>/model-payloads/quarantine/) and the
    task fails naming it.
  - Malformed digests are refused before any path is built.
author:
  - ColdSnap maintainers (@coldsnap)
extends_documentation_fragment:
  - coldsnap.fleet.attributes
  - coldsnap.fleet.attributes.ACTION_GROUP
  - coldsnap.fleet.state
options:
  sha256:
    description: Digest of the payload, C(sha256:<64 lower-case hex>).
    type: str
    required: true
  size:
    description: Size of the payload in bytes.
    type: int
    required: true
  path:
    description:
      - Explicit pack path. It must still end in C(model-payloads/sha256/<hex>.pack) for the same digest.
      - Defaults to the node cache entry under O(state_root).
    type: path
attributes:
  check_mode:
    support: full
    details: Verifies without writing a validation record, taking the lock or quarantining.
  diff_mode:
    support: none
  idempotent:
    support: full
    details: A second run reuses the record written by the first and reports C(changed=false).
notes:
  - C(changed) is true when a validation record was (or, in check mode, would be) written.
"""

EXAMPLES = r"""
- name: Verify worker 0's payload on its host
  coldsnap.fleet.payload_verify:
    state_root: /var/lib/coldsnap
    sha256: "sha256:6d3421ea50b46ddbdd2bee6af7f19d59c2b08fcd4717960983309346adc2dddc"
    size: 12288
  register: payload

- name: Show whether the hash was skipped
  ansible.builtin.debug:
    msg: "record reused: {{ payload.record_reused }}, hashed {{ payload.bytes_hashed }} bytes"
"""

RETURN = r"""
verified:
  description: The payload passed verification (false when the task failed on it).
  returned: always
  type: bool
  sample: true
record_reused:
  description: A valid validation record let the verifier skip the full SHA-256.
  returned: success
  type: bool
  sample: false
bytes_hashed:
  description: Bytes hashed by this run (0 when the record was reused).
  returned: success
  type: int
  sample: 4294967296
path:
  description: Path of the verified pack.
  returned: success
  type: str
  sample: /var/lib/coldsnap/model-payloads/sha256/6d3421ea50b46ddbdd2bee6af7f19d59c2b08fcd4717960983309346adc2dddc.pack
record_written:
  description: A fresh validation record was written (never in check mode).
  returned: success
  type: bool
  sample: true
sha256:
  description: Digest of the payload (O(sha256)).
  returned: success
  type: str
size:
  description: Size of the payload in bytes (O(size)).
  returned: success
  type: int
record_status:
  description: What the verifier found before hashing (valid, absent, stale, racy, untrusted, malformed).
  returned: success
  type: str
  sample: absent
quarantined:
  description: Where a refused pack was moved.
  returned: failure
  type: str
  sample: /var/lib/coldsnap/model-payloads/quarantine/6d34...dddc.pack.20261129T111808Z-1a2b3c4d
"""

import traceback

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import STATE_ROOT_ARG
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import PayloadVerifier


def run_module() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            state_root=dict(STATE_ROOT_ARG),
            sha256=dict(type="str", required=True),
            size=dict(type="int", required=True),
            path=dict(type="path"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    try:
        target = p["path"] or NodeCache(p["state_root"])
        with PayloadVerifier().verify(target, p["sha256"], p["size"], write_record=not module.check_mode) as v:
            result = v.as_result()
        # A check-mode run that had to hash would have written a record.
        changed = v.record_written or (module.check_mode and not v.reused_record)
        module.exit_json(changed=changed, **result)
    except ColdSnapError as exc:
        quarantined = exc.details.get("quarantined")
        # a corrupt pack moved aside is a change on the host, failed run or not; check mode moves nothing
        # and reports the move a real run would make
        changed = bool(quarantined) or (module.check_mode and bool(exc.details.get("wrong_object")))
        module.fail_json(msg=str(exc), verified=False, quarantined=quarantined, changed=changed)
    except Exception as exc:  # unexpected: keep the traceback for -vvv
        module.fail_json(msg=f"payload_verify failed unexpectedly: {exc}", exception=traceback.format_exc())


def main() -> None:
    run_module()


if __name__ == "__main__":
    main()
