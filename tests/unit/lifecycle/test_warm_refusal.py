"""Warm restore needs a driver with the boundary after CUDA and transport reconstruction: n580 has none."""

from __future__ import annotations

import json

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import FormatError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.receipt import replay_semantics
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request
from lifecycle_helpers import make_request

from coldsnap.cli import main
from coldsnap.runner import playbook_for


def warm_request(driver: str) -> dict:
    req = make_request(operation="warm", driver=driver, artifact="/var/lib/coldsnap/x/artifact.json")
    return json.loads(json.dumps(req))


def test_warm_is_refused_for_n580_with_a_clear_message(tmp_path, capsys):
    req = warm_request("n610")
    req["snapshot_driver"]["id"] = "n580"
    with pytest.raises(FormatError) as err:
        validate_request(req)
    assert "n580 has no warm-restore boundary" in str(err.value) and "snapshot driver n610" in str(err.value)
    path = tmp_path / "warm.json"
    path.write_text(json.dumps(req))
    rc = main(["warm", "--request-json", str(path), "--state-root", str(tmp_path / "state")])
    _out, stderr = capsys.readouterr()
    assert rc == 2 and "no warm-restore boundary" in stderr
    assert not (tmp_path / "state").exists(), "refused before anything ran"


def test_warm_is_accepted_for_n610_and_reported_as_its_own_operation():
    assert validate_request(warm_request("n610"))["operation"] == "warm"
    assert replay_semantics("warm") == "reconcile-replace"
    assert playbook_for("warm").name == "warm.yml"
    assert playbook_for("native-status").name == "native_status.yml"
    assert playbook_for("delete").name == "delete.yml"
