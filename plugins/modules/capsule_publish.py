#!/usr/bin/python
# Copyright: ColdSnap maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module coldsnap.fleet.capsule_publish: verify, push and pull capsules by digest."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: capsule_publish
short_description: Verify, push (publish) or pull ColdSnap capsules by immutable digest
version_added: "0.1.0"
description:
  - I(state=pushed) runs on a capture host. It verifies the accepted local descriptor's capsule
    entries for this host (the local image id or OCI manifest digest must be the recorded one) and
    pushes each capsule to I(repository) - Docker capsules through the Docker daemon, OCI-layout
    capsules with a standard-library OCI distribution client - then reads the manifest back and
    returns immutable C(repository@sha256:<manifest digest>) references. OCI-layout capsules keep
    uncompressed layers on disk (a restore reads the CRIU image from them) and travel with gzip layers
    (see I(layer_compression)); the manifest pushed then names the local capsule id, and a pull checks
    the compressed bytes, the decompressed bytes against the config's diff ids, and the rebuilt local
    manifest against the recorded id. It commits nothing; the
    caller writes the published descriptor only when every unit succeeded. A push the registry
    rejects fails the task with the registry's reason.
  - I(state=pulled) runs on a restore host. It fetches only the capsules assigned to it, by digest,
    and verifies them (manifest and layer digests, and for Docker the local image id equals the
    recorded id). Bytes that do not match fail the task and nothing is cached.
  - I(state=verified) only checks the local capsules against the descriptor.
author: ColdSnap maintainers (@coldsnap)
attributes:
  check_mode:
    support: full
    details: Reports what would be pushed or pulled; contacts the registry read-only.
  diff_mode:
    support: none
  idempotent:
    support: full
    details: Publication is content-idempotent; a capsule the registry already serves is not pushed again, and
      a capsule already present and verified is not pulled again.
extends_documentation_fragment:
  - coldsnap.fleet.attributes
  - coldsnap.fleet.attributes.ACTION_GROUP
  - coldsnap.fleet.state.UNUSED
  - coldsnap.fleet.progress
options:
  state:
    description: What to do.
    type: str
    choices: [pushed, pulled, verified]
    default: pushed
  artifact:
    description: Path of the committed descriptor (artifact.json). Its C(capsule.units) entries are the capsules.
    type: path
  capsules:
    description: Capsule entries (C(unit), C(layout), C(image_id), C(location), C(bytes), C(repository_digest))
      when no I(artifact) is given.
    type: list
    elements: dict
  host:
    description: Only the entries whose C(host) is this capture host (normally C(inventory_hostname)).
    type: str
  units:
    description: Only these units.
    type: list
    elements: str
  repository:
    description: Registry repository for I(state=pushed) (C(policy.capsule.repository)), e.g.
      C(registry.example:5000/coldsnap/capsules).
    type: str
  oci_root:
    description: Directory holding OCI-layout capsules; required to pull them.
    type: path
  layer_compression:
    description:
      - How the layers of OCI-layout capsules travel with I(state=pushed). C(gzip) compresses each layer on
        the CPUs the module may use, at most 8 (process memory of Python heaps and allocator pools shrinks to about a fifth) and costs one
        decompression pass per pulling host, before anything is evicted; C(none) pushes the layers as they
        are on disk (a fast link where the CPU time matters more than the bytes).
      - Docker capsules always travel as the Docker daemon pushes them (gzip). A pull reads either form.
      - Publication is content-idempotent whatever this says - a capsule the repository already serves, in
        either form, is reported C(present) and not pushed again.
    type: str
    choices: [gzip, none]
    default: gzip
  registry_username:
    description: Registry user name.
    type: str
  registry_password:
    description: Registry password. Never logged or stored.
    type: str
  registry_token:
    description: Registry bearer token (instead of user name and password). Never logged or stored.
    type: str
  insecure_registry:
    description: Use plain HTTP for the stdlib OCI client (loopback registries use it by default).
    type: bool
requirements:
  - Python >= 3.11
  - the Docker SDK for Python and a running dockerd for Docker capsules
notes:
  - Registry credentials are module options marked no_log; they are never written to the descriptor, a receipt
    or a log.
