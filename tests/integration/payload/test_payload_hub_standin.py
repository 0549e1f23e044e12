"""Staging from Hugging Face through a local stand-in of the Hub (HF_ENDPOINT), library and module."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import PackRef, pack_relpath
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.provider import resolve_provider
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.stage import StageSource, stage_payload
from hub_standin import HubStandin
from netports import free_port
from test_payload_modules import run_module

COMMIT = "5" * 40
REPO_ID = "coldsnap-test/payloads"
TOKEN = "hf_standin_SECRET_7d2c9e"


@pytest.fixture
def hub():
    data = random.Random(3).randbytes(2 << 20)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    with HubStandin(REPO_ID, COMMIT, {pack_relpath(digest[7:]): data}, token=TOKEN) as h:
        h.digest, h.size = digest, len(data)
        yield h


def test_stage_from_hub_standin_via_hf_endpoint(tmp_path, hub):
    """hf_hub_download with the revision pinned, pointed at the stand-in with HF_ENDPOINT (fresh process)."""
    code = (
        "import json, sys\n"
        "from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.stage import StageSource, stage_payload\n"
        f"src = StageSource('huggingface', repository={REPO_ID!r}, revision={COMMIT!r}, token={TOKEN!r})\n"
        f"r = stage_payload({str(tmp_path / 'state')!r}, {hub.digest!r}, {hub.size}, src)\n"
        "print(json.dumps(r.as_result()))\n"
    )
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_HOME": str(tmp_path / "hf-home")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["changed"] is True and res["bytes_copied"] == hub.size and TOKEN not in proc.stdout + proc.stderr
    assert [m for m, _p, _a in hub.requests] == ["HEAD", "GET"]
    assert all(f"/resolve/{COMMIT}/" in p and a == f"Bearer {TOKEN}" for _m, p, a in hub.requests)
    cache = NodeCache(tmp_path / "state")
    assert cache.record_path_for(hub.digest).exists()
    assert not any(cache.downloads.iterdir()), "the download staging directory is removed"
    again = stage_payload(tmp_path / "state", hub.digest, hub.size,
                          StageSource("huggingface", repository=REPO_ID, revision=COMMIT, endpoint=hub.endpoint))
    assert again.changed is False and len(hub.requests) == 2, "a verified payload is not downloaded again"


def test_hub_standin_wrong_bytes_are_not_cached(tmp_path, hub):
    wrong = "sha256:" + "e" * 64
    hub.files[pack_relpath(wrong[7:])] = os.urandom(hub.size)
    with pytest.raises(IntegrityError, match="hashes to"):
        stage_payload(tmp_path / "state", wrong, hub.size,
                      StageSource("huggingface", repository=REPO_ID, revision=COMMIT, token=TOKEN,
                                  endpoint=hub.endpoint))
    cache = NodeCache(tmp_path / "state")
    assert not cache.path_for(wrong).exists() and not any(cache.downloads.iterdir())


def test_hub_standin_errors_are_clear_and_never_show_the_token(tmp_path, hub):
    with pytest.raises(ColdSnapError) as err:
        stage_payload(tmp_path / "state", hub.digest, hub.size,
                      StageSource("huggingface", repository=REPO_ID, revision=COMMIT, token="hf_wrong_token_123",
                                  endpoint=hub.endpoint))
    assert "could not download" in str(err.value) and "hf_wrong_token_123" not in str(err.value)
    assert hub.requests and all(a == "Bearer hf_wrong_token_123" for _m, _p, a in hub.requests)
    seen = len(hub.requests)
    with pytest.raises(ColdSnapError, match="immutable commit"):
        stage_payload(tmp_path / "state", hub.digest, hub.size,
                      StageSource("huggingface", repository=REPO_ID, revision="main", endpoint=hub.endpoint))
    assert len(hub.requests) == seen, "a mutable revision is refused before the Hub is contacted"


def test_cache_only_auto_never_contacts_the_hub_standin(tmp_path, hub):
    src = StageSource("huggingface", repository=REPO_ID, revision=COMMIT, token=TOKEN, endpoint=hub.endpoint)
    pack = PackRef.for_digest(hub.digest, hub.size)
    r = resolve_provider("cache-only-auto", state_root=tmp_path / "state", pack=pack, recovery_enabled=True,
                         sources=[src])
    assert r.provider == "recovery" and hub.requests == []
    assert any("never contacts the Hub" in reason for reason in r.reasons)
    r = resolve_provider("auto", state_root=tmp_path / "state", pack=pack, recovery_enabled=True, sources=[src])
    assert r.provider == "native" and len(hub.requests) == 2
    r.close()
    hub.requests.clear()
    r = resolve_provider("cache-only-auto", state_root=tmp_path / "state", pack=pack, recovery_enabled=True,
                         sources=[src])
    assert r.provider == "native" and hub.requests == []  # now served by the node cache
    r.close()


def test_stage_module_hub_standin_token_never_in_output_at_vvv(tmp_path, hub):
    """FAULTS 24: no_log keeps the token out of every line of -vvv output, in success and in failure."""
    args = {"state_root": str(tmp_path / "state"), "sha256": hub.digest, "size": hub.size,
            "source": {"kind": "huggingface", "repository": REPO_ID, "revision": COMMIT, "token": TOKEN,
                       "endpoint": hub.endpoint}}
    proc = run_module("payload_stage", args, "-vvv", raw=True)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "CHANGED" in proc.stdout and TOKEN not in proc.stdout + proc.stderr
    assert any(a == f"Bearer {TOKEN}" for _m, _p, a in hub.requests), "the token did reach the Hub"
    proc = run_module("payload_stage", args, "-vvv", raw=True)
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout and TOKEN not in proc.stdout + proc.stderr
    bad = {**args, "state_root": str(tmp_path / "s2"),
           "source": {**args["source"], "token": TOKEN + "x"}}
    proc = run_module("payload_stage", bad, "-vvv", raw=True)
    assert proc.returncode != 0 and "FAILED" in proc.stdout and TOKEN not in proc.stdout + proc.stderr
    assert Path(tmp_path / "state").exists()


def test_check_mode_asks_the_hub_standin_for_the_file_and_downloads_nothing(tmp_path, hub):
    """Check mode sends the download's first request alone (HEAD at the pinned revision): a Hub that does
    not answer, a refused token, a missing revision or file and another size fail as the real run would."""
    state = tmp_path / "state"

    def source(**kw) -> StageSource:
        return StageSource("huggingface", **{"repository": REPO_ID, "revision": COMMIT, "token": TOKEN,
                                             "endpoint": hub.endpoint, **kw})

    ok = stage_payload(state, hub.digest, hub.size, source(), check_mode=True)
    assert ok.changed and ok.bytes_copied == 0
    cases = [(source(token="hf_wrong_token_123"), hub.size, "401"),
             (source(revision="6" * 40), hub.size, "RevisionNotFound"),
             (source(filename="model-payloads/other.pack"), hub.size, "EntryNotFound"),
             (source(), hub.size + 1, f"has {hub.size} bytes, expected {hub.size + 1}"),
             (source(endpoint=f"http://127.0.0.1:{free_port()}"), hub.size, "could not download")]
    for src, size, says in cases:
        with pytest.raises(ColdSnapError, match=says) as err:
            stage_payload(state, hub.digest, size, src, check_mode=True)
        assert "hf_wrong_token_123" not in str(err.value)
    assert {m for m, _p, _a in hub.requests} == {"HEAD"}, "no byte of the payload was asked for"
    assert not state.exists(), "check mode wrote nothing"
    args = {"state_root": str(state), "sha256": hub.digest, "size": hub.size,
            "source": {"kind": "huggingface", "repository": REPO_ID, "revision": "6" * 40, "token": TOKEN,
                       "endpoint": hub.endpoint}}
    res = run_module("payload_stage", args, "--check")
    assert res.get("failed") and "RevisionNotFound" in res["msg"] and not state.exists()
