#!/usr/bin/python
# Copyright: ColdSnap maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module coldsnap.fleet.artifact_store."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: artifact_store
short_description: Promote, delete, query and extend the local descriptor store of a workload identity
version_added: "0.1.0"
description:
  - Keeps artifact descriptors under C(<state_root>/artifacts/<identity hex>/<generation>/artifact.json) on the
    control node, keyed by the request's identity (recipe, model, engine, runtime, topology and snapshot driver),
    with a C(current) pointer (a symbolic link replaced atomically with rename) and retention of the last
    N generations (the current one is always kept).
  - O(state=promoted) stores the descriptor at O(artifact_path) as a new generation and points C(current) at it
    (an already stored descriptor is pointed at again - a rollback - or left alone when it is current), then
    prunes generations beyond the retention. A pruned generation's committed output descriptor (the
    C(artifact.json) it was promoted from, wherever it lies, with its directory when nothing else is in it) is
    deleted with it when it still holds the same bytes (RV(pruned[].source_removed)). It returns the host-local
    artifacts the pruned generations alone referenced (RV(cleanup)) for M(coldsnap.fleet.artifact_leftovers).
  - O(state=absent) removes every stored descriptor (generations, overlays, and the committed output
    descriptors they were promoted from) of the request's recipe and snapshot driver, plus the descriptor at
    O(artifact_path) when it exists, and returns what to remove on the hosts and which payloads other retained
    descriptors still reference (RV(keep_payloads)). Shared published objects are never deleted.
  - O(state=query) reads only. With O(facts) it selects the target-local overlay of the descriptor at
    O(artifact_path) when one matches the target exactly, else falls back to the portable descriptor
    (RV(selection)).
  - O(state=overlay) builds the artifact of an in-place capture on the target (from the units' evidence,
    facts and capsules) and records it as the target-local overlay of the descriptor at O(artifact_path),
    bound to that descriptor, the snapshot driver, the ordered unit hosts, their accelerator inventory and
    exact NVIDIA driver versions; an overlay identical to the portable capture is discarded.
  - Runs on the control node.
extends_documentation_fragment:
  - coldsnap.fleet.attributes
  - coldsnap.fleet.attributes.ACTION_GROUP
  - coldsnap.fleet.state
  - coldsnap.fleet.state.REQUEST
options:
  state:
    description: What to do with the store.
    type: str
    choices: [promoted, absent, query, overlay]
    default: query
  artifact_path:
    description:
      - The committed descriptor (C(artifact.json)). Required for O(state=promoted), O(state=query) and
        O(state=overlay); optional for O(state=absent).
    type: path
  retention:
    description: Generations to keep; defaults to the request's C(policy.retention.generations).
    type: int
  facts:
    description: C(coldsnap_host) facts per unit inventory hostname (from M(coldsnap.fleet.host_facts)).
    type: dict
  evidence:
    description: In-place capture evidence of every unit (O(state=overlay)).
    type: list
    elements: dict
  capsules:
    description: Capsule reference of every unit of the in-place capture (O(state=overlay)).
    type: list
    elements: dict
  capture_id:
    description: Capture id of the in-place capture (O(state=overlay)).
    type: str
  activation_digest:
    description: Digest of the activation runtime that ran the in-place capture (O(state=overlay)).
    type: str
attributes:
  check_mode:
    support: full
    details: Reports what would be promoted, pruned, removed or recorded, and changes nothing.
  diff_mode:
    support: none
  idempotent:
    support: full
    details: Promoting the current descriptor again, or deleting what is already gone, reports no change.
author:
  - ColdSnap maintainers (@coldsnap)
"""

EXAMPLES = r"""
- name: Promote the committed descriptor (keep the last 3 generations)
  coldsnap.fleet.artifact_store:
    state: promoted
    request: "{{ coldsnap_request }}"
    artifact_path: "{{ committed.path }}"
    state_root: /var/lib/coldsnap
  register: promoted

- name: Remove every local descriptor of the recipe and snapshot driver
  coldsnap.fleet.artifact_store:
    state: absent
    request: "{{ coldsnap_request }}"
    artifact_path: "{{ coldsnap_request.artifact.path }}"

