#!/usr/bin/python
# Copyright: ColdSnap maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module coldsnap.fleet.unit_restore."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: unit_restore
short_description: Prepare, evict and activate the restore of this host's launch units
version_added: "0.1.0"
description:
  - O(phase=prepare) decides whether this host can restore its units without touching the running
    workload. Admission compares the host facts with the artifact's per-unit platform inventory
    (architecture, GPU model, compute capability, GPU count, CRIU, snapshot driver minimum and the
    captured driver floor; the kernel through C(criu check) unless the policy says exact). The unit's
    captured state is made available (the capture directory, or the capsule extracted), the captured pids
    and listening ports must be free, and the weight provider is chosen per worker
    (C(policy.weights.mode)).
  - O(phase=evict) stops this workload's running engines on the host. Playbooks run it only after
    O(phase=prepare) passed on every host. Right before it stops anything it checks the captured pids and the
    ports the units' listeners come back on again, as O(phase=prepare) did, since a stranger may have taken one
    in between. When one is held by anyone but the workload being replaced it fails naming the holder and the
    fix, and nothing is evicted.
  - O(phase=activate) restores the units - CRIU restore (stopped), CUDA restore, release, resume with
    fresh transport endpoints from the coordinator, hydration, zeroed KV - and validates the exact reply.
    O(warm=true) stops before hydration; a later wake finishes it.
  - One operation at a time per workload on each host - while this step runs it holds the host's claim on
    the workload (a lock under C(<state_root>/locks/)), and a step of another operation (another controller,
    another AWX job) fails at once naming the holder's operation, step and pid, having changed nothing. O(phase=evict) hands
    the claim to the same operation's O(phase=activate) (for two minutes at most).
  - O(phase=release) gives the workload back on this host when this run's O(phase=evict) handed it to an
    O(phase=activate) that never ran (the restore stopped in between); the restore playbook runs it in an
    C(always) section. Nothing else changes.
  - A failure of O(phase=activate) comes after the eviction. Given O(evicted), its message says once that the
    workload that ran before was evicted and is not running, names its units and pids (or containers), and
    how to serve again; C(details.previous_workload) is C(evicted) and C(details.evicted) lists them.
extends_documentation_fragment:
  - coldsnap.fleet.attributes
  - coldsnap.fleet.attributes.ACTION_GROUP
  - coldsnap.fleet.state
  - coldsnap.fleet.state.REQUEST
  - coldsnap.fleet.state.CLAIM
  - coldsnap.fleet.state.TIMEOUTS
  - coldsnap.fleet.progress
options:
  phase:
    description: Which step to run.
    type: str
    choices: [prepare, evict, activate, release]
    required: true
  artifact:
    description: The committed artifact descriptor (format 9), validated again on the host.
    type: dict
    required: true
  host:
    description: Inventory hostname of this host.
    type: str
    required: true
  facts:
    description: This host's C(coldsnap_host) facts (from M(coldsnap.fleet.host_facts)); needed by O(phase=prepare).
    type: dict
  activation_digest:
    description: Digest of the staged activation runtime; needed by O(phase=activate).
    type: str
  coordinator_endpoint_file:
    description: The activation's coordinator endpoint descriptor on this host.
    type: path
  python:
    description: Python that runs the activation runtime.
    type: path
  warm:
    description: Stop after process, CUDA and transport reconstruction (before hydration and KV).
    type: bool
    default: false
  owner:
    description:
      - Runtime C(docker) only. The invoking user, as C({uid, gid}) or C("uid:gid"). Every state path the
        unit's rank container wrote (it runs as root) is given to this user afterwards, also when the run
        failed; mode bits are kept. Omitted, the files stay as written.
    type: raw
  staging_failures:
    description:
      - O(phase=prepare). Why staging a worker's native payload failed, by worker id (the role's rescue
        records it). Such a worker is planned on the recovery provider when the mode allows it, and the
        reason leads its C(weights.workers[].reasons).
    type: dict
    default: {}
  evicted:
    description:
      - O(phase=activate). What O(phase=evict) stopped on this host (its C(stopped)). A failed activation
        names it as evicted and not running. Omitted, the failure does not say what was evicted.
    type: list
    elements: dict
  hf_token:
    description:
      - O(phase=prepare). Hugging Face token for a C(huggingface) recovery source (the pinned snapshot is
        downloaded in prepare, before anything is evicted). Never logged or returned.
    type: str
attributes:
  check_mode:
    support: full
    details: C(prepare) runs its checks read-only; C(evict) and C(activate) only report (C(evict) runs its pid and
      port checks, read-only, and fails as a real run would).
  diff_mode:
    support: none
  idempotent:
    support: partial
    details: C(prepare) and C(evict) converge; C(activate) replaces (reconcile-replace semantics).
author:
  - ColdSnap maintainers (@coldsnap)
"""

EXAMPLES = r"""
- name: Prepare the restore (admission, capsule state, payload provider)
  coldsnap.fleet.unit_restore:
    phase: prepare
    request: "{{ coldsnap_request }}"
    artifact: "{{ coldsnap_artifact }}"
    host: "{{ inventory_hostname }}"
    facts: "{{ ansible_facts.coldsnap_host }}"
