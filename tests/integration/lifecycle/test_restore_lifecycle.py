"""Artifact lifecycle around restore, with real CRIU: logs, warm restore + wake, materialization
(required / async / off) and native-status, target-local overlays on a matching and a non-matching target.

One capture is shared by every test of this module (they run in file order)."""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.store import ArtifactStore
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import load_artifact
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.receipt import validate_receipt
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.records import record_path_for
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import activation_stage
from lifecycle_workload import (
    Workload,
    boundary,
    log_lines,
    ok,
    pack_of,
    result_of,
    run,
    units_of,
    wait_payload,
)
from netports import another_free_port

pytestmark = [pytest.mark.criu, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def captured(state_root, tiny_model, env_digest):
    wl = Workload(state_root, tiny_model, env_digest, tp=1, name="life")
    receipt = ok(wl.run(wl.request("capture")))
    artifact = Path(result_of(receipt)["artifact"])
    yield wl, artifact, load_artifact(artifact.read_bytes()), receipt
    wl.stop()


def restore_req(wl: Workload, artifact: Path, *, operation: str = "restore", mode: str = "auto",
                materialize: str | None = None) -> dict:
    def mutate(req):
        req["policy"]["weights"]["mode"] = mode
        if materialize is not None:
            req["policy"]["weights"]["native"]["materialize"] = materialize

    return wl.request(operation, artifact=artifact, mutate=mutate)


def drop_pack(state_root: Path, art: dict) -> Path:
    """Make this host look like a target without the payload (a fresh node cache entry)."""
    path = NodeCache(state_root).path_for(pack_of(art)["sha256"])
    for f in (record_path_for(path), path):
        if f.exists():
            os.chmod(f, 0o600)
            f.unlink()
    return path


def native_status(wl: Workload, artifact: Path) -> dict:
    receipt = ok(run(wl, wl.request("native-status", artifact=artifact)))
    validate_receipt(receipt)
    assert receipt["replay_semantics"] == "convergent"
    return result_of(receipt)


def test_capture_promotes_keeps_capture_log_and_starts_the_workload_log_empty(captured, state_root):
    wl, artifact, art, receipt = captured
    res = result_of(receipt)
    store = ArtifactStore(state_root)
    cur = store.current(art["identity"])
    assert cur is not None and cur.capture_id == art["capture_id"] and res["generation"]["generation"] == "000001"
    assert Path(res["current"]).read_bytes() == artifact.read_bytes()
    # The captured process's stdout/stderr are kept as capture.log inside the capsule ...
    layout = Path(art["capsule"]["units"][0]["location"])
    index = json.loads((layout / "index.json").read_text())
    manifest = json.loads((layout / "blobs" / "sha256" / index["manifests"][0]["digest"][7:]).read_bytes())
    layer = layout / "blobs" / "sha256" / manifest["layers"][0]["digest"][7:]
    with tarfile.open(layer) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("unit-0/logs/capture.log"))
        text = tar.extractfile(member).read().decode()
    assert text.strip(), "capture.log must hold the engine's start-up output"
    # ... and the workload log starts empty for the next activation.
    assert (state_root / "workloads" / wl.name / "unit-0" / "target.log").stat().st_size == 0


