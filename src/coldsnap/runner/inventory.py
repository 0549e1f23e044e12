"""The inventory an operation runs against.

The Ansible inventory is authoritative for how to reach a host; without one the
controller writes a minimal one from the request's placement: every
``launch.units[].host`` becomes a host of group ``coldsnap_units``, and
``localhost`` runs through the local connection with the controller's own
Python (so modules see the same libraries as the controller).

A given inventory is checked before anything runs: every unit host must be in it
(:func:`check_unit_hosts`), else a play would skip that host and the operation
would fail late, on a ``hostvars[...]`` lookup.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError

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


def _require_readable(source: str) -> None:
    """An inventory path this user can read (a comma-separated host list is no path)."""
    if "," in source and not os.path.exists(source):
        return
    try:
        if os.path.isdir(source):
            os.listdir(source)
        else:
            with open(source, "rb"):
                pass
    except FileNotFoundError:
        raise ColdSnapError(f"--inventory {source} does not exist", fix="give the path of an Ansible inventory") from None
    except PermissionError:
        raise ColdSnapError(f"--inventory {source} is not readable by this user",
                            fix="run as a user who may read it, or give an inventory of your own") from None


def check_unit_hosts(request: Mapping[str, Any], inventory: Mapping[str, Any] | str | Path) -> None:
    """Every ``launch.units[].host`` must be a host of ``inventory`` (a path in any format Ansible reads, or
    an inventory dict); ColdSnapError naming the missing ones otherwise. Ansible's own InventoryManager reads
    it, so ``localhost`` counts as present as it does for ansible-playbook (the implicit localhost)."""
    from ansible import constants
    from ansible.errors import AnsibleError
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader

    if not isinstance(inventory, Mapping):
        _require_readable(str(inventory))
    with tempfile.TemporaryDirectory(prefix="coldsnap-inventory-") as tmp:
        source = Path(tmp) / "hosts.json" if isinstance(inventory, Mapping) else Path(inventory)
        if isinstance(inventory, Mapping):
            source.write_text(json.dumps(dict(inventory)), encoding="utf-8")  # 0700 directory, gone at once
        # An inventory Ansible cannot parse must not fall back to the implicit localhost (the run would then
        # act on this machine while the user meant their fleet).
        strict, constants.INVENTORY_ANY_UNPARSED_IS_FAILED = constants.INVENTORY_ANY_UNPARSED_IS_FAILED, True
        try:
            manager = InventoryManager(loader=DataLoader(), sources=[str(source)])
        except AnsibleError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ColdSnapError(f"inventory {inventory if not isinstance(inventory, Mapping) else '(dict)'} "
                                f"cannot be parsed: {first}",
                                fix="fix it (`ansible-inventory -i PATH --list` shows what Ansible reads)") from None
        finally:
            constants.INVENTORY_ANY_UNPARSED_IS_FAILED = strict
    missing = [f"launch.units[{i}].host {unit['host']!r}" for i, unit in enumerate(request["launch"]["units"])
               if manager.get_host(unit["host"]) is None]
    if not missing:
        return
    where = "the inventory dict" if isinstance(inventory, Mapping) else f"inventory {inventory}"
    known = sorted(h.name for h in manager.get_hosts("all"))
    raise ColdSnapError(
        f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not in {where} (Ansible reads "
        f"{len(known)} host{'s' if len(known) != 1 else ''} there{': ' + ', '.join(known[:20]) if known else ''})",
        fix="add the missing hosts to the inventory, or set launch.units[].host of the request to hosts the "
            "inventory has")
