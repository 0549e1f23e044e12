# Copyright: ColdSnap maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Lookup coldsnap.fleet.activation_files: the activation runtime's files on the control node, as one value
that M(coldsnap.fleet.activation_runtime) stages from its own arguments."""

from __future__ import annotations

DOCUMENTATION = r"""
name: activation_files
author: ColdSnap maintainers (@coldsnap)
version_added: "0.1.0"
short_description: The ColdSnap activation runtime's files, read on the control node
description:
  - Returns one dictionary per directory - each file's path relative to the directory, mapped to its
    C(content) (base64) and whether it is C(executable) - holding exactly the files that
    P(coldsnap.fleet.activation_digest#lookup) covers (bytecode and hidden files excluded).
  - Pass it to the O(coldsnap.fleet.activation_runtime#module:files) option with the digest, and the runtime
    reaches a host in one task (the C(coldsnap_host) role does this only where the digest is not staged yet).
options:
  _terms:
    description: The activation runtime directory (default the collection's C(runtime_image/activation)).
    type: list
    elements: path
    required: false
"""

EXAMPLES = r"""
- name: Stage the collection's activation runtime on a host
  coldsnap.fleet.activation_runtime:
    files: "{{ lookup('coldsnap.fleet.activation_files') }}"
    digest: "{{ lookup('coldsnap.fleet.activation_digest') }}"
    state_root: /var/lib/coldsnap
"""

RETURN = r"""
_raw:
  description: One map per directory, relative path to C(content) (base64) and C(executable).
  type: list
  elements: dict
"""

from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.activation_stage import (
    file_map,
    runtime_dirs,
)


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        try:
            return [file_map(d) for d in runtime_dirs(terms)]
        except ColdSnapError as exc:
            raise AnsibleLookupError(str(exc)) from None
