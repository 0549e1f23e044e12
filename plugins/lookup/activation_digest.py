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

from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.activation_stage import (
    runtime_dirs,
    tree_digest,
)


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        try:
            return [tree_digest(d) for d in runtime_dirs(terms)]
        except ColdSnapError as exc:
            raise AnsibleLookupError(str(exc)) from None
