"""``coldsnap publish-native``: the real huggingface_hub code path against a local HTTP stand-in of the
Hub (WritableHubStandin in tests/integration/payload/hub_standin.py; the Hub cannot be reached here).

The stand-in implements the legacy LFS upload protocol, not Xet storage, so uploads run with
HF_HUB_DISABLE_XET=1 (a huggingface_hub setting); everything else is the library's normal path.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import IntegrityError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import (
    load_artifact,
    validate_artifact,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import publish as native
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import records
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import pack_relpath
from publish_helpers import WritableHubStandin, digest_of

REPO_ID = "acme/coldsnap-payloads"
TOKEN = "hf_standin_" + "7" * 24
FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "artifacts" / "reference-tiny-n610.json"


# ----------------------------------------------------------------------------- shared objects (library)

def shared_payload_artifact(data: bytes) -> dict:
    """A two-unit, two-worker descriptor whose workers share one payload; unit-1 was captured on 'hostb'."""
    art = json.loads(FIXTURE.read_text())
    hexd = hashlib.sha256(data).hexdigest()
    unit1 = {**copy.deepcopy(art["launch"]["units"][0]), "id": "unit-1", "index": 1, "host": "hostb"}
    art["launch"]["units"].append(unit1)
    art["launch"]["execution"]["workers"].append({"id": "worker-1", "unit": "unit-1", "rank": 1,
                                                  "device_slot": None})
    for g in art["launch"]["execution"]["groups"]:
        g["workers"] = ["worker-0", "worker-1"]
    art["compatibility"]["units"].append({**art["compatibility"]["units"][0], "unit": "unit-1"})
    art["capsule"]["units"].append({**art["capsule"]["units"][0], "unit": "unit-1", "host": "hostb"})
    w1 = {**copy.deepcopy(art["weights"]["workers"][0]), "worker": "worker-1", "unit": "unit-1", "rank": 1}
    art["weights"]["workers"].append(w1)
    for w in art["weights"]["workers"]:
        w["payload"] = {"owner": w["worker"], "size": len(data), "sha256": f"sha256:{hexd}",
                        "path": pack_relpath(hexd)}
    return validate_artifact(art)


def stage_pack(state_root: Path, data: bytes) -> Path:
    cache = NodeCache(state_root)
    cache.ensure_dirs()
    path = cache.path_for("sha256:" + hashlib.sha256(data).hexdigest())
    path.write_bytes(data)
    path.chmod(0o444)
    return path


@pytest.fixture
def no_xet(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)


def test_a_shared_object_is_rehashed_on_every_host_and_uploaded_once(tmp_path, no_xet):
    data = os.urandom(3 * 1024 * 1024 + 17)
    hexd = hashlib.sha256(data).hexdigest()
    art = shared_payload_artifact(data)
    roots = {"localhost": tmp_path / "a", "hostb": tmp_path / "b"}
    for root in roots.values():
        stage_pack(root, data)
    (obj,) = native.payload_objects(art)
    assert obj.workers == ("worker-0", "worker-1") and obj.upload_host == "localhost"
    with WritableHubStandin(REPO_ID, token=TOKEN) as hub:
        kw = {"artifact": art, "repository": REPO_ID, "branch": "main", "token": TOKEN, "endpoint": hub.endpoint}
        b = native.upload_host_payloads(host="hostb", state_root=roots["hostb"], **kw)
        assert [o["action"] for o in b["objects"]] == ["verified"] and b["commit"] is None
        assert b["objects"][0]["bytes_hashed"] == len(data), "re-hashed in full, not trusted from a record"
        assert hub.uploaded == [], "hostb verifies its copy but does not own the object"

        a = native.upload_host_payloads(host="localhost", state_root=roots["localhost"], **kw)
        assert [o["action"] for o in a["objects"]] == ["uploaded"] and a["changed"] is True
        assert hub.uploaded == [hexd] and hub.commit_calls == 1
        assert a["commit"] == hub.branches["main"]

        again = native.upload_host_payloads(host="localhost", state_root=roots["localhost"], **kw)
        assert [o["action"] for o in again["objects"]] == ["present"] and again["changed"] is False
        assert hub.uploaded == [hexd] and hub.commit_calls == 1, "content already on the branch is not re-sent"

        resolved = native.resolve_revision(artifact=art, repository=REPO_ID, branch="main", token=TOKEN,
                                           endpoint=hub.endpoint)
        assert resolved["revision"] == hub.branches["main"] and re.fullmatch(r"[0-9a-f]{40}", resolved["revision"])
        assert hub.file_at(resolved["revision"], pack_relpath(hexd)) == data
        assert all(auth for _m, _p, auth in hub.requests)


def test_a_pack_altered_behind_a_valid_record_is_caught_and_nothing_is_uploaded(tmp_path, no_xet):
    data = os.urandom(1024 * 1024)
    hexd = hashlib.sha256(data).hexdigest()
    art = shared_payload_artifact(data)
    path = stage_pack(tmp_path, data)
    # Silent corruption that stat cannot see: flip a byte and write a record for the new identity.
    path.chmod(0o644)
    with open(path, "r+b") as fh:
        fh.seek(4096)
        byte = fh.read(1)
        fh.seek(4096)
        fh.write(bytes([byte[0] ^ 0xFF]))
    time.sleep(0.05)
    st = os.stat(path)
    records.write_record(records.record_path_for(path), hexd, len(data), records.FileIdentity.of(st),
                         time.time_ns(), method="full-sha256")
    with WritableHubStandin(REPO_ID, token=TOKEN) as hub:
        with pytest.raises(IntegrityError, match="hashes to"):
            native.upload_host_payloads(artifact=art, host="localhost", state_root=tmp_path, repository=REPO_ID,
                                        branch="main", token=TOKEN, endpoint=hub.endpoint)
        assert hub.uploaded == [] and hub.commit_calls == 0


# ----------------------------------------------------------------------------- through the controller

def publish_native(captured, source: Path, out: Path, hub: WritableHubStandin):
    def to(req: dict) -> None:
        req["policy"]["weights"]["native"]["repository"] = REPO_ID

    req = captured.wl.request("publish-native", artifact=source, output=out, mutate=to)
    res = captured.wl.run(req, secrets={"coldsnap_hf_token": TOKEN},
                          envvars={"HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_XET": "1"})
    return req, res


def token_leaks(root: Path) -> list[str]:
    found = []
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            try:
                if TOKEN.encode() in p.read_bytes():
                    found.append(str(p))
            except OSError:
                pass
    return found


@pytest.mark.docker
@pytest.mark.criu
@pytest.mark.registry
@pytest.mark.slow
def test_publish_native_records_the_commit_and_a_fresh_host_restores_from_it(captured, published, tmp_path):
    source, _repository = published
    art = load_artifact(source.read_bytes())
    (payload,) = {w["payload"]["sha256"]: w["payload"] for w in art["weights"]["workers"]}.values()
    hexd = payload["sha256"].split(":", 1)[1]
    out = tmp_path / "native"
    with WritableHubStandin(REPO_ID, token=TOKEN) as hub:
        req, res = publish_native(captured, source, out, hub)
        assert res.succeeded, res.receipt["error"]
        assert res.receipt["replay_semantics"] == "content-idempotent"
        pub = load_artifact((out / "artifact.json").read_bytes())
        commit = hub.branches["main"]
        assert pub["weights"]["providers"]["native"] == {"repository": REPO_ID, "revision": commit}
        assert pub["parent"] == digest_of(source) and pub["state"] == "published"
        assert pub["capsule"] == art["capsule"], "the registry-backed capsules stay as published"
        assert hub.uploaded == [hexd]
        assert token_leaks(captured.wl.state_root / "runs" / req["id"]) == []
        assert TOKEN not in json.dumps(res.receipt)

        commits = hub.commit_calls
        _req, again = publish_native(captured, source, out, hub)
        assert again.succeeded, again.receipt["error"]
        assert again.receipt["result"]["operation"]["changed"] is False
        assert hub.uploaded == [hexd] and hub.commit_calls == commits

        # A new host: the same state root path (it is part of the captured process's identity) but empty,
        # so neither the capture directory nor the payload is there; the original is set aside meanwhile.
        wl = captured.wl
        aside = wl.state_root.with_name(wl.state_root.name + "-aside")
        wl.stop()
        wl.state_root.rename(aside)
        wl.state_root.mkdir()
        try:
            def native_only(r: dict) -> None:
                r["policy"]["weights"]["mode"] = "native"

            restore = wl.request("restore", artifact=out / "artifact.json", mutate=native_only)
            res = wl.run(restore, secrets={"coldsnap_hf_token": TOKEN},
                         envvars={"HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_XET": "1"})
            assert res.succeeded, res.receipt["error"]
            assert res.receipt["result"]["operation"]["units"][0]["reply"] == art["acceptance"]["reply"]
            downloads = [p for m, p, _a in hub.requests if m == "GET" and "/resolve/" in p]
            assert downloads and all(f"/resolve/{commit}/" in p for p in downloads), "fetched at the pinned commit"
            log = (wl.state_root / "workloads" / wl.name / "unit-0" / "target.log").read_text().splitlines()
            assert json.loads(log[0])["provider"] == "native"
            assert wl.state_root.joinpath(payload["path"]).is_file()
            assert not (wl.state_root / "captures").exists(), "nothing came from the capture directory"

            # The Hub goes away and the host loses the payload: auto falls back to the pinned safetensors in
            # prepare, saying why in the receipt; native fails closed there, naming the reason.
            wl.stop()
            wl.state_root.joinpath(payload["path"]).unlink()
            gone = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_DISABLE_XET": "1", "HF_HUB_ETAG_TIMEOUT": "2"}

            def mode(value: str):
                return lambda r: r["policy"]["weights"].__setitem__("mode", value)

            res = wl.run(wl.request("restore", artifact=out / "artifact.json", mutate=mode("auto")),
                         secrets={"coldsnap_hf_token": TOKEN}, envvars=gone)
            assert res.succeeded, res.receipt["error"]
            (planned,) = res.receipt["result"]["operation"]["prepared"][0]["weights"]["workers"].values()
            assert planned["provider"] == "recovery", planned
            assert planned["reasons"][0].startswith("native staging failed: "), planned["reasons"]
            assert res.receipt["result"]["operation"]["units"][0]["reply"] == art["acceptance"]["reply"]
            assert TOKEN not in json.dumps(res.receipt)
            wl.stop()
            res = wl.run(wl.request("restore", artifact=out / "artifact.json", mutate=mode("native")),
                         secrets={"coldsnap_hf_token": TOKEN}, envvars=gone)
            assert not res.succeeded
            err = res.receipt["error"]
            assert "never falls back" in err["message"] and "prepare" in (err["phase"] or ""), err
            assert TOKEN not in json.dumps(res.receipt)
        finally:
            wl.stop()
            shutil.rmtree(wl.state_root)
            aside.rename(wl.state_root)


@pytest.mark.docker
@pytest.mark.criu
@pytest.mark.slow
def test_a_refused_upload_commits_nothing_and_never_shows_the_token(captured, tmp_path):
    out = tmp_path / "never"
    with WritableHubStandin(REPO_ID, token=TOKEN, refuse_uploads=True) as hub:
        req, res = publish_native(captured, captured.path, out, hub)
        assert not res.succeeded
        assert "upload of 1 payload(s)" in res.receipt["error"]["message"]
        assert hub.uploaded == [] and hub.commit_calls == 0
    assert not (out / "artifact.json").exists()
    assert TOKEN not in json.dumps(res.receipt)
    assert token_leaks(captured.wl.state_root / "runs" / req["id"]) == []


def test_every_payload_lock_is_taken_before_any_hash_in_digest_order(tmp_path, no_xet, monkeypatch):
    """Two publishes on one host that list shared payloads in opposite orders cannot hold one lock
    each and wait on the other: every digest's lock is taken first, in one order, then the hashes."""
    blobs = [os.urandom(64 * 1024 + i) for i in range(2)]
    hexes = [hashlib.sha256(b).hexdigest() for b in blobs]
    art = shared_payload_artifact(blobs[0])
    art["launch"]["units"][1]["host"] = "localhost"
    art["capsule"]["units"][1]["host"] = "localhost"
    order = sorted(range(2), key=lambda i: hexes[i], reverse=True)  # the artifact lists the larger digest first
    for w, i in zip(art["weights"]["workers"], order, strict=True):
        w["payload"] = {"owner": w["worker"], "size": len(blobs[i]), "sha256": f"sha256:{hexes[i]}",
                        "path": pack_relpath(hexes[i])}
    art = validate_artifact(art)
    for b in blobs:
        stage_pack(tmp_path, b)
    events: list[str] = []
    real_lock, real_verify = NodeCache.lock, native.PayloadVerifier.verify_locked

    def lock(self, sha256, **kw):
        events.append("lock " + sha256)
        return real_lock(self, sha256, **kw)

    def verify_locked(self, path, sha256, size, **kw):
        events.append("hash " + sha256)
        return real_verify(self, path, sha256, size, **kw)

    monkeypatch.setattr(NodeCache, "lock", lock)
    monkeypatch.setattr(native.PayloadVerifier, "verify_locked", verify_locked)
    with WritableHubStandin(REPO_ID, token=TOKEN) as hub:
        out = native.upload_host_payloads(artifact=art, host="localhost", state_root=tmp_path, repository=REPO_ID,
                                          branch="main", token=TOKEN, endpoint=hub.endpoint)
    assert sorted(hub.uploaded) == sorted(hexes) and out["changed"] is True
    first, second = sorted(f"sha256:{h}" for h in hexes)
    assert events[:2] == [f"lock {first}", f"lock {second}"]
    assert sorted(events[2:]) == [f"hash {first}", f"hash {second}"]
