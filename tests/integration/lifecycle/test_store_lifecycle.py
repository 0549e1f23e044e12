"""Descriptor store and delete with real captures: promotion at capture, retention pruning what a dropped
generation alone referenced, and `delete` of one recipe and driver while another driver's retained
generation still references the same model payload."""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.store import ArtifactStore
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import load_artifact
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.drivers import SNAPSHOT_DRIVERS
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.receipt import validate_receipt
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.status import payload_state
from lifecycle_workload import Workload, ok, pack_of, result_of, run

pytestmark = [pytest.mark.criu, pytest.mark.slow]


def switch_driver(req: dict, driver: str) -> None:
    """Another driver for a normalized request: its driver-owned process defaults go with the old one."""
    req["snapshot_driver"]["id"] = driver
    req["policy"]["process"]["graph_policy"] = SNAPSHOT_DRIVERS[driver].policy_defaults["process"]["graph_policy"]


def capture(wl: Workload, *, driver: str, retention: int = 3) -> tuple[Path, dict, dict]:
    def mutate(req):
        switch_driver(req, driver)
        req["policy"]["retention"] = {"generations": retention}

    receipt = ok(wl.run(wl.request("capture", mutate=mutate)))
    artifact = Path(result_of(receipt)["artifact"])
    return artifact, load_artifact(artifact.read_bytes()), result_of(receipt)


def local_state(state_root: Path, art: dict) -> dict:
    """Which of a descriptor's local artifacts exist on this host."""
    cap = art["capsule"]["units"][0]
    return {"capture": (state_root / "captures" / art["capture_id"]).exists(),
            "capsule": Path(cap["location"]).exists(),
            "pack": NodeCache(state_root).contains(pack_of(art)["sha256"])}


def delete(wl: Workload, artifact: Path, driver: str) -> dict:
    def mutate(req):
        switch_driver(req, driver)

    receipt = ok(run(wl, wl.request("delete", artifact=artifact, mutate=mutate)))
    validate_receipt(receipt)
    assert receipt["replay_semantics"] == "convergent"
    return result_of(receipt)


def test_retention_then_delete_with_a_payload_still_referenced(state_root, tiny_model, env_digest):
    wl = Workload(state_root, tiny_model, env_digest, tp=1, name="store")
    store = ArtifactStore(state_root)
    try:
        a1, art_a1, res_a1 = capture(wl, driver="n610")
        b1, art_b1, _unused = capture(wl, driver="n580")
        # The same model bytes give the same payload object under both drivers.
        assert pack_of(art_a1) == pack_of(art_b1) and art_a1["identity"] != art_b1["identity"]
        assert res_a1["generation"]["generation"] == "000001"

        # A second n610 capture with retention 1 prunes the first: its capture, capsule and output descriptor
        # go; the payload stays (the new generation and the n580 one reference it).
        a2, art_a2, res_a2 = capture(wl, driver="n610", retention=1)
        assert [p["capture_id"] for p in res_a2["pruned"]] == [art_a1["capture_id"]]
        assert local_state(state_root, art_a1) == {"capture": False, "capsule": False, "pack": True}
        assert not a1.exists()
        assert [g.capture_id for g in store.generations(art_a2["identity"])] == [art_a2["capture_id"]]
        assert store.current(art_a2["identity"]).capture_id == art_a2["capture_id"]

        # delete n610: its descriptors and local artifacts go, the n580 generation still references the payload.
        res = delete(wl, a2, "n610")
        assert [i["snapshot_driver"] for i in res["identities"]] == ["n610"]
        assert pack_of(art_a2)["sha256"] in res["keep_payloads"]
        host = res["hosts"]["localhost"]
        assert host["changed"] and host["kept"]["payloads"][0]["sha256"] == pack_of(art_a2)["sha256"]
        assert local_state(state_root, art_a2) == {"capture": False, "capsule": False, "pack": True}
        assert not a2.exists() and store.current(art_a2["identity"]) is None
        assert local_state(state_root, art_b1) == {"capture": True, "capsule": True, "pack": True}
        assert payload_state(state_root, pack_of(art_b1)["sha256"], pack_of(art_b1)["size"])[0] == "verified"
        # The retained n580 generation still restores, natively.
        restored = ok(run(wl, wl.request("restore", artifact=store.current_artifact_path(art_b1["identity"]),
                                         mutate=lambda r: switch_driver(r, "n580"))))
        assert result_of(restored)["units"][0]["reply"] == art_b1["acceptance"]["reply"]
        wl.stop()

        # Convergent: deleting n610 again changes nothing anywhere.
        again = delete(wl, a2, "n610")
        assert again["identities"] == [] and not again["hosts"]["localhost"]["changed"]

        # Deleting n580 removes the now unreferenced capture-local payload too.
        last = delete(wl, b1, "n580")
        assert pack_of(art_b1)["sha256"] not in last["keep_payloads"]
        assert local_state(state_root, art_b1) == {"capture": False, "capsule": False, "pack": False}
        assert store.identities() == []
    finally:
        wl.stop()
