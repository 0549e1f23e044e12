"""The payload modules through real Ansible: idempotency, honest check mode, refusals (FAULTS 7, 24)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from payload_testlib import BAD_DIGESTS, tree_snapshot

VENV_BIN = Path(sys.executable).parent


def collections_path() -> str:
    """The collections root this test imports the library from (the dev venv's, or CI's)."""
    from ansible_collections.coldsnap.fleet import plugins

    return os.environ.get("ANSIBLE_COLLECTIONS_PATH") or str(Path(plugins.__file__).parents[4])


def ansible_env() -> dict:
    env = dict(os.environ)
    env["ANSIBLE_COLLECTIONS_PATH"] = collections_path()
    env["ANSIBLE_LOCALHOST_WARNING"] = "false"
    env["ANSIBLE_INVENTORY_UNPARSED_WARNING"] = "false"
    env["ANSIBLE_LOAD_CALLBACK_PLUGINS"] = "true"
    env["ANSIBLE_STDOUT_CALLBACK"] = "ansible.builtin.json"
    env["ANSIBLE_PYTHON_INTERPRETER"] = sys.executable
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
    return env


def run_module(module: str, args: dict, *extra: str, raw: bool = False):
    """``ansible localhost -m coldsnap.fleet.<module> -a '<json>'``; returns the task result (or the raw run)."""
    ansible = shutil.which("ansible", path=str(VENV_BIN)) or "ansible"
    env = ansible_env()
    if raw:
        env.pop("ANSIBLE_STDOUT_CALLBACK")
        env.pop("ANSIBLE_LOAD_CALLBACK_PLUGINS")
    proc = subprocess.run([ansible, "localhost", "-m", f"coldsnap.fleet.{module}", "-a", json.dumps(args), *extra],
                          capture_output=True, text=True, env=env, timeout=180, check=False)
    if raw:
        return proc
    doc = json.loads(proc.stdout)
    return doc["plays"][0]["tasks"][0]["hosts"]["localhost"]


@pytest.fixture
def pack_source(tmp_path):
    data = random.Random(11).randbytes(3 << 20)
    src = tmp_path / "exports" / "model-weights.pack"
    src.parent.mkdir()
    src.write_bytes(data)
    return src, "sha256:" + hashlib.sha256(data).hexdigest(), len(data)


def test_stage_is_idempotent_and_check_mode_changes_nothing(tmp_path, pack_source):
    src, digest, size = pack_source
    state = tmp_path / "state"
    args = {"state_root": str(state), "sha256": digest, "size": size, "source": {"kind": "local", "path": str(src)}}
    check = run_module("payload_stage", args, "--check")
    assert check["changed"] is True and not check.get("failed")
    assert not state.exists(), "check mode must not create anything"
    first = run_module("payload_stage", args)
    assert first["changed"] is True and first["verified"] is True and first["bytes_copied"] == size
    assert Path(first["path"]) == NodeCache(state).path_for(digest)
    second = run_module("payload_stage", args)
    assert second["changed"] is False and second["record_reused"] is True and second["bytes_copied"] == 0
    before = tree_snapshot(state)
    check = run_module("payload_stage", args, "--check")
    assert check["changed"] is False
    assert tree_snapshot(state) == before


def test_verify_module_writes_a_record_once_and_check_mode_writes_none(tmp_path, pack_source):
    src, digest, size = pack_source
    cache = NodeCache(tmp_path / "state")
    path = cache.path_for(digest)
    path.parent.mkdir(parents=True)
    shutil.copyfile(src, path)
    args = {"state_root": str(cache.state_root), "sha256": digest, "size": size}
    before = tree_snapshot(cache.state_root)
    check = run_module("payload_verify", args, "--check")
    assert check["changed"] is True and check["verified"] is True and check["bytes_hashed"] == size
    assert tree_snapshot(cache.state_root) == before
    first = run_module("payload_verify", args)
    assert first["changed"] is True and first["record_reused"] is False and first["bytes_hashed"] == size
    second = run_module("payload_verify", args)
    assert (second["changed"], second["record_reused"], second["bytes_hashed"]) == (False, True, 0)
    assert second["path"] == str(path)
    explicit = run_module("payload_verify", {**args, "path": str(path)})
    assert explicit["changed"] is False and explicit["verified"] is True


def test_verify_module_quarantines_a_corrupt_pack(tmp_path, pack_source):
    src, digest, size = pack_source
    cache = NodeCache(tmp_path / "state")
    path = cache.path_for(digest)
    path.parent.mkdir(parents=True)
    data = bytearray(src.read_bytes())
    data[123] ^= 0x80
    path.write_bytes(bytes(data))
    args = {"state_root": str(cache.state_root), "sha256": digest, "size": size}
    check = run_module("payload_verify", args, "--check")  # says what a real run does, moves nothing
    assert check["failed"] is True and check["changed"] is True and check["quarantined"] is None
    assert path.exists() and not cache.quarantined()
    res = run_module("payload_verify", args)
    assert res["failed"] is True and "quarantine" in res["msg"] and res["quarantined"] and res["changed"] is True
    assert not path.exists() and Path(res["quarantined"]).exists()


@pytest.mark.parametrize("bad", BAD_DIGESTS[:5])
def test_modules_refuse_malformed_digests_before_any_path(tmp_path, bad, pack_source):
    src, _digest, size = pack_source
    state = tmp_path / "state"
    res = run_module("payload_stage", {"state_root": str(state), "sha256": bad, "size": size,
                                       "source": {"kind": "local", "path": str(src)}})
    assert res["failed"] is True and "sha256" in res["msg"]
    res = run_module("payload_verify", {"state_root": str(state), "sha256": bad, "size": size})
    assert res["failed"] is True
    assert not state.exists()


def test_stage_module_argument_rules(tmp_path, pack_source):
    _src, digest, size = pack_source
    res = run_module("payload_stage", {"state_root": str(tmp_path), "sha256": digest, "size": size,
                                       "source": {"kind": "local"}})
    assert res["failed"] is True and "path" in res["msg"]
    res = run_module("payload_stage", {"state_root": str(tmp_path), "sha256": digest, "size": size,
                                       "source": {"kind": "huggingface", "repository": "org/p", "revision": "main"}})
    assert res["failed"] is True and "commit" in res["msg"]
