"""Target-local overlays: recorded bound to the exact target, selected only there, else the portable descriptor."""

from __future__ import annotations

import copy
import json
import os
import stat
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts import overlay
from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.store import ArtifactStore, file_sha256
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import IntegrityError
from lifecycle_helpers import host_facts, make_artifact, make_request, write_artifact


@pytest.fixture
def recorded(state_root, tmp_path):
    """A promoted portable descriptor of a 2-host GPU workload and an overlay recorded for its target."""
    req = make_request(hosts=("gpu-a", "gpu-b"), gpus=True)
    store = ArtifactStore(state_root)
    portable = write_artifact(tmp_path / "out" / "cap-1", make_artifact(req, capture_id="cap-1"))
    store.promote(portable, request=req)
    facts = {"gpu-a": host_facts(uuid="GPU-a"), "gpu-b": host_facts(uuid="GPU-b")}
    sha = file_sha256(portable)
    ov = make_artifact(req, capture_id="cap-1.overlay", capsule="target-local")
    ov["parent"] = sha
    binding = overlay.target_binding(req, facts, portable_sha256=sha)
    res = overlay.record_overlay(store, portable_path=portable, overlay_artifact=ov, binding=binding)
    assert res["stored"] and not res["discarded"]
    restore = make_request(hosts=("gpu-a", "gpu-b"), gpus=True, operation="restore", artifact=portable)
    return store, portable, restore, facts, Path(res["path"])


def _one_host_capture(state_root, tmp_path):
    """A promoted one-host portable capture, its overlay artifact and the overlay's target binding."""
    req = make_request(hosts=("gpu-a",), gpus=True)
    store = ArtifactStore(state_root)
    portable = write_artifact(tmp_path / "out" / "cap-1", make_artifact(req, capture_id="cap-1"))
    store.promote(portable, request=req)
    sha = file_sha256(portable)
    ov = make_artifact(req, capture_id="cap-1.overlay", capsule="target-local")
    ov["parent"] = sha
    binding = overlay.target_binding(req, {"gpu-a": host_facts(uuid="GPU-a")}, portable_sha256=sha)
    return store, portable, ov, binding


def test_recording_the_same_overlay_again_changes_nothing(state_root, tmp_path):
    store, portable, ov, binding = _one_host_capture(state_root, tmp_path)

    def record(art, **kw):
        return overlay.record_overlay(store, portable_path=portable, overlay_artifact=art, binding=binding, **kw)

    first = record(ov)
    odir = Path(first["path"])
    inode = odir.stat().st_ino
    for check_mode in (True, False):
        again = record(ov, check_mode=check_mode)
        assert not again["changed"] and again["stored"] and again["path"] == str(odir)
    assert odir.stat().st_ino == inode, "the stored overlay was not replaced"
    other = copy.deepcopy(ov)
    other["capture_id"] = "cap-1.overlay-2"
    assert record(other, check_mode=True)["changed"] and odir.stat().st_ino == inode
    assert record(other)["changed"] and odir.stat().st_ino != inode


def select(store, portable, req, facts):
    return overlay.select_overlay(store, portable_path=portable, request=req, facts_by_host=facts)


def test_selected_on_the_exact_matching_target(recorded):
    store, portable, req, facts, odir = recorded
    sel = select(store, portable, req, facts)
    assert sel["selected"] and sel["overlay"] == str(odir)
    assert sel["artifact"]["capture_id"] == "cap-1.overlay"
    assert sel["artifact"]["parent"] == sel["portable_sha256"] == file_sha256(portable)


