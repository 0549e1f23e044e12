"""The snapshot driver of a request that names none, chosen by the controller before anything runs.

* capture: the newest driver the request is valid under whose contract admits every unit on its
  host. CPU-only units need no NVIDIA driver (every driver admits them); for GPU units the
  controller reads each GPU host's facts first (the module ``coldsnap.fleet.host_facts``, run ad
  hoc through ansible-runner against the operation's inventory), so a host whose NVIDIA driver
  is below a contract's floor is known before a unit starts;
* any other operation: the driver the artifact (``artifact.path``) was captured with.

The choice is recorded in the receipt (``result.snapshot_driver_selection``) and the request is
normalized for it; a request that names its driver is used as it is.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError, FormatError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import load_artifact
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import (
    driver_candidates,
    validate_request,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.admission import choose_snapshot_driver

from coldsnap.runner.driver import require_artifact_file
from coldsnap.runner.inventory import check_unit_hosts

FACTS_MODULE = "coldsnap.fleet.host_facts"


def resolve_snapshot_driver(operation: str, raw: Mapping[str, Any], *, inventory: Mapping[str, Any] | str | Path | None,
                            envvars: Mapping[str, str] | None = None,
                            facts: Mapping[str, dict] | None = None) -> tuple[str | None, dict | None]:
    """(driver id, selection record) for a request without ``snapshot_driver``; (None, None) when it names
    one (or is too broken to choose for: its validation then reports why). ``facts``: host facts already
    known (host -> facts); the missing GPU hosts' facts are gathered."""
    if not isinstance(raw, Mapping) or "snapshot_driver" in raw or not isinstance(raw.get("launch"), Mapping):
        return None, None
    if operation != "capture":
        return _from_artifact(raw)
    raw = raw if isinstance(raw, dict) else dict(raw)  # as decoded: its duplicate keys are still reported
    candidates, refused = driver_candidates(raw)
    if not candidates:
        raise next(iter(refused.values()))
    request = validate_request(raw, snapshot_driver=candidates[0])
    gpu_hosts = sorted({u["host"] for u in request["launch"]["units"] if u["devices"]})
    known = dict(facts or {})
    missing = [h for h in gpu_hosts if h not in known]
    if missing:
        if inventory is not None:
            check_unit_hosts(request, inventory if isinstance(inventory, Mapping) else Path(inventory).expanduser())
        known.update(gather_host_facts(request, missing, inventory=inventory, envvars=envvars))
    choice = choose_snapshot_driver(candidates, request, known)
    choice["refused"] = {**{d: _first_issue(e) for d, e in refused.items()}, **choice["refused"]}
    return choice["id"], choice


def _first_issue(exc: FormatError) -> str:
    return str(exc.issues[0]) if exc.issues else str(exc)


def _from_artifact(raw: Mapping[str, Any]) -> tuple[str | None, dict | None]:
    path = (raw.get("artifact") or {}).get("path") if isinstance(raw.get("artifact"), Mapping) else None
    if not isinstance(path, str) or not path:
        return None, None  # validation names $.snapshot_driver with the fix
    require_artifact_file(str(raw.get("operation")), raw)  # missing, not a file, not readable: said by field
    if not os.path.isfile(path):
        return None, None
    try:
        artifact = load_artifact(Path(path).read_bytes())
    except (OSError, ColdSnapError) as exc:
        raise ColdSnapError(f"artifact.path {path}: cannot read the snapshot driver it was captured with ({exc})",
                            fix="give snapshot_driver.id in the request, or point artifact.path at a valid "
                                "artifact descriptor") from None
    driver = artifact["snapshot_driver"]["id"]
    return driver, {"id": driver, "chosen_by": "artifact", "artifact": str(path), "refused": {}}


def gather_host_facts(request: Mapping[str, Any], hosts: list[str], *,
                      inventory: Mapping[str, Any] | str | Path | None,
                      envvars: Mapping[str, str] | None = None) -> dict[str, dict]:
    """Each of ``hosts``' ColdSnap host facts, read with one ad hoc ansible-runner run of
    :data:`FACTS_MODULE` (read-only, no CRIU check); ColdSnapError naming a host that failed."""
    try:
        import ansible_runner
    except ImportError:
        raise ColdSnapError("the controller needs ansible-runner, which is not installed",
                            fix="pip install ansible-runner (it is a dependency of the coldsnap package)") from None
    from coldsnap.runner.driver import RUNNER_SETTINGS, _prepare_run_dir

    with tempfile.TemporaryDirectory(prefix="coldsnap-facts-") as tmp:
        inventory_arg, secret_env = _prepare_run_dir(Path(tmp), public_vars={}, caller_env=dict(envvars or {}),
                                                     inventory=inventory, request=request)
        r = ansible_runner.run(private_data_dir=tmp, host_pattern=",".join(hosts), module=FACTS_MODULE,
                               module_args="check_criu=false", inventory=inventory_arg,
                               envvars=secret_env or None, settings=dict(RUNNER_SETTINGS), suppress_env_files=True,
                               quiet=True)
        if r.status == "canceled":  # Ctrl-C while the facts were read: the user stopped the command
            raise KeyboardInterrupt
        found: dict[str, dict] = {}
        failed: dict[str, str] = {}
        for event in r.events:
            data = event.get("event_data") or {}
            host = data.get("host")
            res = data.get("res") or {}
            if event.get("event") == "runner_on_ok" and host:
                found[host] = (res.get("ansible_facts") or {}).get("coldsnap_host") or {}
            elif event.get("event") in ("runner_on_failed", "runner_on_unreachable") and host:
                failed[host] = str(res.get("msg") or "failed")[:500]
    for host in hosts:
        if host not in found and host not in failed:
            failed[host] = "no facts came back"
    if failed:
        raise ColdSnapError("cannot read the facts the snapshot driver is chosen from: "
                            + "; ".join(f"{h}: {why}" for h, why in sorted(failed.items())),
                            fix="make the hosts reachable with the inventory's settings, or give snapshot_driver.id "
                                "in the request")
    return found