def test_warm_restore_then_wake_finishes_it(captured):
    wl, artifact, art, _unused = captured
    warm = ok(run(wl, restore_req(wl, artifact, operation="warm")))
    validate_receipt(warm)
    assert warm["operation"] == "warm" and warm["replay_semantics"] == "reconcile-replace"
    res = result_of(warm)
    assert res["warm"] is True and "weight hydration" in res["pending"]
    unit0 = units_of(warm)[0]
    assert unit0["warm"] is True and unit0["reply"] is None, "a warm restore does not validate yet"
    marker = boundary(wl)
    assert marker["warm"] is True
    status = ok(run(wl, wl.request("status", artifact=artifact)))
    assert result_of(status)["units"][0]["state"] == "warm"
    ran = [t["task"] for t in status["result"]["tasks"] if t["status"] != "skipped"]
    assert "Gather ColdSnap host facts" not in ran and "Stage the activation runtime where it is missing" not in ran, \
        f"a staged runtime is not looked at again: {ran}"
    # A host that lost its staged activation runtime (or has not got a new collection version's yet):
    # status answers without it and stages nothing; the wake that needs it stages it first, in one task.
    digest = activation_stage.tree_digest(REPO / "runtime_image" / "activation")
    staged = activation_stage.staged_path(wl.state_root, digest)
    shutil.rmtree(staged)
    status = ok(run(wl, wl.request("status", artifact=artifact)))
    assert result_of(status)["units"][0]["state"] == "warm"
    ran = [t["task"] for t in status["result"]["tasks"] if t["status"] != "skipped"]
    assert "Stage the activation runtime where it is missing" not in ran and not staged.exists(), ran
    woken = ok(run(wl, wl.request("wake", artifact=artifact)))
    ran = [t["task"] for t in woken["result"]["tasks"] if t["status"] != "skipped"]
    assert "Stage the activation runtime where it is missing" in ran, ran
    assert activation_stage.require_staged(wl.state_root, digest) == staged
    assert woken["replay_semantics"] == "convergent"
    assert result_of(woken)["units"][0]["reply"] == art["acceptance"]["reply"]
    assert wl.complete() == art["acceptance"]["reply"]
    # Waking again converges: nothing changes.
    again = ok(run(wl, wl.request("wake", artifact=artifact)))
    assert result_of(again)["units"][0]["state"] == "ready" and not result_of(again)["units"][0]["changed"]


def test_materialize_required_then_the_next_restore_takes_native(captured, state_root):
    wl, artifact, art, _unused = captured
    pack = drop_pack(state_root, art)
    assert native_status(wl, artifact)["workers"][0]["state"] == "missing"
    first = ok(run(wl, restore_req(wl, artifact, materialize="required")))
    assert boundary(wl)["provider"] == "recovery"
    assert units_of(first)[0]["reply"] == art["acceptance"]["reply"]
    # required: the pack is written (and verified) before the restore reports success.
    assert pack.exists()
    st = native_status(wl, artifact)
    assert st["workers"][0]["state"] == "verified" and st["native_ready"] is True
    assert st["workers"][0]["host"] == "localhost"
    ok(run(wl, restore_req(wl, artifact)))
    assert boundary(wl)["provider"] == "native"


def test_materialize_async_fills_the_cache_in_the_background(captured, state_root):
    wl, artifact, art, _unused = captured
    pack = drop_pack(state_root, art)
    ok(run(wl, restore_req(wl, artifact, materialize="async")))
    assert boundary(wl)["provider"] == "recovery"
    assert wait_payload(state_root, pack_of(art)) == "verified"
    assert pack.exists()
    ok(run(wl, restore_req(wl, artifact)))
    assert boundary(wl)["provider"] == "native"


def test_materialize_off_writes_nothing_and_native_status_sees_it(captured, state_root):
    wl, artifact, art, _unused = captured
    pack = drop_pack(state_root, art)
    ok(run(wl, restore_req(wl, artifact, materialize="off")))
    assert boundary(wl)["provider"] == "recovery"
    assert wl.complete() == art["acceptance"]["reply"]
    assert not pack.exists()
    assert native_status(wl, artifact)["workers"][0]["state"] == "missing"
    # Put it back (a required materialization), then a touch makes its record stale.
    ok(run(wl, restore_req(wl, artifact, materialize="required")))
    os.utime(pack)
    st = native_status(wl, artifact)["workers"][0]
    assert st["state"] == "stale" and "differ" in st["reason"]