"""

RETURN = r"""
units:
  description:
    - Per-unit admission records (prepare) or restore evidence (activate; empty in check mode).
    - A prepare record's C(listeners) lists where the unit's captured TCP listeners come back (moved by one
      shift when the request names another serving port than the capture, see C(served)).
    - Restore evidence names where the unit serves (C(served), its address and port) and the listeners that
      moved (C(listeners_moved), each C(from) and C(to) as [address, port]; empty when none moved).
  returned: when phase is prepare or activate
  type: list
  elements: dict
  sample:
    - unit: unit-0
      ok: true
      served: {address: 127.0.0.1, port: 9000}
      listeners_moved:
        - {worker: worker-0, from: [127.0.0.1, 8000], to: [127.0.0.1, 9000]}
        - {worker: worker-0, from: [127.0.0.1, 41873], to: [127.0.0.1, 42873]}
weights:
  description: The weight provider chosen for each worker on this host (prepare).
  returned: when phase is prepare
  type: dict
stopped:
  description:
    - Engines stopped by O(phase=evict), one entry per unit. Runtime C(host) lists every worker's engine pid
      (C(pids); C(pid) is the first) and how many processes of their trees ended; runtime C(docker) the unit's
      container.
  returned: when phase is evict
  type: list
  elements: dict
  sample:
    - {unit: unit-0, pid: 4242, pids: [4242, 4250], processes: 2}
coldsnap_evicted:
  description:
    - What became of the workload that ran before, for the C(coldsnap) controller's receipt
      (C(result.eviction)). O(phase=evict) returns C(host) and C(units) (its C(stopped); null in a failure
      part way, under C(details)), a successful O(phase=activate) C(host) and C(restored=true).
  returned: when phase is evict or activate, not in check mode
  type: dict
  sample: {host: gpu-a, units: [{unit: unit-0, pid: 4242, pids: [4242], processes: 2}]}
released:
  description: O(phase=release) gave back a hand-over this run's evict step had left on the host.
  returned: when phase is release
  type: bool
coldsnap_timing:
  description: Unit-clock spans of the activation (activate).
  returned: when phase is activate and this host has units to restore, not in check mode
  type: dict
"""

from pathlib import Path

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.modutil import run_guarded
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.progress import (
    LEASE_ARG,
    PROGRESS_DIR_ARG,
    ProgressSession,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import STATE_ROOT_ARG
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import validate_artifact
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import (
    require_identity,
    validate_request,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import TIMEOUTS_ARG, check_timeouts
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import restore as ops
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.specs import accepted_validation


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            phase=dict(type="str", required=True, choices=["prepare", "evict", "activate", "release"]),
            request=dict(type="dict", required=True),
            artifact=dict(type="dict", required=True),
            host=dict(type="str", required=True),
            facts=dict(type="dict"),
            activation_digest=dict(type="str"),
            coordinator_endpoint_file=dict(type="path"),
            python=dict(type="path"),
            state_root=dict(STATE_ROOT_ARG),
            warm=dict(type="bool", default=False),
            timeouts=dict(TIMEOUTS_ARG),
            owner=dict(type="raw"),
            staging_failures=dict(type="dict", default={}),
            hf_token=dict(type="str", no_log=True),
            evicted=dict(type="list", elements="dict"),
            progress_dir=dict(PROGRESS_DIR_ARG),
            progress_lease=dict(LEASE_ARG),
            run_id=dict(type="str"),
        ),
        required_if=[("phase", "prepare", ["facts"]), ("phase", "activate", ["activation_digest"])],
        supports_check_mode=True,
    )
    p = module.params
    state_root = Path(p["state_root"])

    def run() -> dict:
        timeouts = check_timeouts(p["timeouts"])  # every phase: a bad one fails in prepare, before any eviction
        req = validate_request(p["request"], document="request (module option)")
        art = validate_artifact(p["artifact"], document="artifact (module option)")
        require_identity(art, req)
        accepted_validation(req, art)  # what activation will judge the reply by, refused in every phase
        if p["phase"] == "prepare":
            return ops.prepare_restore(req, art, host=p["host"], facts=p["facts"], state_root=state_root,
                                       check_mode=module.check_mode, python=p["python"],
                                       staging_failures=p["staging_failures"], hub_token=p["hf_token"],
                                       run_id=p["run_id"])
        if p["phase"] == "evict":
            return ops.evict(req, art, host=p["host"], state_root=state_root, check_mode=module.check_mode,
                             run_id=p["run_id"])
        if p["phase"] == "release":
            return ops.release(req, host=p["host"], state_root=state_root, run_id=p["run_id"],
                               check_mode=module.check_mode)
        with ProgressSession(None if module.check_mode else p["progress_dir"], lease_s=p["progress_lease"]) as session:
            return ops.restore_units(req, art, host=p["host"], state_root=state_root,
                                     activation_digest=p["activation_digest"],
                                     coordinator_endpoint=p["coordinator_endpoint_file"], python=p["python"],
                                     warm=p["warm"], check_mode=module.check_mode, timeouts=timeouts,
                                     owner=p["owner"], progress_dir=session.directory, evicted=p["evicted"],
                                     run_id=p["run_id"])

    run_guarded(module, run, what="unit_restore")


if __name__ == "__main__":
    main()
