"""What a step's module options must be, refused before anything runs (check mode included): timeouts,
payload_wait, capture ids, activation digests, descriptor files, and the results one step hands the next."""

from __future__ import annotations

import os

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.commit import by_unit
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import read_descriptor_file
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import TIMEOUTS_ARG, check_timeouts
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.capture import (
    capture_running_units,
    capture_units,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.restore import restore_units

DIGEST = "sha256:" + "a" * 64


def test_timeouts_take_the_known_names_as_finite_positive_seconds():
    assert check_timeouts({"phase": 5, "ready": 2.5, "start": None, "cuda_lock": None}) == {"phase": 5.0, "ready": 2.5}
    assert check_timeouts(None) == {} and set(TIMEOUTS_ARG["options"]) == {"start", "ready", "phase", "cuda_lock"}
    for bad, message in (({"bogus": 5}, r"timeouts\.bogus is not a timeout.*give start, ready, phase or cuda_lock"),
                         ({"start": -1}, r"timeouts\.start is -1.*greater than 0"),
                         ({"phase": float("nan")}, r"timeouts\.phase is nan"),
                         ({"ready": float("inf")}, r"timeouts\.ready is inf"),
                         ({"ready": True}, r"timeouts\.ready is True"),
                         ({"ready": "abc"}, r"timeouts\.ready is 'abc'"),
                         ([5], r"timeouts must be a mapping")):
        with pytest.raises(ColdSnapError, match=message):
            check_timeouts(bad)


@pytest.mark.parametrize("check_mode", [True, False])
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"payload_wait": float("nan")}, r"payload_wait is nan"),
    ({"payload_wait": -5}, r"payload_wait is -5"),
    ({"capture_id": "../../x"}, r"capture_id '\.\./\.\./x' is not an id"),
    ({"activation_digest": "bad"}, r"activation_digest 'bad' has no algorithm prefix"),
    ({"timeouts": {"phase": 0}}, r"timeouts\.phase is 0"),
])
def test_an_overlay_capture_refuses_bad_options_before_it_waits_or_looks(tmp_path, check_mode, kwargs, message):
    """``payload_wait: nan`` used to poll for ever; every one of these is refused at once."""
    args = {"host": "h1", "capture_id": "ov-1", "state_root": tmp_path, "activation_digest": DIGEST,
            "coordinator_endpoint": None, "python": None, "check_mode": check_mode, **kwargs}
    with pytest.raises(ColdSnapError, match=message):
        capture_running_units({}, {}, **args)
    assert not (tmp_path / "captures").exists()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"capture_id": "a/b"}, r"capture_id 'a/b' is not an id"),
    ({"activation_digest": "sha256:xyz"}, r"activation_digest 'sha256:xyz' is not 64 hex digits"),
    ({"timeouts": {"start": "abc"}}, r"timeouts\.start is 'abc'"),
])
def test_a_capture_refuses_bad_options_in_check_mode_too(tmp_path, kwargs, message):
    args = {"host": "h1", "capture_id": "cap-1", "state_root": tmp_path, "activation_digest": DIGEST,
            "coordinator_endpoint": None, "python": None, "check_mode": True, **kwargs}
    with pytest.raises(ColdSnapError, match=message):
        capture_units({}, **args)


def test_an_activation_refuses_a_bad_digest_or_timeout_in_check_mode_too(tmp_path):
    args = {"host": "h1", "state_root": tmp_path, "coordinator_endpoint": None, "python": None, "warm": False,
            "check_mode": True}
    with pytest.raises(ColdSnapError, match=r"activation_digest 'bad' has no algorithm prefix"):
        restore_units({}, {}, activation_digest="bad", **args)
    with pytest.raises(ColdSnapError, match=r"timeouts\.ready is -1"):
        restore_units({}, {}, activation_digest=DIGEST, timeouts={"ready": -1}, **args)


def test_a_descriptor_path_that_is_no_regular_file_is_one_clear_error(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path, message in ((tmp_path, "is a directory"), ("/dev/zero", "is not a regular file"),
                          (fifo, "is not a regular file")):
        with pytest.raises(ColdSnapError, match=message):
            read_descriptor_file(path)  # never an endless read, never a wait on a pipe
    big = tmp_path / "big.json"
    with open(big, "wb") as fh:
        fh.truncate((64 << 20) + 1)  # sparse
    with pytest.raises(ColdSnapError, match="larger than 64 MiB"):
        read_descriptor_file(big)
    with pytest.raises(FileNotFoundError):
        read_descriptor_file(tmp_path / "missing.json")


REQUEST = {"launch": {"units": [{"id": "unit-0", "host": "h1"}]}}


@pytest.mark.parametrize(("evidence", "facts", "message"), [
    ([{}], {"h1": {}}, r"evidence\[0\] names no unit"),
    ([None], {"h1": {}}, r"evidence\[0\] names no unit"),
    ([{"unit": "unit-0"}], {"h1": {}}, r"evidence\[0\] \(unit 'unit-0'\) .*lacks criu_version, workers"),
    ([{"unit": "unit-0", "criu_version": "4.1", "workers": [1]}], {"h1": {}}, r"its workers are malformed"),
    ([{"unit": "unit-0", "criu_version": "4.1", "workers": []}], {"h1": 1}, r"facts\['h1'\] is a int"),
])
def test_malformed_step_results_are_named_not_a_key_error(evidence, facts, message):
    with pytest.raises(ColdSnapError, match=message):
        by_unit(REQUEST, evidence, facts, [{"unit": "unit-0"}])


def test_a_capture_in_check_mode_refuses_what_the_real_run_refuses_and_writes_nothing(tmp_path):
    """Another runtime environment than the pinned one: a real capture is refused before anything starts,
    and so is its check mode (it used to answer 'would capture')."""
    import json
    from pathlib import Path

    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import AdmissionError
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request

    fixture = Path(__file__).resolve().parents[2] / "fixtures" / "requests" / "capture-reference.json"
    req = json.loads(fixture.read_text())
    req["launch"]["units"][0]["host"] = "localhost"
    req = validate_request(req)
    for check_mode in (True, False):
        with pytest.raises(AdmissionError, match="differs from the pinned"):
            capture_units(req, host="localhost", capture_id="cap-1", state_root=tmp_path / "state",
                          activation_digest=DIGEST, coordinator_endpoint=None, python=None, check_mode=check_mode)
    assert not (tmp_path / "state" / "captures").exists()