def test_overlay_captured_once_selected_on_its_target_and_not_elsewhere(captured, state_root):
    wl, artifact, art, _unused = captured
    accepted = art["acceptance"]["reply"]
    # Restore, materialize, and capture the running workload in place as the target-local overlay.
    rec = ok(run(wl, restore_req(wl, artifact, materialize="required"),
                 extravars={"coldsnap_capture_overlay": True}))
    res = result_of(rec)
    assert res["overlay"]["selected"] is False
    assert res["overlay_capture"]["stored"] is True, res["overlay_capture"]
    overlay_dir = Path(res["overlay_capture"]["path"])
    assert (overlay_dir / "overlay.json").exists()
    # The workload kept serving through the in-place capture; its log restarts at the boundary.
    assert wl.complete() == accepted and len(wl.engines()) == 1
    assert boundary(wl)["provider"] == "native"
    # The overlay shares the payload object and has its own capture and capsule.
    ov = load_artifact((overlay_dir / "artifact.json").read_bytes())
    assert pack_of(ov) == pack_of(art) and ov["capture_id"] != art["capture_id"]
    assert ov["capsule"]["units"][0]["image_id"] != art["capsule"]["units"][0]["image_id"]
    assert (state_root / "captures" / ov["capture_id"] / "units" / "unit-0" / "logs" / "capture.log").exists()
    # The engine's control token in the dumped memory (and the capsule) was retired right after the dump.
    (control,) = (state_root / "workloads" / wl.name / "unit-0").glob("control-*.json")
    live = json.loads(control.read_text())["token"]
    pages = b"".join(p.read_bytes() for p in (state_root / "captures" / ov["capture_id"]).rglob("pages-*.img"))
    assert pages and live.encode() not in pages
    # One-time: asking again on the same target captures nothing new.
    again = ok(run(wl, restore_req(wl, artifact), extravars={"coldsnap_capture_overlay": True}))
    assert result_of(again)["overlay"]["selected"] is True
    skipped = result_of(again)["overlay_capture"]
    assert skipped["stored"] is False and "already exists" in skipped["reason"]

    # An ordinary restore on the matching target takes the overlay.
    matching = ok(run(wl, restore_req(wl, artifact)))
    sel = result_of(matching)["overlay"]
    assert sel["selected"] is True and sel["overlay"] == str(overlay_dir)
    assert result_of(matching)["capture_id"] == ov["capture_id"]
    assert units_of(matching)[0]["reply"] == accepted and boundary(wl)["provider"] == "native"

    # Another ordered host list (an inventory alias of this machine) is another target: portable artifact.
    def elsewhere(req):
        req["launch"]["units"][0]["host"] = "node-b"

    other = ok(run(wl, wl.request("restore", artifact=artifact, mutate=elsewhere), hosts=("node-b",)))
    sel = result_of(other)["overlay"]
    assert sel["selected"] is False and any("hosts" in r and "node-b" in r for r in sel["reasons"]), sel
    assert result_of(other)["capture_id"] == art["capture_id"]
    assert units_of(other)[0]["reply"] == accepted

    # Stale overlay metadata falls back too.
    meta = json.loads((overlay_dir / "overlay.json").read_text())
    meta["artifact"]["sha256"] = "sha256:" + "0" * 64
    (overlay_dir / "overlay.json").write_text(json.dumps(meta))
    stale = ok(run(wl, restore_req(wl, artifact)))
    assert result_of(stale)["overlay"]["selected"] is False
    assert result_of(stale)["capture_id"] == art["capture_id"]
    assert log_lines(wl)[0].startswith("{")


def test_a_failed_overlay_capture_gives_the_running_engine_back(captured, state_root, tmp_path):
    """CRIU's dump fails after the in-place capture released the engine's weights: the engine is
    resumed (hydrated again from the pack) and serves, and no overlay is stored for that target."""
    wl, artifact, art, _unused = captured
    accepted = art["acceptance"]["reply"]
    real = shutil.which("criu") or "/usr/local/sbin/criu"
    wrapper = tmp_path / "criu-that-cannot-dump"
    wrapper.write_text(f'#!/bin/sh\nif [ "$1" = dump ]; then echo "dump refused for this test" >&2; exit 1; fi\n'
                       f'exec {real} "$@"\n')
    wrapper.chmod(0o755)

    def on_node_c(req):  # a target with no overlay yet (node-c is this machine under another name)
        req["launch"]["units"][0]["host"] = "node-c"
        req["policy"]["weights"]["native"]["materialize"] = "required"

    res = run(wl, wl.request("restore", artifact=artifact, mutate=on_node_c), hosts=("node-c",),
              extravars={"coldsnap_capture_overlay": True}, envvars={"COLDSNAP_CRIU": str(wrapper)})
    assert not res.succeeded
    message = json.dumps(res.receipt["error"])
    assert "the engine was given back and serves again" in message, message
    assert wl.complete() == accepted and len(wl.engines()) == 1
    overlays = ArtifactStore(state_root).identity_dir(art["identity"]) / "overlays"
    stored = list(overlays.rglob("overlay.json")) if overlays.exists() else []
    assert all(json.loads(p.read_text())["binding"]["hosts"] != ["node-c"] for p in stored), stored