@pytest.mark.parametrize("change, field", [
    (lambda req, facts: req["launch"]["units"].reverse() or
     [u.update(index=i) for i, u in enumerate(req["launch"]["units"])], "hosts"),
    (lambda req, facts: facts["gpu-b"].update(nvidia_driver="580.159.05"), "nvidia_drivers"),
    (lambda req, facts: facts["gpu-a"]["gpus"][0].update(model="NVIDIA H100"), "accelerators"),
    (lambda req, facts: facts["gpu-a"]["gpus"][0].update(uuid="GPU-other"), "accelerators"),
    (lambda req, facts: req["snapshot_driver"].update(id="n580"), "snapshot_driver"),
])
def test_any_difference_falls_back_to_the_portable_descriptor(recorded, change, field):
    store, portable, req, facts, _unused = recorded
    req, facts = copy.deepcopy(req), copy.deepcopy(facts)
    change(req, facts)
    sel = select(store, portable, req, facts)
    assert not sel["selected"] and sel["artifact"]["capture_id"] == "cap-1"
    assert any(f"{field}:" in r for r in sel["reasons"]), sel["reasons"]


def test_different_ordered_hosts_on_another_host_list(recorded):
    store, portable, req, facts, _unused = recorded
    other = copy.deepcopy(req)
    other["launch"]["units"][1]["host"] = "gpu-c"
    sel = select(store, portable, other, {**facts, "gpu-c": facts["gpu-b"]})
    assert not sel["selected"]
    assert any("gpu-c" in r for r in sel["reasons"])


@pytest.mark.parametrize("damage, needle", [
    (lambda d: (d / "overlay.json").unlink(), "metadata"),
    (lambda d: (d / "overlay.json").write_text("{not json"), "invalid"),
    (lambda d: (d / "artifact.json").unlink(), "stale overlay"),
    (lambda d: (d / "artifact.json").write_text((d / "artifact.json").read_text() + " "), "changed after"),
    (lambda d: _rewrite(d, lambda doc: doc["binding"].update(nvidia_drivers=["1", "2"])), "binding digest"),
])
def test_missing_stale_or_invalid_metadata_falls_back(recorded, damage, needle):
    store, portable, req, facts, odir = recorded
    damage(odir)
    sel = select(store, portable, req, facts)
    assert not sel["selected"] and sel["artifact"]["capture_id"] == "cap-1"
    assert any(needle in r for r in sel["reasons"]), sel["reasons"]


def _rewrite(odir: Path, fn) -> None:
    doc = json.loads((odir / "overlay.json").read_text())
    fn(doc)
    (odir / "overlay.json").write_text(json.dumps(doc))


def test_an_overlay_of_a_stale_portable_descriptor_is_not_used(recorded, tmp_path):
    store, portable, req, facts, _unused = recorded
    # The descriptor at the requested path is a newer capture: the recorded overlay belongs to the old one.
    newer = make_artifact(make_request(hosts=("gpu-a", "gpu-b"), gpus=True), capture_id="cap-2")
    portable.write_text(json.dumps(newer, indent=2, sort_keys=True) + "\n")
    sel = select(store, portable, req, facts)
    assert not sel["selected"] and sel["artifact"]["capture_id"] == "cap-2"


def test_missing_facts_fall_back(recorded):
    store, portable, req, facts, _unused = recorded
    sel = select(store, portable, req, {"gpu-a": facts["gpu-a"]})
    assert not sel["selected"] and "cannot be identified" in sel["reasons"][0]


def test_no_overlay_means_the_portable_descriptor(state_root, tmp_path):
    req = make_request()
    portable = write_artifact(tmp_path / "p", make_artifact(req, capture_id="cap-1"))
    sel = select(ArtifactStore(state_root), portable, req, {"localhost": host_facts()})
    assert not sel["selected"] and "no target-local overlay" in sel["reasons"][0]


def test_overlay_must_share_the_payload_objects(state_root, tmp_path):
    req = make_request()
    store = ArtifactStore(state_root)
    portable = write_artifact(tmp_path / "p", make_artifact(req, capture_id="cap-1"))
    ov = make_artifact(req, capture_id="cap-1.overlay", capsule="x", payload="different-bytes")
    ov["parent"] = file_sha256(portable)
    binding = overlay.target_binding(req, {"localhost": host_facts()}, portable_sha256=file_sha256(portable))
    with pytest.raises(IntegrityError, match="payload objects differ"):
        overlay.record_overlay(store, portable_path=portable, overlay_artifact=ov, binding=binding)


