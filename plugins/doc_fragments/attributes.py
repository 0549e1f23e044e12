# Copyright: ColdSnap maintainers
# Apache License 2.0 (see LICENSE)
"""Attribute documentation shared by coldsnap.fleet modules.

``DOCUMENTATION`` describes the attributes every module states; each module adds its own
``support`` (and ``details`` where it has more to say). ``ACTION_GROUP`` documents the
membership in the action group of meta/runtime.yml.
"""

from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
attributes:
  check_mode:
    description: Can run in check mode; reports whether it would change something, without changing it.
  diff_mode:
    description: Returns the differences it made (or would make, in check mode) when run in diff mode.
  idempotent:
    description: A second run with the same arguments, on an unchanged target, reports no change.
"""

    ACTION_GROUP = r"""
attributes:
  action_group:
    description:
      - Member of the action group C(coldsnap.fleet.coldsnap), so that C(module_defaults) for
        C(group/coldsnap.fleet.coldsnap) can set the options the group shares (C(state_root)) once.
    support: full
    membership:
      - coldsnap.fleet.coldsnap
"""
