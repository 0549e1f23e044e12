"""Snapshot driver n580: the capture dumps the engine as a context-free template (imports and
configuration done; no CUDA, no weights, no transport), then lets it start for real to validate
and export; a restore brings the template back and builds the engine from the hydration."""

from __future__ import annotations

import json

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.drivers import SNAPSHOT_DRIVERS
from snapshot_workload import Workload, units_of
from test_capture_restore import capture, restore

pytestmark = [pytest.mark.criu, pytest.mark.slow]


class N580(Workload):
    engine_core = False  # run the reference engine in vLLM V1's shape (API server + engine core)

    def request(self, operation, *, artifact=None, mutate=None):
        def n580(req):
            if self.engine_core:
                req["launch"]["units"][0]["command"].append("--engine-core-process")
            req["snapshot_driver"]["id"] = "n580"
            req["policy"]["process"]["graph_policy"] = SNAPSHOT_DRIVERS["n580"].policy_defaults["process"][
                "graph_policy"]
            if mutate is not None:
                mutate(req)
        return super().request(operation, artifact=artifact, mutate=n580)


def boundary(state_root, wl: Workload) -> dict:
    log = (state_root / "workloads" / wl.name / "unit-0" / "target.log").read_text().splitlines()
    return json.loads(log[0])


@pytest.mark.parametrize(("tp", "engine_core"), [(1, False), (2, False), (1, True)],
                         ids=["tp1", "tp2", "tp1-engine-core-process"])
def test_an_n580_capture_is_a_template_that_restores_by_building_the_engine(
        tp, engine_core, state_root, tiny_model, env_digest):
    wl = N580(state_root, tiny_model, env_digest, tp=tp, name=f"n580-tp{tp}{'-core' if engine_core else ''}")
    wl.engine_core = engine_core  # the template is then the API server and its engine core, both dumped
    try:
        artifact, art = capture(wl)
        assert art["snapshot_driver"]["id"] == "n580"
        accepted = art["acceptance"]["reply"]
        assert len(art["weights"]["workers"]) == tp and all(w["model_bytes"] > 0 for w in art["weights"]["workers"])
        unit_dir = state_root / "captures" / art["capture_id"] / "units" / "unit-0"
        evidence = json.loads((unit_dir / "evidence.json").read_text())
        for w in evidence["workers"]:
            # Dumped at the template boundary: no weights resident, so the image is small.
            assert w["cuda"] is False and w["payload"]["model_bytes"] > 0
        capture_log = (unit_dir / "logs" / "capture.log").read_text()
        assert "waiting as a template" in capture_log and "serving" in capture_log

        for mode in ("native", "recovery"):
            receipt = restore(wl, artifact, mode=mode)
            unit0 = next(u for u in units_of(receipt) if u["unit"] == "unit-0")
            assert unit0["reply"] == accepted
            # The fresh allocations hold the captured bytes: the same log-probabilities, bit for bit.
            assert unit0["logprobs_check"] == "identical"
            marker = boundary(state_root, wl)
            assert marker["coldsnap"] == "restore-boundary" and marker["template"] is True
            assert marker["provider"] == mode
            assert wl.complete() == accepted

        # A restored template is an ordinary engine afterwards: sleep and wake.
        slept = wl.run(wl.request("sleep", artifact=artifact))
        assert slept.succeeded, slept.receipt["error"]
        woke = wl.run(wl.request("wake", artifact=artifact))
        assert woke.succeeded, woke.receipt["error"]
        assert units_of(woke.receipt)[0]["reply"] == accepted
    finally:
        wl.stop()
