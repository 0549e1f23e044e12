"""The descriptor store: identity keying, atomic promotion (also under kill -9), retention, delete scope."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.store import ArtifactStore, file_sha256
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import load_artifact
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import identity
from lifecycle_helpers import make_artifact, make_request, write_artifact


def capture(tmp: Path, req: dict, n: int, **kw) -> Path:
    """Commit a descriptor the way capture does (output dir per capture)."""
    return write_artifact(tmp / "out" / f"cap-{n}", make_artifact(req, capture_id=f"cap-{n}", **kw))


def test_promote_keys_by_identity_and_points_current(state_root, tmp_path):
    req = make_request()
    store = ArtifactStore(state_root)
    path = capture(tmp_path, req, 1)
    res = store.promote(path, request=req)
    assert res.changed and res.created
    ident = identity(req).split(":")[1]
    assert res.generation["path"] == str(state_root / "artifacts" / ident / "000001" / "artifact.json")
    # The current link names the generation and resolves to byte-identical content.
    link = state_root / "artifacts" / ident / "current"
    assert os.readlink(link) == "000001"
    assert (link / "artifact.json").read_bytes() == path.read_bytes()
    assert store.current(ident).capture_id == "cap-1"
    assert store.info(ident).recipe == "chat" and store.info(ident).snapshot_driver == "n610"
    # Promoting the current descriptor again changes nothing (idempotent).
    again = store.promote(path, request=req)
    assert not again.changed and not again.created and again.generation["generation"] == "000001"


def test_a_different_driver_is_a_different_identity(state_root, tmp_path):
    store = ArtifactStore(state_root)
    a, b = make_request(driver="n610"), make_request(driver="n580")
    store.promote(capture(tmp_path, a, 1), request=a)
    store.promote(capture(tmp_path, b, 2), request=b)
    assert {i.snapshot_driver for i in store.identities()} == {"n580", "n610"}
    assert identity(a) != identity(b)


def test_promote_refuses_a_descriptor_of_another_identity(state_root, tmp_path):
    a, b = make_request(recipe="chat"), make_request(recipe="other")
    path = capture(tmp_path, a, 1)
    with pytest.raises(ColdSnapError, match="belongs to identity"):
        ArtifactStore(state_root).promote(path, request=b)
    assert not (state_root / "artifacts").exists() or not any((state_root / "artifacts").iterdir())


def test_retention_keeps_the_last_n_and_never_the_current_one(state_root, tmp_path):
    req = make_request(retention=2)
    store = ArtifactStore(state_root)
    paths = [capture(tmp_path, req, n) for n in (1, 2, 3)]
    store.promote(paths[0], request=req)
    store.promote(paths[1], request=req)
    res = store.promote(paths[2], request=req)
    ident = identity(req)
    assert [g.capture_id for g in store.generations(ident)] == ["cap-2", "cap-3"]
    assert [p["generation"]["capture_id"] for p in res.pruned] == ["cap-1"]
    # What the pruned generation referenced goes to the hosts' cleanup; its committed output went too.
    assert res.cleanup[0]["capture_id"] == "cap-1" and res.cleanup_hosts == ["localhost"]
    assert not paths[0].exists() and paths[1].exists()
    # The payload is shared by the retained generations: it stays referenced.
    assert res.keep_payloads == [make_artifact(req, capture_id="x")["weights"]["workers"][0]["payload"]["sha256"]]
    # A rollback to an older generation makes it current; retention then keeps it even when it is the oldest.
    back = store.promote(store.generations(ident)[0].artifact_path, request=req)
    assert back.changed and not back.created and store.current(ident).capture_id == "cap-2"
    store.promote(capture(tmp_path, req, 4), request=req, retention=1)
    kept = [g.capture_id for g in store.generations(ident)]
    assert "cap-4" in kept and len(kept) == 1
    # Retention 1 dropped the rolled-back current only after cap-4 became current.
    assert store.current(ident).capture_id == "cap-4"


def test_check_mode_changes_nothing(state_root, tmp_path):
    req = make_request(retention=1)
    store = ArtifactStore(state_root)
    store.promote(capture(tmp_path, req, 1), request=req)
    before = sorted(str(p) for p in (state_root / "artifacts").rglob("*"))
    res = store.promote(capture(tmp_path, req, 2), request=req, check_mode=True)
    assert res.changed and res.generation["generation"] == "000002"
    assert [p["generation"]["capture_id"] for p in res.pruned] == ["cap-1"]
    assert sorted(str(p) for p in (state_root / "artifacts").rglob("*")) == before


@pytest.mark.parametrize("rollback", [False, True])
def test_check_mode_reports_what_the_real_promotion_returns(state_root, tmp_path, rollback):
    """Check mode names the same cleanup (capsules, payloads, hosts) and kept digests as the real run."""
    req = make_request(retention=2)
    store = ArtifactStore(state_root)
    paths = [capture(tmp_path, req, n, capsule=f"img-{n}") for n in (1, 2, 3)]
    for path in paths[:2]:
        store.promote(path, request=req)
    if rollback:  # cap-1 made current again, then cap-3 promoted: cap-1 stays (current), cap-2 goes
        store.promote(store.generations(identity(req))[0].artifact_path, request=req)
    before = sorted(str(p) for p in (state_root / "artifacts").rglob("*"))
    planned = store.promote(paths[2], request=req, check_mode=True).as_dict()
    assert sorted(str(p) for p in (state_root / "artifacts").rglob("*")) == before
    done = store.promote(paths[2], request=req).as_dict()
    assert done["cleanup"] and done["cleanup_hosts"] == ["localhost"] and done["keep_payloads"]
    for key in ("changed", "created", "cleanup", "cleanup_hosts", "keep_payloads", "keep_capsules"):
        assert planned[key] == done[key], key
    assert [p["generation"] for p in planned["pruned"]] == [p["generation"] for p in done["pruned"]]
    assert [p["refs"] for p in planned["pruned"]] == [p["refs"] for p in done["pruned"]]
    assert planned["generation"]["number"] == done["generation"]["number"]


def test_a_lost_identity_file_is_written_again_and_reported(state_root, tmp_path):
    req = make_request()
    store = ArtifactStore(state_root)
    path = capture(tmp_path, req, 1)
    store.promote(path, request=req)
    ident_file = state_root / "artifacts" / identity(req).split(":")[1] / "identity.json"
    ident_file.unlink()
    assert store.promote(path, request=req, check_mode=True).changed and not ident_file.exists()
    assert store.promote(path, request=req).changed and ident_file.is_file()
    assert not store.promote(path, request=req).changed


CHILD = textwrap.dedent("""
    import json, os, sys, time
    import coldsnap  # noqa: F401  # pylint: disable=unused-import
    from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.store import ArtifactStore
    state_root, artifact, request, stop_at, ready = sys.argv[1:6]
    def hook(step):
        if step == stop_at:
            open(ready, "w").write(step)
            time.sleep(3600)  # killed here with SIGKILL
    ArtifactStore(state_root).promote(artifact, request=json.load(open(request)), hook=hook)
