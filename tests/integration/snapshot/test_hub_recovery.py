"""Recovery from the Hugging Face Hub, with real CRIU: the pinned commit of the model's repository,
safetensors and JSON only, downloaded by the real ``huggingface_hub`` client in prepare (before
anything is evicted) into ``source.cache_dir``, its pins checked, then hydrated. The Hub cannot be
reached from here, so a local stand-in of it answers (``WritableHubStandin``, the client code path
unchanged). ``cache-only-auto`` never contacts the Hub; a download that fails stops the restore in
prepare while the workload keeps serving."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from snapshot_workload import Workload, units_of

pytestmark = [pytest.mark.criu, pytest.mark.slow]

_spec = importlib.util.spec_from_file_location(
    "hub_standin_for_recovery", Path(__file__).resolve().parents[1] / "payload" / "hub_standin.py")
hub_standin = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = hub_standin  # dataclasses look their module up there
_spec.loader.exec_module(hub_standin)

TOKEN = "hf_standin_" + "5" * 24


@pytest.fixture(scope="module")
def captured(state_root, tiny_model, env_digest):
    wl = Workload(state_root, tiny_model, env_digest, tp=1, name="hub-recovery")
    cap = wl.run(wl.request("capture"))
    assert cap.succeeded, cap.receipt["error"]
    artifact = Path(cap.receipt["result"]["operation"]["artifact"])
    yield wl, artifact, json.loads(artifact.read_text())
    wl.stop()


@pytest.fixture(scope="module")
def hub(tiny_model):
    """The model's repository on the stand-in, its commit the pinned revision; a README that recovery must
    not download rides along."""
    model_dir, ident = tiny_model
    files = {p.name: {"data": p.read_bytes()} for p in sorted(model_dir.iterdir()) if p.is_file()}
    files["README.md"] = {"data": b"# not needed for recovery\n"}
    with hub_standin.WritableHubStandin(ident["id"], token=TOKEN) as standin:
        standin.commits[ident["revision"]] = {"parent": None, "files": files}
        standin.branches["main"] = ident["revision"]
        yield standin


def from_hub(cache: Path, mode: str):
    def mutate(req: dict) -> None:
        req["launch"]["model"]["source"] = {"kind": "huggingface", "repository": req["launch"]["model"]["id"],
                                            "cache_dir": str(cache)}
        req["policy"]["weights"]["mode"] = mode
        req["policy"]["weights"]["recovery"] = {"enabled": True, "source": "huggingface"}
    return mutate


def test_recovery_downloads_the_pinned_snapshot_in_prepare_then_cache_only_never_calls(
        captured, hub, tmp_path, tiny_model):
    wl, artifact, art = captured
    _model_dir, ident = tiny_model
    cache = tmp_path / "hf-cache"
    res = wl.run(wl.request("restore", artifact=artifact, mutate=from_hub(cache, "recovery")),
                 envvars={"HF_ENDPOINT": hub.endpoint}, secrets={"coldsnap_hf_token": TOKEN})
    assert res.succeeded, res.receipt["error"]
    assert units_of(res.receipt)[0]["reply"] == art["acceptance"]["reply"]
    gets = [p for m, p, _ok in hub.requests if m == "GET" and "/resolve/" in p]
    assert gets and all(f"/resolve/{ident['revision']}/" in p for p in gets), "only the pinned commit"
    assert not any(p.endswith("README.md") for p in gets), "safetensors and JSON only"
    assert all(ok for _m, p, ok in hub.requests if "/coldsnap/" in p), "the token went with every repository call"
    assert TOKEN not in json.dumps(res.receipt)
    snapshot = cache / f"models--{ident['id'].replace('/', '--')}" / "snapshots" / ident["revision"]
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(ident["files"] + ["config.json", "identity.json"]) \
        or all((snapshot / f).exists() for f in ident["files"])
    log = (wl.state_root / "workloads" / wl.name / "unit-0" / "target.log").read_text().splitlines()
    assert json.loads(log[0])["provider"] == "recovery"

    # cache-only-auto without the native pack on this host and with the Hub gone: the Hugging Face cache
    # serves the recovery, and no request is made.
    pack = wl.state_root / art["weights"]["workers"][0]["payload"]["path"]
    aside = pack.with_name(pack.name + ".aside")
    pack.rename(aside)
    try:
        seen = len(hub.requests)
        res = wl.run(wl.request("restore", artifact=artifact, mutate=from_hub(cache, "cache-only-auto")),
                     envvars={"HF_ENDPOINT": "http://127.0.0.1:9"})
        assert res.succeeded, res.receipt["error"]
        (planned,) = res.receipt["result"]["operation"]["prepared"][0]["weights"]["workers"].values()
        assert planned["provider"] == "recovery", planned
        assert len(hub.requests) == seen
    finally:
        aside.rename(pack)


def test_an_unreachable_hub_fails_recovery_in_prepare_and_the_workload_keeps_serving(captured, tmp_path):
    wl, artifact, art = captured
    pids = wl.engines()
    assert pids, "the previous test leaves the workload running"
    res = wl.run(wl.request("restore", artifact=artifact, mutate=from_hub(tmp_path / "empty-cache", "recovery")),
                 envvars={"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_ETAG_TIMEOUT": "2"})
    assert not res.succeeded
    err = res.receipt["error"]
    assert "could not download the pinned safetensors" in err["message"] and "prepare" in (err["phase"] or ""), err
    assert wl.engines() == pids
    assert wl.complete() == art["acceptance"]["reply"]