def test_an_identical_capture_is_discarded(state_root, tmp_path):
    req = make_request()
    store = ArtifactStore(state_root)
    art = make_artifact(req, capture_id="cap-1")
    portable = write_artifact(tmp_path / "p", art)
    same = {**copy.deepcopy(art), "capture_id": "cap-1.overlay", "parent": file_sha256(portable)}
    binding = overlay.target_binding(req, {"localhost": host_facts()}, portable_sha256=file_sha256(portable))
    res = overlay.record_overlay(store, portable_path=portable, overlay_artifact=same, binding=binding)
    assert res["discarded"] and not res["stored"] and res["refs"]["capture_id"] == "cap-1.overlay"
    assert not store.overlay_root(art["identity"], file_sha256(portable)).exists()


def test_overlays_go_with_their_pruned_generation_and_count_as_retained(recorded, tmp_path):
    store, _portable, _req, _facts, odir = recorded
    cap_req = make_request(hosts=("gpu-a", "gpu-b"), gpus=True, retention=1)
    assert make_artifact(cap_req, capture_id="z")["weights"]["workers"][0]["payload"]["sha256"] in \
        store.retained_payloads()
    newer = write_artifact(tmp_path / "out" / "cap-2", make_artifact(cap_req, capture_id="cap-2", payload="v2"))
    res = store.promote(newer, request=cap_req)
    assert not odir.exists()
    assert {r["capture_id"] for r in res.cleanup} == {"cap-1", "cap-1.overlay"}
    assert set(res.cleanup_hosts) == {"gpu-a", "gpu-b"}


def _overlays_lookup():
    from ansible_collections.coldsnap.fleet.plugins.lookup.overlays import LookupModule

    return LookupModule()


def test_overlays_lookup_lists_what_the_restore_playbook_selects_from(recorded, state_root, tmp_path):
    """restore.yml asks the lookup (no module run); it must see exactly the store's overlays."""
    from ansible.errors import AnsibleLookupError

    _store, portable, restore, _facts, odir = recorded
    lookup = _overlays_lookup()
    sha = file_sha256(portable)
    found = lookup.run([restore], state_root=str(state_root), portable_sha256=sha)
    assert [e["path"] for e in found] == [str(odir)] and found[0]["portable_sha256"] == sha
    # Another portable descriptor of the same identity has none; nor has another state root.
    assert lookup.run([restore], state_root=str(state_root), portable_sha256="sha256:" + "0" * 64) == []
    assert lookup.run([restore], state_root=str(tmp_path / "elsewhere"), portable_sha256=sha) == []
    # A malformed request is refused naming the field, as the module refuses it.
    broken = copy.deepcopy(restore)
    del broken["workload"]
    with pytest.raises(AnsibleLookupError, match="workload"):
        lookup.run([broken], state_root=str(state_root))
    with pytest.raises(AnsibleLookupError, match=r"unknown option.*portable_sha"):
        lookup.run([restore], state_root=str(state_root), portable="x")
    with pytest.raises(AnsibleLookupError, match="takes a request"):
        lookup.run([str(portable)], state_root=str(state_root))


def test_a_recorded_overlay_is_private_whatever_the_umask(state_root, tmp_path):
    store, portable, ov, binding = _one_host_capture(state_root, tmp_path)
    old = os.umask(0o022)
    try:
        res = overlay.record_overlay(store, portable_path=portable, overlay_artifact=ov, binding=binding)
    finally:
        os.umask(old)
    odir = Path(res["path"])
    for d in (odir.parent.parent, odir.parent, odir):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    files = list(odir.iterdir())
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files), files
