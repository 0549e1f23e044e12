"""A unit that holds several workers: tensor parallelism inside one unit (the shape of vLLM's
in-process TP: one server, N ranks), here the reference engine's two gloo ranks on one host.
Both ranks are dumped and restored by one unit activation, and every verb acts on both."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from snapshot_workload import Workload, units_of
from test_capture_restore import capture, restore

pytestmark = [pytest.mark.criu, pytest.mark.slow]


def one_unit(req: dict) -> None:
    """Both ranks in unit-0 (the harness lays TP out as one unit per rank)."""
    req["launch"]["units"] = req["launch"]["units"][:1]
    for w in req["launch"]["execution"]["workers"]:
        w["unit"] = "unit-0"


class OneUnitTP2(Workload):
    def request(self, operation, *, artifact=None, mutate=None):
        def both(req):
            one_unit(req)
            if mutate is not None:
                mutate(req)
        return super().request(operation, artifact=artifact, mutate=both)


def workers_of(receipt: dict) -> list[tuple[str, str]]:
    return [(w["worker"], w.get("state")) for u in units_of(receipt) for w in u["workers"]]


def test_a_unit_with_two_ranks_is_captured_restored_and_driven_as_one(state_root, tiny_model, env_digest):
    wl = OneUnitTP2(state_root, tiny_model, env_digest, tp=2, name="tp2-one-unit")
    try:
        artifact, art = capture(wl)
        accepted = art["acceptance"]["reply"]
        assert [u["id"] for u in art["launch"]["units"]] == ["unit-0"]
        assert [c["unit"] for c in art["capsule"]["units"]] == ["unit-0"]
        # Each rank has its own payload (its shard), both in the one unit.
        assert sorted(w["worker"] for w in art["weights"]["workers"]) == ["worker-0", "worker-1"]
        assert len({w["payload"]["sha256"] for w in art["weights"]["workers"]}) == 2
        assert {w["unit"] for w in art["weights"]["workers"]} == {"unit-0"}

        native = restore(wl, artifact, mode="native")
        [unit] = units_of(native)
        assert unit["reply"] == accepted and unit["logprobs_check"] == "identical"
        assert sorted(w["worker"] for w in unit["workers"]) == ["worker-0", "worker-1"]
        pids = sorted(wl.engines())
        # CRIU gives each rank its captured pid back; both run, and the served reply is the captured one.
        assert pids == sorted(w["pid"] for w in unit["workers"]) and len(pids) == 2
        assert wl.complete() == accepted

        status = wl.run(wl.request("status", artifact=artifact))
        assert status.succeeded, status.receipt["error"]
        assert workers_of(status.receipt) == [("worker-0", "ready"), ("worker-1", "ready")]
        slept = wl.run(wl.request("sleep", artifact=artifact))
        assert slept.succeeded, slept.receipt["error"]
        assert workers_of(slept.receipt) == [("worker-0", "sleeping"), ("worker-1", "sleeping")]
        woke = wl.run(wl.request("wake", artifact=artifact))
        assert woke.succeeded, woke.receipt["error"]
        assert units_of(woke.receipt)[0]["reply"] == accepted
        assert sorted(wl.engines()) == pids, "sleep and wake keep both processes"

        # A restore evicts both ranks of the running unit first; recovery computes the same values.
        again = restore(wl, artifact, mode="recovery")
        [unit] = units_of(again)
        assert unit["reply"] == accepted and unit["logprobs_check"] == "identical"
        assert len(wl.engines()) == 2
        for pid in pids:
            assert os.path.exists(f"/proc/{pid}"), "the restore brings back the captured pids"

        stopped = wl.run(wl.request("stop", artifact=artifact))
        assert stopped.succeeded, stopped.receipt["error"]
        assert not wl.engines() and not any(os.path.exists(f"/proc/{pid}") for pid in pids), "stop ends both ranks"
    finally:
        wl.stop()


def test_restoring_a_one_unit_capture_as_two_units_is_refused_naming_the_layout(state_root, tiny_model, env_digest):
    wl = OneUnitTP2(state_root, tiny_model, env_digest, tp=2, name="tp2-one-unit-split")
    try:
        artifact, _art = capture(wl)
        split = Workload(state_root, tiny_model, env_digest, tp=2, name=wl.name)
        split.port = wl.port
        res = split.run(split.request("restore", artifact=Path(artifact)))
        assert not res.succeeded
        error = res.receipt["error"]["message"]
        assert "$.launch.units" in error and "$.launch.execution.workers" in error, error
        assert not wl.engines()
    finally:
        wl.stop()