- name: Prefer a target-local overlay on exactly this target
  coldsnap.fleet.artifact_store:
    state: query
    request: "{{ coldsnap_request }}"
    artifact_path: "{{ coldsnap_request.artifact.path }}"
    facts: "{{ dict(unit_hosts | zip(unit_hosts | map('extract', hostvars, ['ansible_facts', 'coldsnap_host']))) }}"
  register: overlay
"""

RETURN = r"""
generation:
  description: The promoted generation (O(state=promoted)).
  returned: when state is promoted
  type: dict
  sample: {identity: "sha256:5b1e...", generation: "000003", path: /var/lib/coldsnap/artifacts/5b1e.../000003/artifact.json}
created:
  description: Whether the promoted descriptor was stored as a new generation (not one already stored).
  returned: when state is promoted
  type: bool
current:
  description: Path of the identity's current descriptor (through the C(current) link).
  returned: when state is promoted or query
  type: str
  sample: /var/lib/coldsnap/artifacts/5b1e.../current/artifact.json
pruned:
  description: Generations dropped by retention.
  returned: when state is promoted
  type: list
  elements: dict
  contains:
    source_removed:
      description: Whether the committed output descriptor this generation was promoted from was deleted too.
      type: bool
      returned: always
removed:
  description: Descriptors removed by O(state=absent).
  returned: when state is absent
  type: list
  elements: dict
identities:
  description: The workload identities whose descriptors O(state=absent) removed.
  returned: when state is absent
  type: list
  elements: dict
sources:
  description: Committed output descriptors removed with them (the ones generations were promoted from).
  returned: when state is absent
  type: list
  elements: str
cleanup:
  description: Host-local references (capture, capsules, payloads) of every dropped descriptor.
  returned: when state is promoted or absent
  type: list
  elements: dict
cleanup_hosts:
  description: Hosts that may hold those artifacts.
  returned: when state is promoted or absent
  type: list
  elements: str
keep_payloads:
  description: Payload digests retained descriptors still reference (never removed).
  returned: when state is promoted or absent
  type: list
  elements: str
keep_capsules:
  description: Capsule image ids retained descriptors still reference (never removed).
  returned: when state is promoted or absent
  type: list
  elements: str
identity:
  description: The request's workload identity, C(sha256:<hex>).
  returned: when state is query
  type: str
generations:
  description: Stored generations of the request's identity, oldest first.
  returned: when state is query
  type: list
  elements: dict
overlays:
  description: Target-local overlays recorded for the identity.
  returned: when state is query
  type: list
  elements: dict
selection:
  description:
    - Which descriptor to restore on this target - the overlay (C(selected=true), C(overlay) its directory)
      or the portable descriptor - with the reasons, the portable digest and the target binding digest.
  returned: when state is query and facts are given
  type: dict
