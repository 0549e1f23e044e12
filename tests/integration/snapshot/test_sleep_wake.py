"""Live, node-local lifecycle of a restored workload (coldsnap sleep | wake | status):
weights released and KV discarded while the process stays; wake hydrates and validates;
every verb converges (a second run changes nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest
from snapshot_workload import Workload

pytestmark = [pytest.mark.criu, pytest.mark.slow]


def states(receipt: dict) -> list[str]:
    return [w["state"] for u in receipt["result"]["operation"]["units"] for w in u["workers"]]


def changed_units(receipt: dict) -> int:
    return sum(s.get("changed", 0) for s in receipt["result"]["stats"].values())


def test_sleep_wake_status_converge(state_root, tiny_model, env_digest):
    wl = Workload(state_root, tiny_model, env_digest, tp=1, name="sleepwake")
    try:
        cap = wl.run(wl.request("capture"))
        assert cap.succeeded, cap.receipt["error"]
        artifact = Path(cap.receipt["result"]["operation"]["artifact"])
        res = wl.run(wl.request("restore", artifact=artifact))
        assert res.succeeded, res.receipt["error"]
        pid = wl.engines()[0]
        accepted = res.receipt["result"]["operation"]["units"][0]["reply"]

        status = wl.run(wl.request("status", artifact=artifact))
        assert status.succeeded, status.receipt["error"]
        assert status.receipt["replay_semantics"] == "convergent"
        assert states(status.receipt) == ["ready"]

        slept = wl.run(wl.request("sleep", artifact=artifact))
        assert slept.succeeded, slept.receipt["error"]
        assert states(slept.receipt) == ["sleeping"]
        assert wl.engines() == [pid], "sleep keeps the process"
        again = wl.run(wl.request("sleep", artifact=artifact))
        assert again.succeeded and states(again.receipt) == ["sleeping"]
        assert not again.receipt["result"]["operation"]["units"][0]["changed"]

        woke = wl.run(wl.request("wake", artifact=artifact))
        assert woke.succeeded, woke.receipt["error"]
        assert states(woke.receipt) == ["ready"]
        assert woke.receipt["result"]["operation"]["units"][0]["reply"] == accepted
        assert wl.complete() == accepted
        again = wl.run(wl.request("wake", artifact=artifact))
        assert again.succeeded and not again.receipt["result"]["operation"]["units"][0]["changed"]
        assert wl.engines() == [pid]
    finally:
        wl.stop()
