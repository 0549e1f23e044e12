# Copyright: ColdSnap maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Lookup coldsnap.fleet.activation_digest: the content digest of an activation runtime directory on
the control node (the same digest the host side stages it under)."""

from __future__ import annotations

DOCUMENTATION = r"""
name: activation_digest
author: ColdSnap maintainers (@coldsnap)
version_added: "0.1.0"
short_description: Content digest of the ColdSnap activation runtime on the control node
description:
  - Returns C(sha256:<hex>) over every file's relative path, executable bit and bytes of the given
    directory (bytecode excluded), as M(coldsnap.fleet.activation_runtime) computes it on a host.
  - The C(coldsnap_host) role compares it with what a host has staged and copies the files only when they
    are missing there.
options:
  _terms:
    description: The activation runtime directory (default the collection's C(runtime_image/activation)).
    type: list
    elements: path
    required: false
"""

EXAMPLES = r"""
- name: Digest of the collection's activation runtime
  ansible.builtin.debug:
    msg: "{{ lookup('coldsnap.fleet.activation_digest') }}"
"""

RETURN = r"""
_raw:
  description: One digest C(sha256:<hex>) per directory.
  type: list
  elements: str
"""

from pathlib import Path

from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.activation_stage import tree_digest

DEFAULT = Path(__file__).resolve().parents[2] / "runtime_image" / "activation"


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        dirs = [Path(t) for t in terms] or [DEFAULT]
        out = []
        for d in dirs:
            if not (d / "coldsnap_activation" / "__main__.py").is_file():
                raise AnsibleLookupError(f"{d} is not an activation runtime directory (no coldsnap_activation/)")
            out.append(tree_digest(d))
        return out