artifact:
  description: The selected descriptor (the overlay's or the portable one).
  returned: when state is query and facts are given
  type: dict
overlay:
  description: What O(state=overlay) did (C(stored), C(discarded), C(path), C(reason), C(refs)).
  returned: when state is overlay
  type: dict
"""

from pathlib import Path

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts import overlay as overlay_mod
from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.store import (
    ArtifactStore,
    identity_info_of,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.modutil import run_guarded
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import STATE_ROOT_ARG
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            state=dict(type="str", default="query", choices=["promoted", "absent", "query", "overlay"]),
            state_root=dict(STATE_ROOT_ARG),
            request=dict(type="dict", required=True),
            artifact_path=dict(type="path"),
            retention=dict(type="int"),
            facts=dict(type="dict"),
            evidence=dict(type="list", elements="dict"),
            capsules=dict(type="list", elements="dict"),
            capture_id=dict(type="str"),
            activation_digest=dict(type="str"),
        ),
        required_if=[
            ("state", "promoted", ["artifact_path"]),
            ("state", "query", ["artifact_path"]),
            ("state", "overlay", ["artifact_path", "facts", "evidence", "capsules", "capture_id",
                                  "activation_digest"]),
        ],
        supports_check_mode=True,
    )
    p = module.params
    store = ArtifactStore(Path(p["state_root"]))

    def run() -> dict:
        req = validate_request(p["request"], document="request (module option)")
        state = p["state"]
        if state == "promoted":
            return store.promote(p["artifact_path"], request=req, retention=p["retention"],
                                 check_mode=module.check_mode).as_dict()
        if state == "absent":
            return _absent(store, req, p["artifact_path"], module.check_mode)
        if state == "query":
            return _query(store, req, Path(p["artifact_path"]), p["facts"])
        return _overlay(store, req, p, module.check_mode)

    run_guarded(module, run, what="artifact_store")


def _absent(store: ArtifactStore, req: dict, artifact_path: str | None, check_mode: bool) -> dict:
    from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.store import file_sha256
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import (
        load_artifact,
        read_descriptor_file,
    )

    extra = []
    identities = [identity_info_of(req).identity]
    if artifact_path and Path(artifact_path).is_file():
        digest = file_sha256(Path(artifact_path))
        pinned = (req.get("artifact") or {}).get("sha256")
        if not store.holds(digest) and pinned != digest:
            # Delete derives what it removes from a descriptor; a hand-edited one must not steer it.
            raise ColdSnapError(f"artifact {artifact_path} ({digest}) is not a descriptor the artifact store holds",
                                fix="delete with the descriptor the store committed (its current/ or a generation), "
                                    "or pin this one with artifact.sha256 in the request")
        art = load_artifact(read_descriptor_file(artifact_path), document=artifact_path)
        info = store.info(art["identity"])
        mine = art["identity"] == f"sha256:{identities[0]}" or (
            info is not None and (info.recipe, info.snapshot_driver) == (req["workload"]["recipe"],
                                                                         req["snapshot_driver"]["id"]))
        if not mine:
            raise ColdSnapError(f"artifact {artifact_path} does not belong to recipe {req['workload']['recipe']!r} "
                                f"with snapshot driver {req['snapshot_driver']['id']}",
                                fix="delete with the request of the workload that captured it")
        extra.append((art, digest))
        identities.append(art["identity"])
    out = store.delete(recipe=req["workload"]["recipe"], snapshot_driver=req["snapshot_driver"]["id"],
                       identities=identities, extra_artifacts=extra, check_mode=check_mode).as_dict()
    if extra and not check_mode and artifact_path and Path(artifact_path).is_file():
        # The request's own descriptor goes too (it may live outside the store).
        Path(artifact_path).unlink()
        out["sources"].append(artifact_path)
        out["changed"] = True
    return out


def _query(store: ArtifactStore, req: dict, artifact_path: Path, facts: dict | None) -> dict:
    ident = identity_info_of(req).identity
    current = store.current(ident)
    out = {"changed": False, "identity": f"sha256:{ident}",
           "current": str(store.current_artifact_path(ident)) if current else None,
           "generations": [g.as_dict() for g in store.generations(ident)],
           "overlays": [{k: o[k] for k in ("path", "portable_sha256", "payloads")}
                        for o in overlay_mod.list_overlays(store, ident)]}
    if facts is not None:
        if not artifact_path.is_file():
            what = "is not a regular file" if artifact_path.exists() else "does not exist"
            raise ColdSnapError(f"artifact {artifact_path} {what}", fix="name a committed artifact.json")
        selection = overlay_mod.select_overlay(store, portable_path=artifact_path, request=req,
                                               facts_by_host=facts)
        out["artifact"] = selection.pop("artifact")
        out["selection"] = selection
    return out


def _overlay(store: ArtifactStore, req: dict, p: dict, check_mode: bool) -> dict:
    portable, portable_sha = overlay_mod.read_descriptor(Path(p["artifact_path"]))
    art = overlay_mod.build_overlay_artifact(req, portable=portable, portable_sha256=portable_sha,
                                             capture_id=p["capture_id"], evidence=p["evidence"],
                                             facts_by_host=p["facts"], capsules=p["capsules"],
                                             activation_digest=p["activation_digest"])
    binding = overlay_mod.target_binding(req, p["facts"], portable_sha256=portable_sha)
    res = overlay_mod.record_overlay(store, portable_path=p["artifact_path"], overlay_artifact=art, binding=binding,
                                     check_mode=check_mode)
    return {"changed": res["changed"], "overlay": res}


if __name__ == "__main__":
    main()
