# Copyright: ColdSnap maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Lookup coldsnap.fleet.overlays: the target-local overlays the control node's descriptor store
records for a request's workload identity (read in the controller's own process, no module run)."""

from __future__ import annotations

DOCUMENTATION = r"""
name: overlays
author: ColdSnap maintainers (@coldsnap)
version_added: "0.1.0"
short_description: Target-local overlays recorded for a workload identity
description:
  - Lists the overlays the descriptor store under O(state_root) records for the workload identity of a
    validated request (format 4), as M(coldsnap.fleet.artifact_store) with O(coldsnap.fleet.artifact_store#module:state=query)
    lists them, without running a module (the restore playbook asks this on every restore).
  - With O(portable_sha256), only the overlays of that portable descriptor.
  - Reads only. An overlay whose metadata is unreadable is still listed (with no payloads); selecting it
    is M(coldsnap.fleet.artifact_store)'s job, which checks it against the target.
options:
  _terms:
    description: The request (format 4), as a dict.
    type: list
    elements: dict
    required: true
  state_root:
    description: ColdSnap's state root on the control node (default C(/var/lib/coldsnap)).
    type: str
  portable_sha256:
    description: Only the overlays of the portable descriptor with this digest (C(sha256:<hex>)).
    type: str
"""

EXAMPLES = r"""
- name: Is there an overlay of this descriptor?
  ansible.builtin.set_fact:
    overlay_candidate: >-
      {{ lookup('coldsnap.fleet.overlays', coldsnap_request, portable_sha256=coldsnap_artifact_digest,
                wantlist=true) | length > 0 }}
"""

RETURN = r"""
_raw:
  description: One entry per overlay.
  type: list
  elements: dict
  contains:
    path:
      description: The overlay's directory in the store.
      type: str
    portable_sha256:
      description: Digest of the portable descriptor it overlays.
      type: str
    payloads:
      description: Digests of the host-local payloads it references.
      type: list
      elements: str
"""

from pathlib import Path

from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase
from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.overlay import list_overlays
from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.store import (
    ArtifactStore,
    identity_info_of,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import DEFAULT_STATE_ROOT
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request

OPTIONS = {"state_root", "portable_sha256"}


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        unknown = sorted(set(kwargs) - OPTIONS)
        if unknown:
            raise AnsibleLookupError(f"coldsnap.fleet.overlays: unknown option(s) {', '.join(unknown)}; "
                                     f"it takes {', '.join(sorted(OPTIONS))}")
        store = ArtifactStore(Path(kwargs.get("state_root") or DEFAULT_STATE_ROOT))
        portable = kwargs.get("portable_sha256")
        out = []
        for term in terms:
            if not isinstance(term, dict):
                raise AnsibleLookupError(f"coldsnap.fleet.overlays takes a request (a dict), not {type(term).__name__}")
            try:
                req = validate_request(term, document="request (lookup term)")
                entries = list_overlays(store, identity_info_of(req).identity)
            except ColdSnapError as exc:
                raise AnsibleLookupError(str(exc)) from None
            out.extend({k: e[k] for k in ("path", "portable_sha256", "payloads")} for e in entries
                       if portable is None or e["portable_sha256"] == portable)
        return out