def test_a_warm_workload_cannot_sleep_and_a_crashed_one_is_stopped_as_a_change(captured):
    """Sleep of a warm restore (nothing serves yet) is refused naming the state, in check mode too; a stop
    of a crashed workload (engine killed, control file left) turns it stopped, which is a change."""
    wl, artifact, _art, _unused = captured
    ok(run(wl, restore_req(wl, artifact, operation="warm")))
    slept = run(wl, wl.request("sleep", artifact=artifact))
    assert not slept.succeeded and "is warm" in json.dumps(slept.receipt["error"]), slept.receipt["error"]
    assert result_of(ok(run(wl, wl.request("status", artifact=artifact))))["units"][0]["state"] == "warm"
    wl.stop()  # SIGKILL: the engine is gone, its control file stays
    assert result_of(ok(run(wl, wl.request("status", artifact=artifact))))["units"][0]["state"] == "crashed"
    first = result_of(ok(run(wl, wl.request("stop", artifact=artifact))))["units"][0]
    assert first["state"] == "stopped" and first["was_crashed"] is True
    again = result_of(ok(run(wl, wl.request("stop", artifact=artifact))))["units"][0]
    assert again["was_crashed"] is False and again["stopped"] is None
    assert result_of(ok(run(wl, wl.request("status", artifact=artifact))))["units"][0]["state"] == "stopped"


def test_status_and_stop_outlive_a_deleted_artifact(captured, tmp_path):
    """``coldsnap delete`` keeps the workload running: its status and stop requests still work (without the
    artifact, said in the receipt), where a restore is refused by field."""
    from coldsnap import api

    wl, artifact, art, _unused = captured
    ok(run(wl, restore_req(wl, artifact)))
    copy = tmp_path / "artifact.json"
    shutil.copy(artifact, copy)
    status_req = wl.request("status", artifact=copy)
    stop_req = wl.request("stop", artifact=copy)
    copy.unlink()
    status = api.run("status", status_req, state_root=wl.state_root, progress=False)
    assert status.state == "succeeded", status.raw["error"]
    assert status.raw["result"]["artifact_gone"] == str(copy)
    assert status.raw["result"]["operation"]["units"][0]["state"] == "ready"
    assert wl.complete() == art["acceptance"]["reply"]
    stopped = api.run("stop", stop_req, state_root=wl.state_root, progress=False)
    assert stopped.state == "succeeded" and not wl.engines(), stopped.raw["error"]
    with pytest.raises(Exception, match=r"\$\.artifact\.path"):
        api.run("restore", wl.request("restore", artifact=copy), state_root=wl.state_root, progress=False)


def test_a_wake_naming_another_port_than_the_engine_serves_on_is_refused_at_once(captured):
    """After a restore onto another port, a wake request that still names the old one is refused naming
    both ports (it used to wait for readiness on the old port until the ready timeout)."""
    wl, artifact, art, _unused = captured
    other = another_free_port(wl.port)

    def moved(req):
        req["launch"]["execution"]["services"][0]["port"] = other
        cmd = req["launch"]["units"][0]["command"]
        cmd[cmd.index("--port") + 1] = str(other)

    ok(run(wl, wl.request("restore", artifact=artifact, mutate=moved)))
    ok(run(wl, wl.request("sleep", artifact=artifact, mutate=moved)))
    stale = run(wl, wl.request("wake", artifact=artifact))
    message = json.dumps(stale.receipt["error"])
    assert not stale.succeeded and f"does not listen on port {wl.port}" in message and str(other) in message, message
    woken = ok(run(wl, wl.request("wake", artifact=artifact, mutate=moved)))
    assert result_of(woken)["units"][0]["state"] == "ready"
    assert wl.complete(port=other) == art["acceptance"]["reply"]
    wl.stop()
