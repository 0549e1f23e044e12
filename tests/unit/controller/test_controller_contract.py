"""The controller/AWX/playbook contract: extra vars, inventory, playbook resolution, set_stats."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError

from coldsnap.runner import (
    UNITS_GROUP,
    inventory_from_request,
    operation_extravars,
    resolve_playbook,
    set_stats_artifacts,
)
from coldsnap.runner.contract import collection_dir, playbook_name


def _request(example_request_text: str, hosts: list[str]) -> dict:
    req = json.loads(example_request_text)
    base = req["launch"]["units"][0]
    req["launch"]["units"] = [{**base, "id": f"unit-{i}", "index": i, "host": h} for i, h in enumerate(hosts)]
    return req


def test_inventory_from_request_local_and_remote(example_request_text: str) -> None:
    inv = inventory_from_request(_request(example_request_text, ["localhost", "gpu-a", "gpu-a", "gpu-b"]))
    hosts = inv["all"]["children"][UNITS_GROUP]["hosts"]
    assert list(hosts) == ["localhost", "gpu-a", "gpu-b"]
    assert hosts["localhost"] == {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    assert hosts["gpu-a"] == {} and hosts["gpu-b"] == {}


def test_operation_extravars_are_exactly_the_contract(example_request_text: str) -> None:
    req = json.loads(example_request_text)
    ev = operation_extravars(req, prepare_only=True, state_root=Path("/srv/state"))
    assert ev == {"coldsnap_request": req, "coldsnap_prepare_only": True, "coldsnap_state_root": "/srv/state"}
    assert "coldsnap_state_root" not in operation_extravars(req)


def test_playbook_names() -> None:
    assert playbook_name("publish-native") == "publish_native"
    assert playbook_name("capture") == "capture"


def test_resolve_playbook_forms() -> None:
    fixture = "tests/fixtures/playbooks/succeed.yml"
    by_relative = resolve_playbook(fixture)
    assert by_relative == (collection_dir() / fixture).resolve()
    assert resolve_playbook(str(by_relative)) == by_relative


def test_resolve_playbook_fqcn_maps_to_playbooks_dir(tmp_path: Path) -> None:
    with pytest.raises(ColdSnapError) as err:
        resolve_playbook("coldsnap.fleet.no_such_operation")
    assert "playbooks/no_such_operation.yml" in str(err.value)
    assert "--playbook" in str(err.value)


def test_set_stats_artifacts_takes_the_stats_event() -> None:
    events = [
        {"event": "playbook_on_start", "event_data": {}},
        {"event": "runner_on_ok", "event_data": {"res": {"ansible_stats": {"data": {"x": 1}}}}},
        {"event": "playbook_on_stats", "event_data": {"artifact_data": {"coldsnap_result": {"ok": True}}}},
    ]
    assert set_stats_artifacts(events) == {"coldsnap_result": {"ok": True}}
    assert set_stats_artifacts(events[:2]) == {}


def test_a_relative_playbook_is_taken_from_the_current_directory_first(tmp_path: Path, monkeypatch) -> None:
    mine = tmp_path / "mine.yml"
    mine.write_text("- hosts: all\n  tasks: []\n")
    monkeypatch.chdir(tmp_path)
    assert resolve_playbook("./mine.yml") == mine.resolve() == resolve_playbook("mine.yml")
    with pytest.raises(ColdSnapError) as err:
        resolve_playbook("./typo.yml")
    assert "current directory" in err.value.fix and "--playbook" not in err.value.fix


def test_an_operations_own_playbook_never_comes_from_the_current_directory(tmp_path: Path, monkeypatch) -> None:
    """A directory that happens to hold playbooks/capture.yml must not replace the collection's."""
    from coldsnap.runner.contract import playbook_for

    (tmp_path / "playbooks").mkdir()
    (tmp_path / "playbooks" / "capture.yml").write_text("- hosts: all\n  tasks: []\n")
    monkeypatch.chdir(tmp_path)
    assert playbook_for("capture") == (collection_dir() / "playbooks" / "capture.yml").resolve()
