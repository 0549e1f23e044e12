"""A restore that fails after it evicted the running workload says so, once: what was evicted (units, pids
or containers), that it is not running, and how to serve again; the evict step reports what it stopped
for the receipt. A failure before the evict step says nothing was evicted."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    FormatError,
    FormatIssue,
    IntegrityError,
    UnitError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import eviction
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import restore
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.claim import Claim
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.runtime import raise_failures

EVICTED = [{"unit": "unit-0", "pid": 4242, "pids": [4242, 4250], "processes": 9}]


class FakeRuntime:
    """A runtime whose restore fails as ``raise_failures`` fails it (or as ``fail`` says)."""

    def __init__(self, fail: BaseException | None = None, stopped: list[dict] | None = None) -> None:
        self.fail = fail
        self.stopped = stopped or []

    def unit_dir(self, _artifact, unit_id):
        return Path("/nonexistent") / unit_id

    def restore(self, _artifact, _specs):
        if self.fail is not None:
            raise self.fail
        raise_failures([{"ok": False, "unit": "unit-0",
                         "error": "unit unit-0: the engine (pid 4242) died right after CRIU restored it"}])

    def require_restorable(self, _artifact, *, check_mode):
        self.checked = check_mode

    def evict(self, *, check_mode):
        if isinstance(self.fail, ColdSnapError):
            raise self.fail
        return self.stopped


@pytest.fixture
def fake(monkeypatch):
    def use(runtime: FakeRuntime) -> None:
        monkeypatch.setattr(restore, "runtime_for", lambda *_a, **_k: runtime)
        monkeypatch.setattr(restore, "units_on_host", lambda *_a, **_k: [{"id": "unit-0"}])
        monkeypatch.setattr(restore, "build_specs", lambda *_a, **_k: [])
        monkeypatch.setattr(restore, "plan_weights", lambda *_a, **_k: {})
        monkeypatch.setattr(restore, "accepted_validation", lambda *_a, **_k: None)
        monkeypatch.setattr(restore, "placements_of", lambda *_a, **_k: {})
        # the host's claim on the workload (tests/unit/units/test_host_claim.py): free here
        monkeypatch.setattr(restore, "claimed", lambda *_a, **_k: contextlib.nullcontext(Claim(None, {})))
    return use


def activate(evicted):
    return restore.restore_units({}, {"capture_id": "c"}, host="gpu-a", state_root=Path("/nonexistent"),
                                 activation_digest="sha256:" + "ab" * 32, coordinator_endpoint=None, python=None,
                                 warm=False, check_mode=False, evicted=evicted)


def test_an_activation_failure_after_eviction_names_what_was_evicted_once(fake):
    fake(FakeRuntime())
    with pytest.raises(UnitError) as err:
        activate(EVICTED)
    msg = str(err.value)
    assert msg.startswith("restore failed after eviction: "), msg  # first: a message cut short still says it
    assert msg.endswith("The cause: unit unit-0: the engine (pid 4242) died right after CRIU restored it"), msg
    assert msg.count(eviction.EVICTED_PHRASE) == 1, msg
    assert "the workload that ran before on gpu-a was evicted and is not running" in msg
    assert "unit unit-0 (engine pids 4242, 4250)" in msg
    assert "restore again" in msg and "another generation" in msg and "policy.weights.mode: recovery" in msg
    assert err.value.details["previous_workload"] == "evicted" and err.value.details["evicted"] == EVICTED
    assert err.value.details["evidence"][0]["unit"] == "unit-0", "the units' evidence is kept"


def test_a_failure_that_keeps_its_fix_and_class_and_docker_containers_are_named(fake):
    fake(FakeRuntime(IntegrityError("unit unit-0: worker-0's pack hashes to sha256:aa", fix="restage it")))
    with pytest.raises(IntegrityError) as err:
        activate([{"unit": "unit-0", "container": "cs-w-unit-0", "status": "running"}])
    msg = str(err.value)
    assert msg.endswith("The cause: unit unit-0: worker-0's pack hashes to sha256:aa; restage it"), msg
    assert "unit unit-0 (container cs-w-unit-0)" in msg and msg.count(eviction.EVICTED_PHRASE) == 1
    # A message that says it already (an inner layer that knew) is not told twice.
    again = restore.failed_after_eviction(err.value, EVICTED, host="gpu-a")
    assert str(again).count(eviction.EVICTED_PHRASE) == 1


def test_an_unexpected_failure_and_an_odd_error_class_still_say_it(fake):
    fake(FakeRuntime(KeyError("workers")))
    with pytest.raises(ColdSnapError) as err:
        activate(EVICTED)
    assert "failed unexpectedly: KeyError" in str(err.value) and eviction.EVICTED_PHRASE in str(err.value)
    odd = FormatError([FormatIssue("$.x", "bad", "fix it")], document="spec")
    said = restore.failed_after_eviction(odd, EVICTED, host="gpu-a")
    assert isinstance(said, ColdSnapError) and not isinstance(said, FormatError) and "$.x: bad" in str(said) and eviction.EVICTED_PHRASE in str(said)


def test_with_nothing_evicted_the_failure_is_unchanged(fake):
    fake(FakeRuntime())
    for evicted in ([], None):
        with pytest.raises(UnitError) as err:
            activate(evicted)
        assert str(err.value) == "unit unit-0: the engine (pid 4242) died right after CRIU restored it"
        assert "previous_workload" not in err.value.details


def test_the_evict_step_and_a_restored_host_report_for_the_receipt(fake, monkeypatch):
    fake(FakeRuntime(stopped=EVICTED))
    out = restore.evict({}, {}, host="gpu-a", state_root=Path("/nonexistent"), check_mode=False)
    assert out["stopped"] == EVICTED
    assert out[eviction.RESULT_EVICTED_KEY] == {"host": "gpu-a", "units": EVICTED}
    assert eviction.RESULT_EVICTED_KEY not in restore.evict({}, {}, host="gpu-a", state_root=Path("/x"), check_mode=True)
    fake(FakeRuntime(ColdSnapError("unit unit-0: engine pids [4242] were killed but not reaped", fix="reap")))
    with pytest.raises(ColdSnapError) as err:
        restore.evict({}, {}, host="gpu-a", state_root=Path("/nonexistent"), check_mode=False)
    assert "failed part way" in str(err.value) and str(err.value).endswith("; reap")
    assert err.value.details[eviction.RESULT_EVICTED_KEY] == {"host": "gpu-a", "units": None}

    class Restores(FakeRuntime):
        def restore(self, _artifact, _specs):
            return []

    fake(Restores())
    monkeypatch.setattr(restore, "timing_of", lambda _ev: {"spans": [], "marks": []})
    assert activate(EVICTED)[eviction.RESULT_EVICTED_KEY] == {"host": "gpu-a", "restored": True}


def test_the_receipt_record_says_what_became_of_the_previous_workload():
    units = [{"unit": "unit-0", "pid": 7, "pids": [7], "processes": 2}]
    failed = eviction.receipt_record({"a": {"units": units, "restored": False}, "b": {"units": [], "restored": True}},
                                     succeeded=False, interrupted=False)
    assert failed == {"previous_workload": "evicted", "evicted": True, "hosts": ["a", "b"],
                      "units": [{"host": "a", "unit": "unit-0", "pid": 7, "pids": [7], "processes": 2,
                                 "restored": False}]}
    ok = eviction.receipt_record({"a": {"units": units, "restored": True}}, succeeded=True, interrupted=False)
    assert ok["previous_workload"] == "replaced" and ok["units"][0]["restored"] is True
    # One host evicted and restored, another evicted and failed: evicted (the second is not running).
    mixed = eviction.receipt_record({"a": {"units": units, "restored": True}, "b": {"units": units}},
                                    succeeded=False, interrupted=False)
    assert mixed["previous_workload"] == "evicted" and [u["restored"] for u in mixed["units"]] == [True, False]
    assert eviction.receipt_record({}, succeeded=False, interrupted=False)["previous_workload"] == "untouched"
    assert eviction.receipt_record({}, succeeded=False, interrupted=False)["evicted"] is False
    assert eviction.receipt_record({"a": {"units": []}}, succeeded=False,
                                   interrupted=False)["previous_workload"] == "none-running"
    part_way = eviction.receipt_record({"a": {"units": None}}, succeeded=False, interrupted=False)
    assert part_way["previous_workload"] == "unknown" and part_way["evicted"] is None
    assert eviction.receipt_record({}, succeeded=False, interrupted=True)["previous_workload"] == "unknown"


def test_a_failure_before_eviction_says_nothing_was_evicted_once():
    said = eviction.before_eviction("unit unit-0: aarch64 is not this host's architecture x86_64; use an x86 host")
    assert said.count(eviction.UNTOUCHED_PHRASE) == 1 and "runs as it did" in said
    already = "Host(s) b failed or were unreachable during preparation; nothing was evicted."
    assert eviction.before_eviction(already) == already
