"""Host-side removal (delete, retention) and native-status, on real files in a real node cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.leftovers import remove_local
from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.refs import local_refs
from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.store import ArtifactStore
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.records import record_path_for
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.status import native_status
from lifecycle_helpers import make_artifact, make_request, put_pack, write_artifact


def fake_capture(state_root: Path, art: dict) -> None:
    """What capture leaves on the host: a capture dir whose evidence names the pack, and OCI capsule layouts."""
    for cap in art["capsule"]["units"]:
        unit_dir = state_root / "captures" / art["capture_id"] / "units" / cap["unit"]
        unit_dir.mkdir(parents=True)
        pack = next(w["payload"] for w in art["weights"]["workers"] if w["unit"] == cap["unit"])
        (unit_dir / "evidence.json").write_text(json.dumps(
            {"workers": [{"payload": {"pack": pack and {"sha256": pack["sha256"]}}}]}))
        Path(cap["location"]).mkdir(parents=True)
        (Path(cap["location"]) / "index.json").write_text("{}")
        extracted = state_root / "capsules" / "extracted" / cap["image_id"].split(":")[1]
        extracted.mkdir(parents=True)


def test_delete_keeps_a_payload_another_retained_generation_references(state_root, tmp_path):
    sha, size = put_pack(state_root, b"shared model bytes")
    store = ArtifactStore(state_root)
    n610, n580 = make_request(driver="n610"), make_request(driver="n580")
    a610 = make_artifact(n610, capture_id="cap-610", pack=(sha, size), state_root=state_root)
    a580 = make_artifact(n580, capture_id="cap-580", pack=(sha, size), state_root=state_root)
    for art, req in ((a610, n610), (a580, n580)):
        fake_capture(state_root, art)
        store.promote(write_artifact(tmp_path / art["capture_id"], art), request=req)
    deleted = store.delete(recipe="chat", snapshot_driver="n610")
    res = remove_local(state_root, deleted.cleanup, keep_payloads=deleted.keep_payloads, host="localhost")
    assert res["changed"]
    assert not (state_root / "captures" / "cap-610").exists()
    assert not Path(a610["capsule"]["units"][0]["location"]).exists()
    assert not (state_root / "capsules" / "extracted" / a610["capsule"]["units"][0]["image_id"][7:]).exists()
    # The pack is still referenced by the n580 generation: kept, with its record.
    pack = NodeCache(state_root).path_for(sha)
    assert pack.exists() and record_path_for(pack).exists()
    assert res["kept"]["payloads"][0]["sha256"] == sha
    assert (state_root / "captures" / "cap-580").exists() and Path(a580["capsule"]["units"][0]["location"]).exists()
    # Convergent: nothing left to remove.
    assert not remove_local(state_root, deleted.cleanup, keep_payloads=deleted.keep_payloads,
                            host="localhost")["changed"]
    # Deleting the n580 lineage too removes the then-unreferenced capture-local payload.
    last = store.delete(recipe="chat", snapshot_driver="n580")
    assert sha not in last.keep_payloads
    res = remove_local(state_root, last.cleanup, keep_payloads=last.keep_payloads, host="localhost")
    assert res["removed"]["payloads"][0]["sha256"] == sha and not pack.exists() and not record_path_for(pack).exists()


def test_a_capture_on_the_host_keeps_its_payload_even_unknown_to_the_store(state_root):
    sha, size = put_pack(state_root, b"bytes")
    art = make_artifact(make_request(), capture_id="dropped", pack=(sha, size), state_root=state_root)
    other = make_artifact(make_request(recipe="elsewhere"), capture_id="unrelated", pack=(sha, size),
                          state_root=state_root)
    fake_capture(state_root, art)
    fake_capture(state_root, other)
    res = remove_local(state_root, [local_refs(art)], keep_payloads=[], host="localhost")
    assert NodeCache(state_root).contains(sha) and "dropped" not in os.listdir(state_root / "captures")
    assert "still referenced" in res["kept"]["payloads"][0]["reason"]


def test_published_payloads_and_foreign_locations_are_never_removed(state_root, tmp_path):
    sha, size = put_pack(state_root, b"published bytes")
    art = make_artifact(make_request(), capture_id="pub", pack=(sha, size), state_root=tmp_path / "elsewhere",
                        published=True)
    fake_capture(state_root, art)
    refs = local_refs(art)
    plan = remove_local(state_root, [refs], keep_payloads=[], host="localhost", check_mode=True)
    assert plan["changed"] and (state_root / "captures" / "pub").exists(), "check mode removes nothing"
    res = remove_local(state_root, [refs], keep_payloads=[], host="localhost")
    assert NodeCache(state_root).contains(sha)
    assert "published" in res["kept"]["payloads"][0]["reason"]
    # The capsule layout lies outside the state root: reported, left alone.
    assert Path(art["capsule"]["units"][0]["location"]).exists()
    assert "not the digest-derived capsule path" in res["kept"]["capsules"][0]["reason"]


def native(state_root: Path, art: dict, req: dict, **kw) -> dict:
    return native_status(req, art, host="localhost", state_root=state_root, **kw)


def test_native_status_states(state_root):
    sha, size = put_pack(state_root, b"weights")
    req = make_request()
    art = make_artifact(req, capture_id="c", pack=(sha, size))
    pack = NodeCache(state_root).path_for(sha)
    assert native(state_root, art, req)["workers"][0]["state"] == "verified"
    # A touch changes mtime and ctime: the record no longer proves the file.
    os.utime(pack)
    st = native(state_root, art, req)
    assert st["workers"][0]["state"] == "stale" and "differ" in st["workers"][0]["reason"] and not st["changed"]
    record_path_for(pack).unlink()
    assert native(state_root, art, req)["workers"][0]["state"] == "present"
    # verify=True hashes it and writes a fresh record (a change); a second run converges.
    res = native(state_root, art, req, verify=True)
    assert res["workers"][0]["state"] == "verified" and res["changed"]
    again = native(state_root, art, req, verify=True)
    assert again["workers"][0]["state"] == "verified" and not again["changed"]
    os.chmod(pack, 0o644)
    pack.unlink()
    st = native(state_root, art, req)
    assert st["workers"][0]["state"] == "missing" and st["summary"] == {"missing": 1}
    none = make_artifact(req, capture_id="c", payload=None)
    assert native(state_root, none, req)["workers"][0]["state"] == "none"


def test_native_status_verify_finds_a_corrupt_pack(state_root):
    sha, size = put_pack(state_root, b"weights")
    req = make_request()
    art = make_artifact(req, capture_id="c", pack=(sha, size))
    pack = NodeCache(state_root).path_for(sha)
    os.chmod(pack, 0o644)
    with open(pack, "r+b") as fh:
        fh.write(b"X")
    res = native(state_root, art, req, verify=True)
    assert res["workers"][0]["state"] == "corrupt" and not pack.exists()
    assert NodeCache(state_root).quarantined()


def test_native_status_reports_only_this_hosts_workers(state_root):
    req = make_request(hosts=("localhost", "gpu-b"))
    art = make_artifact(req, capture_id="c")
    res = native(state_root, art, req)
    assert [w["worker"] for w in res["workers"]] == ["worker-0"]


def test_native_status_check_mode_reports_only_the_record_a_real_run_would_write(state_root):
    sha, size = put_pack(state_root, b"weights")
    req = make_request()
    art = make_artifact(req, capture_id="c", pack=(sha, size))
    pack = NodeCache(state_root).path_for(sha)
    # put_pack left a valid record: a real verify reuses it, so check mode changes nothing either
    assert native(state_root, art, req, verify=True, check_mode=True)["changed"] is False
    record_path_for(pack).unlink()
    dry = native(state_root, art, req, verify=True, check_mode=True)
    assert dry["changed"] is True and not record_path_for(pack).exists()
    assert native(state_root, art, req, verify=True)["changed"] is True and record_path_for(pack).exists()


def test_native_status_verify_of_an_intact_pack_with_another_size_changes_nothing(state_root):
    """An artifact that gives an intact pack another size: the verifier leaves the pack (and its record) in
    the cache, so neither a real run nor check mode may report a change, run after run."""
    sha, size = put_pack(state_root, b"weights")
    req = make_request()
    art = make_artifact(req, capture_id="c", pack=(sha, size + 1))
    pack = NodeCache(state_root).path_for(sha)
    for check_mode in (True, False, False):
        res = native(state_root, art, req, verify=True, check_mode=check_mode)
        assert res["workers"][0]["state"] == "corrupt" and "the pack is intact" in res["workers"][0]["reason"]
        assert res["changed"] is False
    assert pack.exists() and record_path_for(pack).exists() and not NodeCache(state_root).quarantined()