""")


@pytest.mark.parametrize("stop_at", ["generation-written", "pointer-written"])
def test_promotion_killed_by_sigkill_never_leaves_a_broken_current(state_root, tmp_path, stop_at):
    req = make_request()
    store = ArtifactStore(state_root)
    first, second = capture(tmp_path, req, 1), capture(tmp_path, req, 2)
    store.promote(first, request=req)
    (tmp_path / "req.json").write_text(json.dumps(req))
    ready = tmp_path / "ready"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(state_root), str(second), str(tmp_path / "req.json"),
                              stop_at, str(ready)])
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert child.poll() is None, "the promoting child died early"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    ident = identity(req)
    cur = store.current(ident)
    # The pointer names a complete generation whose descriptor validates: the old one or the new one.
    expected = "cap-1" if stop_at == "generation-written" else "cap-2"
    assert cur is not None and cur.capture_id == expected
    load_artifact((state_root / "artifacts" / ident.split(":")[1] / "current" / "artifact.json").read_bytes())
    # The next promotion finishes the job and leaves no temporaries behind.
    res = store.promote(second, request=req)
    assert store.current(ident).capture_id == "cap-2"
    assert res.generation["generation"] == "000002"
    idir = state_root / "artifacts" / ident.split(":")[1]
    assert not [p.name for p in idir.iterdir() if ".tmp-" in p.name]


def test_debris_of_killed_writers_is_never_a_generation(state_root, tmp_path):
    req = make_request()
    store = ArtifactStore(state_root)
    store.promote(capture(tmp_path, req, 1), request=req)
    idir = state_root / "artifacts" / identity(req).split(":")[1]
    # What a kill in the middle of a write leaves: a temp generation dir, a temp link.
    (idir / ".000002.tmp-abc").mkdir()
    (idir / ".000002.tmp-abc" / "artifact.json").write_text("{")
    os.symlink("000009", idir / ".current.tmp-def")
    # A generation under its final name that does not read (a damaged disk, not a kill: a complete directory is
    # renamed there): never a generation, never removed as debris, and its number is not used again.
    (idir / "000007").mkdir()
    assert [g.number for g in store.generations(identity(req))] == [1]
    res = store.promote(capture(tmp_path, req, 2), request=req)
    # The next writer (holding the identity lock) removes the debris before it numbers the new generation.
    assert res.generation["generation"] == "000008"
    assert sorted(p.name for p in idir.iterdir() if p.name != ".lock") == [
        "000001", "000007", "000008", "current", "identity.json"]


def test_delete_scopes_to_recipe_and_driver_and_reports_shared_payloads(state_root, tmp_path):
    store = ArtifactStore(state_root)
    a = make_request(recipe="chat", driver="n610")
    b = make_request(recipe="chat", driver="n580")
    c = make_request(recipe="other", driver="n610")
    pa, pb, pc = capture(tmp_path, a, 1), capture(tmp_path, b, 2), capture(tmp_path, c, 3, payload="other-model")
    for p, r in ((pa, a), (pb, b), (pc, c)):
        store.promote(p, request=r)
    plan = store.delete(recipe="chat", snapshot_driver="n610", check_mode=True)
    assert plan.changed and len(store.identities()) == 3
    res = store.delete(recipe="chat", snapshot_driver="n610")
    assert [i["snapshot_driver"] for i in res.identities] == ["n610"]
    assert {i.snapshot_driver for i in store.identities() if i.recipe == "chat"} == {"n580"}
    # The n580 generation still references the same model payload: it is reported as kept.
    shared = make_artifact(a, capture_id="x")["weights"]["workers"][0]["payload"]["sha256"]
    assert shared in res.keep_payloads
    assert res.cleanup[0]["capture_id"] == "cap-1" and res.sources == [str(pa)] and not pa.exists()
    assert pb.exists() and pc.exists()
    again = store.delete(recipe="chat", snapshot_driver="n610")
    assert not again.changed and again.removed == []


def test_store_ignores_foreign_directories(state_root, tmp_path):
    (state_root / "artifacts" / "some-op-id").mkdir(parents=True)
    write_artifact(state_root / "artifacts" / "some-op-id", make_artifact(make_request(), capture_id="c"))
    assert ArtifactStore(state_root).identities() == []


def test_source_descriptor_that_changed_is_left_alone(state_root, tmp_path):
    req = make_request(retention=1)
    store = ArtifactStore(state_root)
    first = capture(tmp_path, req, 1)
    store.promote(first, request=req)
    first.write_text(first.read_text().replace('"cap-1"', '"cap-1"') + "\n")  # edited after promotion
    store.promote(capture(tmp_path, req, 2), request=req)
    assert first.exists(), "an output descriptor that differs from the stored one is not ours to remove"
    assert file_sha256(first) != store.generations(identity(req))[0].artifact_sha256


def test_a_promotion_waiting_behind_a_delete_is_never_erased_by_it(state_root, tmp_path, monkeypatch):
    """The delete moves the identity away while it holds the lock; a promotion that waited for that lock
    starts on a fresh directory, and what it reported stays."""
    import threading

    from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts import store as store_mod

    req = make_request()
    store = ArtifactStore(state_root)
    store.promote(capture(tmp_path, req, 1), request=req)
    slow_rmtree, entered = store_mod.shutil.rmtree, threading.Event()

    def rmtree(path, *a, **kw):  # the deleter preempted right after it released the lock
        entered.set()
        time.sleep(1.0)
        return slow_rmtree(path, *a, **kw)

    monkeypatch.setattr(store_mod.shutil, "rmtree", rmtree)
    deleter = threading.Thread(target=lambda: store.delete(recipe=req["workload"]["recipe"],
                                                           snapshot_driver=req["snapshot_driver"]["id"]))
    deleter.start()
    assert entered.wait(10)
    res = store.promote(capture(tmp_path, req, 2), request=req)
    deleter.join(30)
    assert res.changed and store.current(identity(req)).capture_id == res.generation["capture_id"]
    assert [g.number for g in store.generations(identity(req))] == [int(res.generation["generation"])]


def test_pruning_keeps_the_capture_a_retained_published_descriptor_restores_from(state_root, tmp_path):
    import hashlib

    from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.publication import (
        publish_descriptor,
    )

    req = make_request(retention=1)
    store = ArtifactStore(state_root)
    accepted = write_artifact(tmp_path / "out-accepted", make_artifact(req, capture_id="cap-1"))
    store.promote(accepted, request=req)
    published = publish_descriptor(source=accepted, artifact_dir=tmp_path / "out-native",
                                   source_sha256="sha256:" + hashlib.sha256(accepted.read_bytes()).hexdigest(),
                                   native={"repository": "org/p", "revision": "b" * 40})
    res = store.promote(published["path"], request=req)
    assert res.pruned and store.current(identity(req)).capture_id == "cap-1"
    assert all(r["capture_id"] is None for r in res.cleanup), "cap-1 is what the current generation restores"


def test_a_store_file_that_is_not_an_object_is_no_generation_and_stored_files_are_private(state_root, tmp_path):
    req = make_request()
    store = ArtifactStore(state_root)
    res = store.promote(capture(tmp_path, req, 1), request=req)
    gdir = Path(res.generation["path"])
    gdir = gdir if gdir.is_dir() else gdir.parent
    assert oct(gdir.stat().st_mode & 0o777) == "0o700"
    assert {oct(p.stat().st_mode & 0o777) for p in gdir.iterdir()} == {"0o600"}
    (gdir.parent / "identity.json").write_text("[]")
    assert store.info(identity(req)) is None
    (gdir / "generation.json").write_text('"text"')
    assert store.generations(identity(req)) == []
