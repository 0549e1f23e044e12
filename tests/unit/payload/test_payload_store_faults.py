"""Payload store faults: a pack swapped under its name while it is published, manifests that are not
regular files, a stage lock timeout that would wait for ever, and a quarantine that a failed stage
must still report (FAULTS 1, 4, 6, 9)."""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import validate_artifact
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import pack_relpath
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.manifest import (
    load_manifest,
    load_replay_plan,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.stage import StageSource, stage_payload
from payload_testlib import outcome_within

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "artifacts" / "reference-tiny-n610.json"


# ----------------------------------------------------------------- 9: publish sends the verified inode
def test_publish_uploads_the_verified_inode_not_what_is_under_its_name_later(tmp_path):
    pytest.importorskip("huggingface_hub")
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import publish

    data = os.urandom(64 * 1024)
    hexd = hashlib.sha256(data).hexdigest()
    art = json.loads(FIXTURE.read_text())
    for w in art["weights"]["workers"]:
        w["payload"] = {"owner": w["worker"], "size": len(data), "sha256": f"sha256:{hexd}",
                        "path": pack_relpath(hexd)}
    art = validate_artifact(art)
    host = art["capsule"]["units"][0]["host"]
    cache = NodeCache(tmp_path / "state")
    cache.ensure_dirs()
    pack = cache.path_for(f"sha256:{hexd}")
    pack.write_bytes(data)
    pack.chmod(0o400)
    other = os.urandom(len(data))
    sent: list[bytes] = []

    class Refs:
        branches: list = []

    class Api:
        def list_repo_refs(self, _repo):
            # After the re-hash, before the upload: another file (same size) takes the pack's name.
            tmp = pack.with_name("swap")
            tmp.write_bytes(other)
            os.replace(tmp, pack)
            return Refs()

        def create_branch(self, *_a, **_k):
            return None

        def create_commit(self, _repo, ops, **_kw):
            with ops[0].as_file() as fh:
                sent.append(fh.read())

            class Info:
                oid = "0" * 40

            return Info()

    out = publish.upload_host_payloads(artifact=art, host=host, state_root=tmp_path / "state", repository="acme/p",
                                       branch="main", token=None, endpoint=None, api=Api())
    assert out["changed"] is True
    assert [hashlib.sha256(b).hexdigest() for b in sent] == [hexd], "the bytes uploaded are the bytes hashed"


# ----------------------------------------------------------------- 8: manifests that are not files
@pytest.mark.parametrize("loader", [load_manifest, load_replay_plan])
def test_a_manifest_that_is_a_fifo_or_a_directory_is_refused_at_once(tmp_path, loader):
    fifo = tmp_path / "native-manifest.json"
    os.mkfifo(fifo)
    outcome = outcome_within(lambda: loader(fifo), 10, fifo=fifo)
    assert isinstance(outcome, IntegrityError) and "not a regular file" in str(outcome), outcome
    assert str(fifo) in str(outcome)
    directory = tmp_path / "dir.json"
    directory.mkdir()
    with pytest.raises(IntegrityError, match="not a regular file"):
        loader(directory)


def test_a_manifest_larger_than_the_limit_is_refused_unread(tmp_path, monkeypatch):
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import manifest

    monkeypatch.setattr(manifest, "MAX_MANIFEST_BYTES", 1024)
    big = tmp_path / "native-manifest.json"
    big.write_bytes(b" " * 2048)
    with pytest.raises(ColdSnapError, match="larger than 1024 bytes"):
        load_manifest(big)


# ----------------------------------------------------------------- 6: lock timeouts that never end
@pytest.mark.parametrize("timeout", [math.nan, math.inf, -1.0, True])
def test_a_stage_lock_timeout_that_is_not_finite_seconds_is_refused_before_the_lock(tmp_path, timeout):
    data = os.urandom(4096)
    src = tmp_path / "export.pack"
    src.write_bytes(data)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    state = tmp_path / "state"
    cache = NodeCache(state)
    cache.ensure_dirs()
    with cache.lock(digest):  # another worker holds the digest: a NaN deadline would never pass
        outcome = outcome_within(lambda: stage_payload(state, digest, len(data), StageSource("local", path=src),
                                                       lock_timeout=timeout), 5)
    assert isinstance(outcome, ColdSnapError) and "lock_timeout" in str(outcome), outcome
    assert "finite number of seconds" in (outcome.fix or "")
    assert not cache.path_for(digest).exists()


# ----------------------------------------------------------------- 4: a quarantine is a change
def test_a_corrupt_copy_quarantined_before_the_source_fails_is_reported(tmp_path):
    data = os.urandom(8192)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    cache = NodeCache(tmp_path / "state")
    cache.ensure_dirs()
    cache.path_for(digest).write_bytes(b"x" + data[1:])  # one byte off
    with pytest.raises(ColdSnapError) as err:
        stage_payload(cache.state_root, digest, len(data), StageSource("local", path=tmp_path / "missing.pack"))
    moved = cache.quarantined(digest)
    assert len(moved) == 1 and not cache.path_for(digest).exists()
    assert err.value.details.get("quarantined") == str(moved[0]), "the module reports changed and where it went"
    assert str(moved[0]) in str(err.value) and "missing.pack" in str(err.value)
