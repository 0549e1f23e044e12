"""CPU hydration by mapping the pack, through the real path with CRIU: a native restore maps the
weights, sleep gives anonymous memory back and wake maps again, an in-place capture of the mapped
engine leaves no trace of the pack in its CRIU images, and every reply is the captured one."""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import load_artifact
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from lifecycle_workload import Workload, ok, pack_of, result_of, run, units_of

pytestmark = [pytest.mark.criu, pytest.mark.slow]


def fill_attrs(receipt: dict, span: str) -> list[dict]:
    return [s["attrs"] for s in receipt["timing"]["spans"] if s["name"] == span and "fill" in s.get("attrs", {})]


def assert_mapped(receipt: dict, span: str) -> None:
    attrs = fill_attrs(receipt, span)
    assert attrs, f"no {span} span with hydration stats in the receipt"
    for a in attrs:
        assert a["fill"] in ("map", "map+python"), a
        assert 0 < a["mapped_bytes"] <= a["model_bytes"], a


def pack_mappings(pid: int, pack: Path) -> list[str]:
    with open(f"/proc/{pid}/maps", encoding="utf-8") as fh:
        return [line for line in fh if line.rstrip().endswith(pack.name)]


def images_mention(directory: Path, needle: bytes) -> list[Path]:
    """CRIU images (not the memory pages, which may hold the path as a string) that name ``needle``:
    files.img names every mapped or open file of the process tree."""
    return [p for p in directory.rglob("*.img") if not p.name.startswith("pages-") and needle in p.read_bytes()]


@pytest.fixture(scope="module")
def captured(state_root, tiny_model, env_digest):
    wl = Workload(state_root, tiny_model, env_digest, tp=1, name="cpumap")
    receipt = ok(wl.run(wl.request("capture")))
    artifact = Path(result_of(receipt)["artifact"])
    yield wl, artifact, load_artifact(artifact.read_bytes())
    wl.stop()


def native(wl: Workload, artifact: Path) -> dict:
    def mutate(req):
        req["policy"]["weights"]["mode"] = "native"

    return wl.request("restore", artifact=artifact, mutate=mutate)


def test_restore_maps_sleep_releases_wake_maps_again(captured, state_root):
    wl, artifact, art = captured
    accepted = art["acceptance"]["reply"]
    pack = NodeCache(state_root).path_for(pack_of(art)["sha256"])
    before = pack.stat()

    restored = ok(run(wl, native(wl, artifact)))
    assert units_of(restored)[0]["reply"] == accepted
    assert_mapped(restored, "engine.hydrate")
    assert wl.complete() == accepted
    [pid] = wl.engines()
    assert pack_mappings(pid, pack), "the restored engine maps the pack"
    assert NodeCache.pack_in_use(pack)

    slept = ok(run(wl, wl.request("sleep", artifact=artifact)))
    assert result_of(slept)["units"][0]["workers"][0]["state"] == "sleeping"
    assert wl.engines() == [pid] and pack_mappings(pid, pack) == []
    assert not NodeCache.pack_in_use(pack)

    woke = ok(run(wl, wl.request("wake", artifact=artifact)))
    assert result_of(woke)["units"][0]["reply"] == accepted
    assert_mapped(woke, "engine.wake")
    assert wl.complete() == accepted and pack_mappings(pid, pack)
    after = pack.stat()  # the engine wrote into its weights (copy-on-write): the pack is untouched
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)


def test_in_place_capture_of_a_mapped_engine_then_restore_of_it(captured, state_root):
    wl, artifact, art = captured
    accepted = art["acceptance"]["reply"]
    pack = NodeCache(state_root).path_for(pack_of(art)["sha256"])
    rec = ok(run(wl, native(wl, artifact), extravars={"coldsnap_capture_overlay": True}))
    assert_mapped(rec, "engine.hydrate")
    res = result_of(rec)
    assert res["overlay_capture"]["stored"] is True, res["overlay_capture"]
    ov = load_artifact((Path(res["overlay_capture"]["path"]) / "artifact.json").read_bytes())
    assert pack_of(ov) == pack_of(art)
    # the engine was released (anonymous memory, lease dropped) before CRIU dumped it: the images
    # hold neither a mapping nor a descriptor of the pack
    images = state_root / "captures" / ov["capture_id"] / "units" / "unit-0"
    assert any(images.rglob("files.img"))
    assert images_mention(images, pack.name.encode()) == []
    assert images_mention(images, b"model-payloads/sha256/") == []
    # it resumed in place (mapped again) and serves the captured reply
    [pid] = wl.engines()
    assert pack_mappings(pid, pack) and wl.complete() == accepted

    # an ordinary restore now takes the overlay: restored from the image of the once-mapped engine
    again = ok(run(wl, native(wl, artifact)))
    assert result_of(again)["overlay"]["selected"] is True
    assert units_of(again)[0]["reply"] == accepted
    assert_mapped(again, "engine.hydrate")
    assert wl.complete() == accepted
