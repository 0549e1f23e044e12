"""Snapshot driver selection: a request without ``snapshot_driver`` gets the newest driver every placed
host supports; the capture host's contract is checked before anything starts."""

from __future__ import annotations

import copy
import json

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import AdmissionError, FormatError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import (
    driver_candidates,
    validate_request,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.admission import (
    admit_capture,
    choose_snapshot_driver,
)

import coldsnap  # noqa: F401  # pylint: disable=unused-import


@pytest.fixture
def raw(example_request_text) -> dict:
    req = json.loads(example_request_text)
    req.pop("snapshot_driver", None)
    req["policy"].pop("process")  # the drivers' own defaults
    return req


def gpu(req: dict, *, workers: int = 1) -> dict:
    """The request with ``workers`` GPU workers in its first unit (one GPU each)."""
    out = copy.deepcopy(req)
    out["launch"]["units"][0]["devices"] = list(range(workers))
    ex = out["launch"]["execution"]
    first = ex["workers"][0]
    ex["workers"] = [{**first, "id": f"{first['id']}-{i}" if i else first["id"], "rank": i, "device_slot": i}
                     for i in range(workers)]
    for g in ex.get("groups", []):
        g["workers"] = [w["id"] for w in ex["workers"]]
    return out


def test_a_request_without_a_driver_is_refused_unless_one_is_chosen_for_it(raw):
    with pytest.raises(FormatError) as exc:
        validate_request(copy.deepcopy(raw))
    (issue,) = exc.value.issues
    assert issue.path == "$.snapshot_driver" and "snapshot_driver.id" in issue.fix
    n580 = validate_request(copy.deepcopy(raw), snapshot_driver="n580")
    assert n580["snapshot_driver"] == {"id": "n580"}
    assert n580["policy"]["process"]["backend"] == "criu"  # the chosen driver's defaults
    assert validate_request(copy.deepcopy(raw), snapshot_driver="n610")["policy"]["process"]["backend"] == "cuda-criu"


def test_a_named_driver_wins_and_a_contradicting_choice_is_refused(raw):
    named = {**copy.deepcopy(raw), "snapshot_driver": {"id": "n580"}}
    assert validate_request(copy.deepcopy(named), snapshot_driver="n580")["snapshot_driver"]["id"] == "n580"
    with pytest.raises(FormatError) as exc:
        validate_request(copy.deepcopy(named), snapshot_driver="n610")
    assert exc.value.issues[0].path == "$.snapshot_driver.id"
    with pytest.raises(FormatError, match="unknown snapshot driver"):
        validate_request(copy.deepcopy(raw), snapshot_driver="n999")


def test_candidates_are_newest_first_and_say_why_a_driver_does_not_fit(raw):
    assert driver_candidates(copy.deepcopy(raw))[0] == ["n610", "n580"]
    valid, refused = driver_candidates(gpu(raw))
    assert valid == ["n610", "n580"] and not refused  # the reference engine stops as a pre-CUDA template
    policy = {**copy.deepcopy(raw), "policy": {"process": {"backend": "criu"}}}
    valid, refused = driver_candidates(gpu(policy))
    assert valid == ["n580"]  # plain CRIU cannot dump CUDA state: only the template fits
    assert refused["n610"].issues[0].path == "$.policy.process.backend"


def test_an_engine_without_a_template_has_no_n580_on_gpu_units(raw, monkeypatch):
    import dataclasses

    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import engines

    name = raw["launch"]["engine"]
    monkeypatch.setitem(engines.ENGINES, name, dataclasses.replace(engines.ENGINES[name], template_capture=False))
    valid, refused = driver_candidates(gpu(raw))
    assert valid == ["n610"]
    assert refused["n580"].issues[0].path == "$.snapshot_driver.id"


def test_a_driver_580_host_with_two_gpu_ranks_in_a_unit_gets_the_template(raw):
    req = gpu(raw, workers=2)
    host = req["launch"]["units"][0]["host"]
    valid = driver_candidates(copy.deepcopy(req))[0]
    checked = validate_request(req, snapshot_driver="n610")
    choice = choose_snapshot_driver(valid, checked, {host: {"nvidia_driver": "580.159.04"}})
    # n610 on driver 580 admits one GPU worker per unit (its r580 row); the template has no such limit.
    assert choice["id"] == "n580" and choice["rows"] == ["n580"]


def test_cpu_units_need_no_facts(raw):
    req = validate_request(copy.deepcopy(raw), snapshot_driver="n610")
    choice = choose_snapshot_driver(["n610", "n580"], req, {})
    assert choice["id"] == "n610" and choice["rows"] == ["n610-cpu"] and choice["nvidia_drivers"] == {}


@pytest.mark.parametrize(("driver", "row"), [("610.12", "n610"), ("580.65.06", "n610-single-process-r580")])
def test_gpu_hosts_choose_by_their_nvidia_driver(raw, driver, row):
    req = validate_request(gpu(raw), snapshot_driver="n610")
    host = req["launch"]["units"][0]["host"]
    choice = choose_snapshot_driver(["n610"], req, {host: {"nvidia_driver": driver}})
    assert choice["id"] == "n610" and choice["rows"] == [row] and choice["nvidia_drivers"] == {host: driver}


def test_no_driver_fits_names_each_refusal_and_the_host(raw):
    req = validate_request(gpu(raw), snapshot_driver="n610")
    host = req["launch"]["units"][0]["host"]
    with pytest.raises(AdmissionError) as exc:
        choose_snapshot_driver(["n610", "n580"], req, {host: {"nvidia_driver": "575.51.02"}})
    text = str(exc.value)
    assert "n610:" in text and "n580:" in text and host in text and "575.51.02" in text
    with pytest.raises(AdmissionError, match="needs an NVIDIA driver"):
        choose_snapshot_driver(["n610"], req, {host: {"nvidia_driver": None}})


def test_two_gpu_workers_in_a_unit_need_the_full_n610_floor(raw):
    req = validate_request(gpu(raw, workers=2), snapshot_driver="n610")
    host = req["launch"]["units"][0]["host"]
    assert choose_snapshot_driver(["n610"], req, {host: {"nvidia_driver": "610.1"}})["rows"] == ["n610"]
    with pytest.raises(AdmissionError, match="older than snapshot driver n610's minimum 610"):
        choose_snapshot_driver(["n610"], req, {host: {"nvidia_driver": "580.159.04"}})


def test_capture_admission_names_the_unit_and_host(raw):
    req = validate_request(gpu(raw), snapshot_driver="n610")
    unit = req["launch"]["units"][0]
    assert admit_capture(req, host="gpu-7", units=[unit], nvidia_driver="580.159.04") == ["n610-single-process-r580"]
    with pytest.raises(AdmissionError) as exc:
        admit_capture(req, host="gpu-7", units=[unit], nvidia_driver=None)
    assert f"unit {unit['id']} on gpu-7" in str(exc.value) and exc.value.fix
