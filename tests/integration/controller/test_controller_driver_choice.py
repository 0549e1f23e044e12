"""The controller chooses the snapshot driver of a request that names none (real ansible-runner runs)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from controller_helpers import PLAYBOOKS, REQUEST, local_inventory

from coldsnap import api

ARTIFACT = Path(__file__).resolve().parents[2] / "fixtures" / "artifacts" / "reference-tiny-n610.json"


def _raw(operation: str = "capture") -> dict:
    req = json.loads(REQUEST.read_text())
    req.pop("snapshot_driver")
    req["policy"].pop("process")  # the chosen driver's defaults
    req["operation"] = operation
    return req


def _stored_request(state: Path, receipt) -> dict:
    return json.loads((state / "runs" / receipt.operation_id / "env" / "extravars").read_text())["coldsnap_request"]


def test_cpu_units_get_the_newest_driver_and_the_receipt_says_why(tmp_path: Path) -> None:
    state = tmp_path / "state"
    receipt = api.run("capture", _raw(), playbook=PLAYBOOKS / "succeed.yml", state_root=state,
                      inventory=local_inventory())
    assert receipt.succeeded
    assert receipt.raw["snapshot_driver"] == "n610"
    choice = receipt.raw["result"]["snapshot_driver_selection"]
    assert choice["id"] == "n610" and choice["rows"] == ["n610-cpu"] and choice["chosen_by"].startswith("no GPU")
    played = _stored_request(state, receipt)
    assert played["snapshot_driver"] == {"id": "n610"} and played["policy"]["process"]["backend"] == "cuda-criu"


def test_other_operations_take_the_artifacts_driver(tmp_path: Path) -> None:
    art = json.loads(ARTIFACT.read_text())
    art["snapshot_driver"].update(id="n580", row="n580-cpu")
    path = tmp_path / "artifact.json"
    path.write_text(json.dumps(art))
    req = _raw("restore")
    req["artifact"] = {"path": str(path)}
    state = tmp_path / "state"
    receipt = api.run("restore", req, prepare_only=True, playbook=PLAYBOOKS / "succeed.yml", state_root=state,
                      inventory=local_inventory())
    assert receipt.succeeded and receipt.raw["snapshot_driver"] == "n580"
    assert receipt.raw["result"]["snapshot_driver_selection"] == {"id": "n580", "chosen_by": "artifact",
                                                                  "artifact": str(path), "refused": {}}
    assert _stored_request(state, receipt)["policy"]["process"]["backend"] == "criu"


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this host has an NVIDIA driver")
def test_gpu_units_on_a_host_without_an_nvidia_driver_are_refused_before_anything_runs(tmp_path: Path) -> None:
    req = _raw()
    req["launch"]["units"][0]["devices"] = [0]
    req["launch"]["execution"]["workers"][0]["device_slot"] = 0
    state = tmp_path / "state"
    with pytest.raises(ColdSnapError) as exc:  # the facts came from the host, through ansible-runner
        api.run("capture", req, playbook=PLAYBOOKS / "succeed.yml", state_root=state, inventory=local_inventory())
    text = str(exc.value)
    assert "no snapshot driver admits" in text and "on localhost" in text and "needs an NVIDIA driver" in text
    assert not (state / "runs").exists()  # no run started


def test_a_unit_host_missing_from_the_inventory_is_named_before_facts_are_read(tmp_path: Path) -> None:
    req = _raw()
    req["launch"]["units"][0]["host"] = "gpu-missing-1"
    req["launch"]["units"][0]["devices"] = [0]
    req["launch"]["execution"]["workers"][0]["device_slot"] = 0
    with pytest.raises(ColdSnapError, match="gpu-missing-1"):
        api.run("capture", req, playbook=PLAYBOOKS / "succeed.yml", state_root=tmp_path / "state",
                inventory=local_inventory())
