"""The inventory an operation runs against.

The Ansible inventory is authoritative for how to reach a host; without one the
controller writes a minimal one from the request's placement: every
``launch.units[].host`` becomes a host of group ``coldsnap_units``, and
``localhost`` runs through the local connection with the controller's own
Python (so modules see the same libraries as the controller).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

UNITS_GROUP = "coldsnap_units"
LOCAL_NAMES = ("localhost",)


def inventory_from_request(request: Mapping[str, Any], *, python: str | None = None) -> dict[str, Any]:
    """A YAML/JSON inventory (as a dict) holding every unit host of ``request``."""
    hosts: dict[str, dict[str, Any]] = {}
    for unit in request["launch"]["units"]:
        name = unit["host"]
        if name in hosts:
            continue
        hosts[name] = local_host_vars(python) if name in LOCAL_NAMES else {}
    return {"all": {"children": {UNITS_GROUP: {"hosts": hosts}}}}


def local_host_vars(python: str | None = None) -> dict[str, str]:
    """Host vars that run a host through the local connection with the controller's Python."""
    return {"ansible_connection": "local", "ansible_python_interpreter": python or sys.executable}
