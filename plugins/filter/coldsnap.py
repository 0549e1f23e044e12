# Copyright: ColdSnap maintainers
# Apache License 2.0 (see LICENSE)
"""Filters the playbooks and roles use instead of repeating request and state-root logic:
``unit_hosts``, ``host_units``, ``host_unit_ids``, ``needs_coordinator``, ``state_root``, ``state_path``,
``artifact_file``.

Each is one function of module_utils (the same code the modules run)."""

from __future__ import annotations

import json

from ansible.errors import AnsibleFilterError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import (
    DEFAULT_STATE_ROOT,
    StateLayout,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import (
    load_artifact,
    read_descriptor_file,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import (
    needs_coordinator,
    unit_hosts,
    units_on_host,
)


def _request(value, name: str, *, hosts: bool = True) -> dict:
    if not isinstance(value, dict) or not isinstance(value.get("launch"), dict):
        raise AnsibleFilterError(f"{name}: expected the ColdSnap request (coldsnap_request), got {type(value).__name__}")
    units = value["launch"].get("units")
    needed = ("id", "host") if hosts else ("id",)
    if not isinstance(units, list) or not all(
            isinstance(u, dict) and all(isinstance(u.get(k), str) for k in needed) for u in units):
        raise AnsibleFilterError(f"{name}: the request's launch.units must be a list of units, each with its "
                                 f"{' and '.join(repr(k) for k in needed)} (validate it with: coldsnap validate "
                                 "--request-json FILE)")
    return value


def unit_hosts_filter(request) -> list[str]:
    """Inventory hostnames of the request's launch units, in unit order, each once."""
    return unit_hosts(_request(request, "unit_hosts"))


def host_units_filter(request, host: str) -> list[dict]:
    """The request's launch units placed on ``host``."""
    return units_on_host(_request(request, "host_units"), host)


def host_unit_ids_filter(request, host: str) -> list[str]:
    """Ids of the request's launch units placed on ``host``."""
    return [u["id"] for u in units_on_host(_request(request, "host_unit_ids"), host)]


def needs_coordinator_filter(request) -> bool:
    """Whether the request's activation needs the coordinator (more than one launch unit or worker)."""
    req = _request(request, "needs_coordinator", hosts=False)
    execution = req["launch"].get("execution")
    if not isinstance(execution, dict) or not isinstance(execution.get("workers"), list):
        raise AnsibleFilterError("needs_coordinator: the request's launch.execution.workers must be a list (validate "
                                 "it with: coldsnap validate --request-json FILE)")
    return needs_coordinator(req)


# The locations ``state_path`` names: StateLayout's path properties.
_LOCATIONS = tuple(sorted(n for n in vars(StateLayout) if isinstance(vars(StateLayout)[n], property)))


def _root(value, name: str) -> str:
    """``value`` as a state root: unset (None or '') means ColdSnap's default; otherwise an absolute path."""
    if value is None or value == "":
        return DEFAULT_STATE_ROOT
    if not isinstance(value, str):
        raise AnsibleFilterError(f"{name}: the state root must be a string, got {type(value).__name__} {value!r} "
                                 f"(fix: give an absolute path, or leave it unset for {DEFAULT_STATE_ROOT})")
    if not value.startswith("/"):
        raise AnsibleFilterError(f"{name}: the state root {value!r} is not an absolute path (fix: give an absolute "
                                 f"path such as {DEFAULT_STATE_ROOT}, the same on every host of a workload)")
    return value


def state_root_filter(value=None) -> str:
    """The state root: ``value`` when set (an absolute path), else ColdSnap's default (``/var/lib/coldsnap``)."""
    return _root(value, "state_root")


def state_path_filter(root, name: str, *parts: str) -> str:
    """A named location below the state root (``payloads``, ``payload_objects``, ``payload_incoming``,
    ``captures``, ``capsules_oci``, ``workloads``, ``runs``, ``artifacts`` ...), with optional parts below
    it (non-empty strings, no '..', no absolute path)."""
    base = _root(root, "state_path")
    if not isinstance(name, str) or name not in _LOCATIONS:
        raise AnsibleFilterError(f"state_path: unknown state location {name!r} (fix: name one of "
                                 f"{', '.join(_LOCATIONS)})")
    for i, part in enumerate(parts, start=1):
        if not isinstance(part, str) or not part:
            got = "an empty string" if part == "" else f"{type(part).__name__} {part!r}"
            raise AnsibleFilterError(f"state_path: part {i} below {name!r} must be a non-empty string, got {got} "
                                     "(fix: pass a defined name, e.g. the request's id; an undefined or null "
                                     "variable is never a path)")
    try:
        return str(StateLayout(base).path(name, *parts))
    except ValueError as exc:
        raise AnsibleFilterError(f"state_path: {exc} (fix: give a name below the location, without '/' at "
                                 "its start or '..')") from None


def artifact_file_filter(path) -> dict:
    """The artifact descriptor at ``path``, read and validated as every module reads one (a regular file of
    bounded size, format 9): a truncated, corrupt or unreadable descriptor fails naming the file and the fix."""
    if not isinstance(path, str) or not path:
        raise AnsibleFilterError(f"artifact_file: expected the path of an artifact.json, got {path!r} (fix: pass "
                                 "the request's artifact.path)")
    try:
        data = read_descriptor_file(path)
        load_artifact(data, document=f"artifact {path}")
        return json.loads(data)  # as written: the modules normalize it themselves
    except FileNotFoundError:
        raise AnsibleFilterError(f"artifact_file: artifact {path} does not exist (fix: name the artifact.json a "
                                 "capture committed)") from None
    except ColdSnapError as exc:
        raise AnsibleFilterError(f"artifact_file: {exc}") from None


class FilterModule:
    """ColdSnap filters."""

    def filters(self):
        return {
            "unit_hosts": unit_hosts_filter,
            "host_units": host_units_filter,
            "host_unit_ids": host_unit_ids_filter,
            "needs_coordinator": needs_coordinator_filter,
            "state_root": state_root_filter,
            "state_path": state_path_filter,
            "artifact_file": artifact_file_filter,
        }
