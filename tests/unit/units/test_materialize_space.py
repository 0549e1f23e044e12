"""``policy.weights.native.materialize: required`` makes a recovery restore write every recovered worker's
pack into the node cache before the engine serves: a file system without room for them fails in prepare,
naming the bytes and the ways out, never after the running workload was evicted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import weights

GIB = 1 << 30
ARTIFACT = {"weights": {"workers": [
    {"worker": "worker-0", "unit": "unit-0", "payload": {"size": 3 * GIB, "sha256": "sha256:" + "0" * 64}},
    {"worker": "worker-1", "unit": "unit-0", "payload": {"size": 2 * GIB, "sha256": "sha256:" + "1" * 64}},
]}}


def _plan(materialize: str, providers: dict[str, str]) -> dict:
    return {"materialize": materialize, "workers": {w: {"provider": p} for w, p in providers.items()}}


@pytest.fixture
def free_bytes(monkeypatch):
    """The node cache's file system has ``free[0]`` bytes available (as a full disk would say)."""
    free = [0]
    real = os.statvfs

    def statvfs(path):
        st = real(path)
        return os.statvfs_result((st.f_bsize, 4096, st.f_blocks, st.f_bfree, free[0] // 4096, st.f_files,
                                  st.f_ffree, st.f_favail, st.f_flag, st.f_namemax))

    monkeypatch.setattr(weights.os, "statvfs", statvfs)
    return free


def test_a_required_materialize_without_room_for_the_packs_fails_in_prepare(tmp_path: Path, free_bytes) -> None:
    free_bytes[0] = 4 * GIB
    plan = _plan("required", {"worker-0": "recovery", "worker-1": "recovery"})
    with pytest.raises(ColdSnapError) as err:
        weights.require_materialize_space(plan, ARTIFACT, state_root=tmp_path / "state")
    msg = str(err.value)
    assert "materialize" in msg and str(5 * GIB) in msg and str(4 * GIB) in msg
    assert "async" in err.value.fix and "coldsnap_state_root" in err.value.fix
    free_bytes[0] = 5 * GIB
    weights.require_materialize_space(plan, ARTIFACT, state_root=tmp_path / "state")


@pytest.mark.parametrize(("materialize", "providers"), [
    ("async", {"worker-0": "recovery", "worker-1": "recovery"}),  # written in the background, best effort
    ("off", {"worker-0": "recovery", "worker-1": "recovery"}),
    ("required", {"worker-0": "native", "worker-1": "native"}),  # nothing to write: the packs are here
])
def test_nothing_is_asked_of_the_disk_when_nothing_must_be_written(tmp_path, free_bytes, materialize, providers):
    free_bytes[0] = 0
    weights.require_materialize_space(_plan(materialize, providers), ARTIFACT, state_root=tmp_path / "state")


def test_only_the_recovered_workers_packs_count(tmp_path, free_bytes) -> None:
    free_bytes[0] = 2 * GIB
    plan = _plan("required", {"worker-0": "native", "worker-1": "recovery"})
    weights.require_materialize_space(plan, ARTIFACT, state_root=tmp_path / "state")


def test_workers_that_share_a_pack_write_it_once(tmp_path, free_bytes) -> None:
    """The node cache holds one object per digest: two workers with the same pack need its size once."""
    shared = {"weights": {"workers": [
        {"worker": "worker-0", "unit": "unit-0", "payload": {"size": 3 * GIB, "sha256": "sha256:" + "a" * 64}},
        {"worker": "worker-1", "unit": "unit-0", "payload": {"size": 3 * GIB, "sha256": "sha256:" + "a" * 64}},
    ]}}
    free_bytes[0] = 4 * GIB
    plan = _plan("required", {"worker-0": "recovery", "worker-1": "recovery"})
    weights.require_materialize_space(plan, shared, state_root=tmp_path / "state")
    with pytest.raises(ColdSnapError):
        weights.require_materialize_space(plan, ARTIFACT, state_root=tmp_path / "state")
