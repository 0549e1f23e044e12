"""capsule_build and capsule_publish through real Ansible: idempotent, honest check mode, no secrets in output."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from capsule_helpers import make_state, run_module

TARGET = "/var/lib/coldsnap/captures/m/units/unit-0"
SECRET = "s3cr3t-registry-pw-5e4d"


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def _build_args(tmp_path: Path, capture_id: str) -> dict:
    return {"unit": "unit-0", "capture_id": capture_id, "state_dir": str(tmp_path / "state"),
            "state_target": TARGET, "layout": "oci-layout", "oci_root": str(tmp_path / "capsules"),
            "forbidden_paths": ["/var/lib/coldsnap/models/m"], "labels": {"org.coldsnap.recipe": "r"}}


def test_capsule_build_module_check_mode_then_idempotent(tmp_path, capture_id):
    make_state(tmp_path)
    args = _build_args(tmp_path, capture_id)
    checked, _unused = run_module("capsule_build", args, "--check")
    assert checked["changed"] is True and not (tmp_path / "capsules").exists(), "check mode writes nothing"
    first, _unused = run_module("capsule_build", args)
    assert first["changed"] is True and first["capsule"]["image_id"] == checked["capsule"]["image_id"]
    assert first["excluded"] == ["a" * 64 + ".pack"]
    second, _unused = run_module("capsule_build", args)
    assert second["changed"] is False and second["capsule"] == first["capsule"]
    again_checked, _unused = run_module("capsule_build", args, "--check")
    assert again_checked["changed"] is False


def test_capsule_build_module_refuses_a_model_mount_cache(tmp_path, capture_id):
    make_state(tmp_path)
    args = {**_build_args(tmp_path, capture_id), "cache_paths": ["/var/lib/coldsnap/models/m"]}
    res, _unused = run_module("capsule_build", args)
    assert res.get("failed") is True and "overlaps the unit's mount" in res["msg"]
    assert not (tmp_path / "capsules").exists()


@pytest.mark.registry
def test_capsule_publish_module_push_pull_idempotent_and_no_secret_in_output(tmp_path, capture_id, registry):
    make_state(tmp_path)
    built, _unused = run_module("capsule_build", _build_args(tmp_path, capture_id))
    capsule = {**built["capsule"], "host": "localhost"}
    repo = f"{registry}/coldsnap/module-capsules"
    push = {"capsules": [capsule], "host": "localhost", "repository": repo, "registry_username": "ci",
            "registry_password": SECRET}
    checked, out = run_module("capsule_publish", push, "--check", "-vvv")
    assert checked["changed"] is True and checked["actions"] == {"unit-0": "would-push"}
    pushed, out2 = run_module("capsule_publish", push, "-vvv")
    assert pushed["changed"] is True and pushed["actions"] == {"unit-0": "pushed"}
    digest = pushed["capsules"][0]["repository_digest"]
    assert digest.startswith(f"{repo}@sha256:") and digest != f"{repo}@{capsule['image_id']}", \
        "layers travel gzip: the pushed manifest is not the local one"
    again, out3 = run_module("capsule_publish", push, "-vvv")
    assert again["changed"] is False and again["actions"] == {"unit-0": "present"}
    assert again["capsules"][0]["repository_digest"] == digest, "a second publish finds the first one"
    # Whatever the layers travelled as, a capsule the registry serves is not pushed again.
    assert run_module("capsule_publish", {**push, "layer_compression": "none"})[0]["actions"] == {"unit-0": "present"}
    plain_repo = f"{registry}/coldsnap/module-capsules-plain"
    plain, _unused = run_module("capsule_publish", {**push, "repository": plain_repo, "layer_compression": "none"})
    assert plain["actions"] == {"unit-0": "pushed"}
    assert plain["capsules"][0]["repository_digest"] == f"{plain_repo}@{capsule['image_id']}"
    again_plain, _unused = run_module("capsule_publish", {**push, "repository": plain_repo})
    assert again_plain["actions"] == {"unit-0": "present"}
    assert again_plain["capsules"][0]["repository_digest"] == f"{plain_repo}@{capsule['image_id']}"
    for text in (out, out2, out3):
        assert SECRET not in text

    restored = {**pushed["capsules"][0], "location": "elsewhere"}
    pull = {"state": "pulled", "capsules": [restored], "units": ["unit-0"], "oci_root": str(tmp_path / "host-b")}
    would, _unused = run_module("capsule_publish", pull, "--check")
    assert would["changed"] is True and _tree(tmp_path / "host-b") == []
    pulled, _unused = run_module("capsule_publish", pull)
    assert pulled["changed"] is True and pulled["actions"] == {"unit-0": "pulled"}
    assert pulled["capsules"][0]["location"] == str(tmp_path / "host-b" / "sha256" / capsule["image_id"][7:])
    present, _unused = run_module("capsule_publish", pull)
    assert present["changed"] is False and present["actions"] == {"unit-0": "present"}
    verified, _unused = run_module("capsule_publish", {"state": "verified", "capsules": [pulled["capsules"][0]]})
    assert verified["changed"] is False and verified["actions"] == {"unit-0": "verified"}


@pytest.mark.registry
def test_capsule_publish_module_reports_a_rejected_push(tmp_path, capture_id, readonly_registry):
    make_state(tmp_path)
    built, _unused = run_module("capsule_build", _build_args(tmp_path, capture_id))
    res, _unused = run_module("capsule_publish", {"capsules": [built["capsule"]],
                                                  "repository": f"{readonly_registry}/coldsnap/c"})
    assert res.get("failed") is True and "405" in res["msg"] and "read-only" in res["msg"]
    assert "capsules" not in res or not any(c.get("repository_digest") for c in res["capsules"])
    assert os.path.isdir(built["capsule"]["location"]), "the local capsule is untouched"


def test_capsule_publish_module_refuses_an_unknown_layer_compression(tmp_path, capture_id):
    make_state(tmp_path)
    built, _unused = run_module("capsule_build", _build_args(tmp_path, capture_id))
    res, _unused = run_module("capsule_publish", {"capsules": [{**built["capsule"], "host": "localhost"}],
                                                  "repository": "127.0.0.1:1/coldsnap/never",
                                                  "layer_compression": "zstd"})
    assert res.get("failed") is True and "layer_compression" in res["msg"] and "gzip" in res["msg"]
