#!/usr/bin/python
# Copyright: ColdSnap maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module coldsnap.fleet.capsule_build: build one launch unit's capsule on its capture host."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: capsule_build
short_description: Build one launch unit's ColdSnap capsule (local OCI image) from its captured state
version_added: "0.1.0"
description:
  - Packs a launch unit's captured state (CRIU image directory, residual C(weights.blob),
    C(native-manifest.json), C(replay-plan.json), logs) and its declared derived-cache directories
    into one capsule, either a local Docker image made of the unit's exact digest-pinned runtime
    image plus one state layer (I(layout=docker)) or an OCI image layout on disk for hosts without
    Docker (I(layout=oci-layout)). Both use the same deterministic layer, so the same inputs give
    the same capsule id.
  - Model packs (C(*.pack)) and their validation records are always left out. A cache path that
    overlaps a launch mount (model mounts, the activation runtime) or looks like a Hugging Face
    cache is refused, as is model data (C(*.safetensors)) found in the inputs.
  - Never pushes; publication is M(coldsnap.fleet.capsule_publish).
  - The capsule id (Docker image id, or the OCI manifest digest) is returned for the artifact.
author: ColdSnap maintainers (@coldsnap)
attributes:
  check_mode:
    support: full
    details: Reports whether a capsule would be built; nothing is written.
  diff_mode:
    support: none
  idempotent:
    support: full
    details: Unchanged inputs find the capsule already built (OCI layouts are content-addressed; docker
      capsules have a content-derived image id, so the same inputs give the same id).
extends_documentation_fragment:
  - coldsnap.fleet.attributes
  - coldsnap.fleet.attributes.ACTION_GROUP
  - coldsnap.fleet.state.UNUSED
options:
  unit:
    description: Launch unit id.
    type: str
    required: true
  capture_id:
    description: Capture id the capsule belongs to (labels, image name).
    type: str
    required: true
  state_dir:
    description: The unit's captured state directory on this host.
    type: path
    required: true
  state_target:
    description: Absolute path where the state appears inside the capsule.
    type: str
    default: /var/lib/coldsnap/state
  cache_paths:
    description: Declared derived/JIT cache directories (absolute paths inside the unit), copied to the same
      paths in the capsule. An absent one is reported in RV(absent_caches).
    type: list
    elements: str
    default: []
  cache_sources:
    description: Where each cache path's bytes are on this host when not at the same path (staged copies).
    type: dict
    default: {}
  forbidden_paths:
    description: The unit's launch mount targets; neither the state nor a cache may overlap them.
    type: list
    elements: str
    default: []
  layout:
    description: C(docker) for a local image, C(oci-layout) for an OCI layout on disk (runtime C(host)).
    type: str
    choices: [docker, oci-layout]
    default: docker
  base_image:
    description: The unit's runtime image, pinned by digest (C(name@sha256:...)) or image id. Required for C(docker).
    type: str
  oci_root:
    description: Directory holding OCI-layout capsules (C(<state_root>/capsules)). Required for C(oci-layout).
    type: path
  labels:
    description: Extra labels (operation id, recipe...). C(org.coldsnap.kind), C(.unit), C(.capture-id) and the
      C(org.coldsnap.capsule.*) keys are set by the module.
    type: dict
    default: {}
requirements:
  - Python >= 3.11
  - the Docker SDK for Python (C(docker) >= 7.1) and a running dockerd for I(layout=docker)
"""

EXAMPLES = r"""
- name: Build the capsule of unit-0 as a local Docker image
  coldsnap.fleet.capsule_build:
    unit: unit-0
    capture_id: "{{ capture_id }}"
    state_dir: "{{ coldsnap_state_root }}/captures/{{ capture_id }}/unit-0"
    base_image: "coldsnap-runtime@sha256:{{ runtime_hex }}"
    cache_paths: [/root/.cache/vllm/torch_compile_cache]
    forbidden_paths: "{{ unit.mounts | map(attribute='target') | list }}"
  register: capsule

- name: Keep it as an OCI layout on a host without Docker
  coldsnap.fleet.capsule_build:
    unit: unit-0
    capture_id: "{{ capture_id }}"
    state_dir: "{{ coldsnap_state_root }}/captures/{{ capture_id }}/unit-0"
    layout: oci-layout
    oci_root: "{{ coldsnap_state_root }}/capsules"
"""

RETURN = r"""
capsule:
  description: The artifact's C(capsule.units[]) entry for this unit (without C(host)). In check mode, the capsule
    that would be built (its id is computed from the inputs without writing anything).
  returned: always
  type: dict
  sample:
    unit: unit-0
    layout: docker
    image_id: "sha256:4f1c..."
    location: "coldsnap-capsule/unit-0:cap-20261129"
    bytes: 7712345
    repository_digest: null
excluded:
  description: Input files left out on purpose (model packs, their validation records, temporary files).
  returned: always
  type: list
  elements: str
  sample: [model-weights.pack]
absent_caches:
  description: Declared cache paths that did not exist on this host.
  returned: always
  type: list
  elements: str
build_key:
  description: Digest of the build inputs' metadata (names, modes, sizes, mtimes, labels, base), for diagnostics.
  returned: always
  type: str
"""

import traceback
from pathlib import Path

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.build import build_capsule_detailed
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import STATE_ROOT_ARG


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "unit": {"type": "str", "required": True},
            "capture_id": {"type": "str", "required": True},
            "state_dir": {"type": "path", "required": True},
            "state_target": {"type": "str", "default": "/var/lib/coldsnap/state"},
            "cache_paths": {"type": "list", "elements": "str", "default": []},
            "cache_sources": {"type": "dict", "default": {}},
            "forbidden_paths": {"type": "list", "elements": "str", "default": []},
            "layout": {"type": "str", "choices": ["docker", "oci-layout"], "default": "docker"},
            "base_image": {"type": "str"},
            "oci_root": {"type": "path"},
            "labels": {"type": "dict", "default": {}},
            "state_root": dict(STATE_ROOT_ARG),
        },
        required_if=[("layout", "docker", ("base_image",)), ("layout", "oci-layout", ("oci_root",))],
        supports_check_mode=True,
    )
    p = module.params
    try:
        result = build_capsule_detailed(
            unit=p["unit"], capture_id=p["capture_id"], files=Path(p["state_dir"]), state_target=p["state_target"],
            cache_paths=p["cache_paths"], forbidden_paths=p["forbidden_paths"], layout=p["layout"],
            base_image=p["base_image"], oci_root=Path(p["oci_root"]) if p["oci_root"] else None,
            labels={str(k): str(v) for k, v in p["labels"].items()},
            cache_sources={k: Path(v) for k, v in p["cache_sources"].items()}, dry_run=module.check_mode)
    except ColdSnapError as exc:
        module.fail_json(msg=str(exc))
    except Exception as exc:  # an unexpected failure: keep the traceback for the operator
        module.fail_json(msg=f"capsule build of unit {p['unit']!r} failed: {exc}", exception=traceback.format_exc())
    module.exit_json(changed=result.changed, capsule=result.ref.as_dict() if result.ref else None,
                     excluded=list(result.excluded), absent_caches=list(result.absent_caches),
                     build_key=result.build_key)


if __name__ == "__main__":
    main()
