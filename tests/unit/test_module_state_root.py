"""A module's ``state_root`` is an absolute path: an empty or relative one (an unset variable in
``module_defaults``, a typo) would be taken from wherever the module runs, the remote user's home over
SSH, and ColdSnap would make that directory its state root. Refused, naming the option, before anything
is written."""

from __future__ import annotations

import hashlib
import os

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.store import ArtifactStore
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import StateLayout
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from module_runner import HAVE_ANSIBLE, run_module

TOKEN = "rootTestToken" + "t" * 32


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A private directory with a user's files in it, as a remote user's home (the module's working directory)."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / ".bashrc").write_text("# mine\n")
    monkeypatch.chdir(home)
    return home


@pytest.mark.parametrize("root", ["", "  ", "coldsnap", "./state", "../elsewhere"])
def test_a_state_root_that_is_not_absolute_is_refused_by_the_layout(root):
    for make in (StateLayout, NodeCache, ArtifactStore):
        with pytest.raises(ColdSnapError, match=r"state_root .* is not an absolute path.*absolute"):
            make(root)


@pytest.mark.skipif(not HAVE_ANSIBLE, reason="ansible-core is not installed in this environment")
@pytest.mark.parametrize("root", ["", "coldsnap-state"])
def test_modules_refuse_an_empty_or_relative_state_root_and_write_nothing(home, tmp_path, root):
    pack = tmp_path / "weights.pack"
    pack.write_bytes(b"w" * 4096)
    digest = "sha256:" + hashlib.sha256(pack.read_bytes()).hexdigest()
    served = tmp_path / "served"
    served.mkdir()
    (served / "a.bin").write_bytes(b"a")
    for module, args in (
        ("payload_stage", {"sha256": digest, "size": 4096, "source": {"kind": "local", "path": str(pack)}}),
        ("transfer_serve", {"name": "t1", "root": str(served), "token": TOKEN, "address": "127.0.0.1"}),
    ):
        for check in ((), ("--check",)):
            res = run_module(module, {"state_root": root, **args}, *check)
            assert res.get("failed"), (module, check, res)
            assert "state_root" in res["msg"] and "absolute path" in res["msg"], res["msg"]
            assert TOKEN not in str(res)
    assert sorted(os.listdir(home)) == [".bashrc"]


@pytest.mark.skipif(not HAVE_ANSIBLE, reason="ansible-core is not installed in this environment")
@pytest.mark.parametrize("check", [(), ("--check",)])
def test_leftover_removal_with_an_empty_state_root_removes_nothing_from_the_working_directory(home, check):
    """A capture directory of that name in the working directory (the home) is not ColdSnap's to remove."""
    mine = home / "captures" / "cap-1"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("precious\n")
    res = run_module("artifact_leftovers", {"state_root": "", "refs": [{"capture_id": "cap-1"}], "host": "h"}, *check)
    assert res.get("failed") and "state_root" in res["msg"] and "absolute path" in res["msg"], res
    assert (mine / "notes.txt").read_text() == "precious\n"