"""

EXAMPLES = r"""
- name: Publish this host's capsules
  coldsnap.fleet.capsule_publish:
    artifact: "{{ artifact_path }}"
    host: "{{ inventory_hostname }}"
    repository: "{{ coldsnap_policy.capsule.repository }}"
    registry_username: "{{ registry_user | default(omit) }}"
    registry_password: "{{ registry_password | default(omit) }}"
  register: published

- name: Pull only the capsule assigned to unit-1
  coldsnap.fleet.capsule_publish:
    state: pulled
    artifact: "{{ artifact_path }}"
    units: [unit-1]
    oci_root: "{{ coldsnap_state_root }}/capsules"
"""

RETURN = r"""
capsules:
  description: The handled capsule entries; after a push or pull C(repository_digest) is set.
  returned: always
  type: list
  elements: dict
  sample:
    - unit: unit-0
      layout: oci-layout
      image_id: "sha256:9a0e..."
      location: /var/lib/coldsnap/capsules/sha256/9a0e...
      bytes: 1234567
      repository_digest: "registry.example:5000/coldsnap/capsules@sha256:41c7..."
actions:
  description: Per unit, what was done (pushed, present, pulled, verified, would-push, would-pull).
  returned: always
  type: dict
"""

import traceback
from pathlib import Path

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import publish
from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.build import CapsuleRef, inspect_capsule
from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.wire import COMPRESSIONS
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.progress import (
    LEASE_ARG,
    PROGRESS_DIR_ARG,
    ProgressSession,
    mapping_progress,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import STATE_ROOT_ARG


def _entries(module: AnsibleModule) -> list[dict]:
    p = module.params
    if p["artifact"]:
        from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import (
            load_artifact,
            read_descriptor_file,
        )

        art = load_artifact(read_descriptor_file(p["artifact"]), document=p["artifact"])
        if art["state"] not in ("accepted", "published"):
            raise ColdSnapError(f"descriptor {p['artifact']} is in state {art['state']!r}",
                                fix="publish only an accepted descriptor")
        entries = art["capsule"]["units"]
    else:
        entries = p["capsules"] or []
    out = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("unit"), str):
            raise ColdSnapError(f"capsules[{i}] names no unit",
                                fix="pass the capsule_build results (or the descriptor's capsule.units) unchanged")
        if p["host"] is not None and e.get("host") not in (None, p["host"]):
            continue
        if p["units"] is not None and e["unit"] not in p["units"]:
            continue
        out.append(dict(e))
    return out


def _auth(p: dict) -> dict | None:
    if p["registry_token"]:
        return {"registrytoken": p["registry_token"]}
    if p["registry_username"]:
        return {"username": p["registry_username"], "password": p["registry_password"] or ""}
    return None


def run(module: AnsibleModule, session: ProgressSession | None = None) -> dict:
    p = module.params
    session = session or ProgressSession(None)
    auth = _auth(p)
    entries = _entries(module)
    actions: dict[str, str] = {}
    changed = False
    out = []
    for entry in entries:
        ref = CapsuleRef.from_dict(entry)
        if p["state"] == "verified":
            inspect_capsule(ref, verify=True)
            actions[ref.unit] = "verified"
        elif p["state"] == "pushed":
            repo = p["repository"]
            known = entry.get("repository_digest")
            if ref.layout == "oci-layout":  # found and checked there, in either form
                known = publish.published_oci_capsule(ref, repo, auth=auth, insecure=p["insecure_registry"])
                present = known is not None
            else:
                if not (known and known.startswith(repo + "@")):
                    known = _docker_repo_digest(ref, repo) or publish.published_docker_capsule(
                        ref, repo, auth=auth, insecure=p["insecure_registry"])
                present = bool(known) and publish.remote_has(known, auth=auth, insecure=p["insecure_registry"])
            inspect_capsule(ref, verify=True)
            if present:
                entry["repository_digest"] = known
                actions[ref.unit] = "present"
            elif module.check_mode:
                actions[ref.unit] = "would-push"
                changed = True
            else:
                writer = session.writer(f"push-{ref.unit}", phase="capsule push", unit="layers",
                                        message=f"{ref.unit} -> {repo}")
                writer.update(force=True)
                entry["repository_digest"] = publish.push_capsule(ref, repo, auth=auth,
                                                                  insecure=p["insecure_registry"],
                                                                  progress=mapping_progress(writer),
                                                                  compression=p["layer_compression"])
                writer.done(f"{ref.unit} pushed")
                actions[ref.unit] = "pushed"
                changed = True
        else:
            rd = entry.get("repository_digest")
            if not rd:
                raise ColdSnapError(f"capsule of unit {ref.unit!r} has no repository digest",
                                    fix="publish the capture first (state=pushed), then pull")
            present = _present(ref, rd, p["oci_root"])
            if present is not None:
                entry.update(present.as_dict())
                actions[ref.unit] = "present"
            elif module.check_mode:
                actions[ref.unit] = "would-pull"
                changed = True
            else:
                writer = session.writer(f"pull-{ref.unit}", phase="capsule pull", unit="layers",
                                        message=f"{ref.unit} <- {rd}")
                writer.update(force=True)
                got = publish.pull_capsule(rd, expected_image_id=ref.image_id, layout=ref.layout,
                                           oci_root=Path(p["oci_root"]) if p["oci_root"] else None, auth=auth,
                                           unit=ref.unit, insecure=p["insecure_registry"],
                                           progress=mapping_progress(writer))
                writer.done(f"{ref.unit} pulled")
                entry.update(got.as_dict())
                actions[ref.unit] = "pulled"
                changed = True
        out.append(entry)
    return {"changed": changed, "capsules": out, "actions": actions}


def _docker_repo_digest(ref: CapsuleRef, repo: str) -> str | None:
    details = inspect_capsule(ref, verify=False)
    for rd in details.get("repo_digests", []):
        if rd.startswith(repo + "@"):
            return rd
    return None


def _present(ref: CapsuleRef, repository_digest: str, oci_root: str | None) -> CapsuleRef | None:
    """The local capsule when it is already here and verified, else None."""
    if ref.layout == "oci-layout":
        if not oci_root:
            raise ColdSnapError(f"pulling the OCI capsule of unit {ref.unit!r} needs oci_root",
                                fix="set oci_root to <state_root>/capsules")
        from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import oci

        local = CapsuleRef(ref.unit, ref.layout, ref.image_id, str(oci.layout_dir(Path(oci_root), ref.image_id)),
                           ref.bytes, repository_digest)
    else:
        local = CapsuleRef(ref.unit, ref.layout, ref.image_id, repository_digest, ref.bytes, repository_digest)
    try:
        inspect_capsule(local, verify=True)
    except ColdSnapError:
        return None
    return local


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "state": {"type": "str", "choices": ["pushed", "pulled", "verified"], "default": "pushed"},
            "artifact": {"type": "path"},
            "capsules": {"type": "list", "elements": "dict"},
            "host": {"type": "str"},
            "units": {"type": "list", "elements": "str"},
            "repository": {"type": "str"},
            "oci_root": {"type": "path"},
            "layer_compression": {"type": "str", "choices": list(COMPRESSIONS), "default": "gzip"},
            "registry_username": {"type": "str"},
            "registry_password": {"type": "str", "no_log": True},
            "registry_token": {"type": "str", "no_log": True},
            "insecure_registry": {"type": "bool"},
            "state_root": dict(STATE_ROOT_ARG),
            "progress_dir": dict(PROGRESS_DIR_ARG),
            "progress_lease": dict(LEASE_ARG),
        },
        required_one_of=[("artifact", "capsules")],
        mutually_exclusive=[("artifact", "capsules"), ("registry_token", "registry_username")],
        required_if=[("state", "pushed", ("repository",))],
        required_by={"registry_password": ("registry_username",)},
        supports_check_mode=True,
    )
    try:
        with ProgressSession(None if module.check_mode else module.params["progress_dir"], lease_s=module.params["progress_lease"]) as session:
            result = run(module, session)
    except ColdSnapError as exc:
        module.fail_json(msg=str(exc))
    except Exception as exc:  # unexpected: keep the traceback for the operator
        module.fail_json(msg=f"capsule {module.params['state']} failed: {exc}", exception=traceback.format_exc())
    module.exit_json(**result)


if __name__ == "__main__":
    main()
