"""The captured state is sealed at capture and verified before eviction: every file, with a
validation record that lets a warm host skip re-hashing unchanged files."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import IntegrityError
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import capture_state


@pytest.fixture
def unit_dir(tmp_path: Path) -> Path:
    d = tmp_path / "unit-0"
    (d / "criu" / "worker-0").mkdir(parents=True)
    (d / "workers" / "worker-0").mkdir(parents=True)
    (d / "control").mkdir()
    (d / "logs").mkdir()
    (d / "criu" / "worker-0" / "pages-1.img").write_bytes(os.urandom(70_000))
    (d / "criu" / "worker-0" / "pstree.img").write_bytes(b"\x01\x02\x03\x04pstree")
    (d / "workers" / "worker-0" / "weights.blob").write_bytes(os.urandom(5000))
    (d / "control" / "worker-0.json").write_text('{"port": 1, "pid": 2}')
    (d / "logs" / "capture.log").write_text("log\n")
    (d / "evidence.json").write_text('{"kind": "coldsnap-unit-evidence"}')
    return d


def test_a_sealed_state_verifies_and_a_second_check_rehashes_nothing(unit_dir: Path):
    seal = capture_state.seal(unit_dir).to_json()
    assert seal["files"] == 5
    time.sleep(0.05)  # past the file system's timestamp tick: a record observed now is not racy
    first = capture_state.verify(unit_dir, seal, unit="unit-0")
    assert first["rehashed_files"] == 5
    second = capture_state.verify(unit_dir, seal, unit="unit-0")
    assert second["rehashed_files"] == 0, "a warm host trusts its validation record"
    assert oct(os.stat(unit_dir / capture_state.RECORD_FILE).st_mode & 0o777) == "0o600"


@pytest.mark.parametrize("rel", ["criu/worker-0/pages-1.img", "criu/worker-0/pstree.img",
                                 "workers/worker-0/weights.blob", "control/worker-0.json"])
def test_one_flipped_byte_is_found_even_with_mtime_put_back(unit_dir: Path, rel: str):
    seal = capture_state.seal(unit_dir).to_json()
    capture_state.verify(unit_dir, seal, unit="unit-0")  # a record exists now
    path = unit_dir / rel
    st = os.stat(path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # touch -r: only ctime tells
    with pytest.raises(IntegrityError, match=re.escape(rel.rsplit("/", 1)[-1])):
        capture_state.verify(unit_dir, seal, unit="unit-0")


def test_the_list_and_the_evidence_are_bound_to_the_artifact(unit_dir: Path):
    seal = capture_state.seal(unit_dir).to_json()
    doc = json.loads((unit_dir / capture_state.DIGESTS_FILE).read_text())
    doc["files"]["criu/worker-0/pages-1.img"]["sha256"] = "sha256:" + "0" * 64
    (unit_dir / capture_state.DIGESTS_FILE).write_text(json.dumps(doc))
    with pytest.raises(IntegrityError, match="not the list of files the capture sealed"):
        capture_state.verify(unit_dir, seal, unit="unit-0")
    capture_state.seal(unit_dir)  # restore a consistent list for the next check
    (unit_dir / "evidence.json").write_text('{"kind": "edited"}')
    with pytest.raises(IntegrityError, match="evidence"):
        capture_state.verify(unit_dir, seal, unit="unit-0")


def test_unlisted_images_symlinks_and_missing_files_are_refused(unit_dir: Path, tmp_path: Path):
    seal = capture_state.seal(unit_dir).to_json()
    planted = unit_dir / "criu" / "worker-0" / "fs-99.img"
    planted.write_bytes(b"x")
    with pytest.raises(IntegrityError, match=r"fs-99\.img"):
        capture_state.verify(unit_dir, seal, unit="unit-0")
    planted.unlink()
    (unit_dir / "criu" / "worker-0" / "restore.log").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(IntegrityError, match=r"not a regular file|symbolic"):
        capture_state.verify(unit_dir, seal, unit="unit-0")
    (unit_dir / "criu" / "worker-0" / "restore.log").unlink()
    (unit_dir / "logs" / "capture.log").unlink()
    with pytest.raises(IntegrityError, match="missing"):
        capture_state.verify(unit_dir, seal, unit="unit-0")


def test_an_artifact_without_a_seal_is_refused(unit_dir: Path):
    with pytest.raises(IntegrityError, match="records no digest"):
        capture_state.verify(unit_dir, None, unit="unit-0")


def test_a_record_written_by_another_user_is_not_trusted(unit_dir: Path):
    seal = capture_state.seal(unit_dir).to_json()
    time.sleep(0.05)
    capture_state.verify(unit_dir, seal, unit="unit-0")
    assert capture_state.verify(unit_dir, seal, unit="unit-0")["rehashed_files"] == 0
    os.chmod(unit_dir / capture_state.RECORD_FILE, 0o666)
    assert capture_state.verify(unit_dir, seal, unit="unit-0")["rehashed_files"] == 5


def test_a_capture_stopped_between_a_units_end_and_its_seal_is_not_complete(tmp_path):
    """Evidence without a seal is a capture cut short: a rerun refuses it (naming what to remove) instead
    of reporting an artifact that no restore could ever verify."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import StateLayout
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import EVIDENCE_FILE
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units import capture

    layout = StateLayout(tmp_path / "state")
    udir = layout.capture_unit("cap-9", "unit-0")
    udir.mkdir(parents=True)
    (udir / EVIDENCE_FILE).write_text("{}")
    with pytest.raises(ColdSnapError, match=r"never sealed.*remove"):
        capture._existing(layout, "cap-9", [{"id": "unit-0"}])


def test_files_hashed_while_extracted_are_not_read_again_and_still_checked(unit_dir: Path, monkeypatch):
    """A prepare that has just extracted the state from a capsule passes the digests it took from the
    bytes as it wrote them: those files are not read again, and a digest that is not the sealed one is
    still a refusal naming the file."""
    seal = capture_state.seal(unit_dir).to_json()
    listed = capture_state.listed_files(unit_dir)
    written = {rel: f["sha256"] for rel, f in listed.items()}
    real_sha = capture_state._sha256_file
    read_again: list[str] = []
    monkeypatch.setattr(capture_state, "_sha256_file",
                        lambda p: read_again.append(str(p)) or real_sha(p))
    stats = capture_state.verify(unit_dir, seal, unit="unit-0", written=written)
    assert stats["files"] == 5
    assert not [p for p in read_again if not p.endswith("evidence.json")], "an extracted file was hashed again"
    os.unlink(unit_dir / capture_state.RECORD_FILE)
    wrong = dict(written, **{"workers/worker-0/weights.blob": "sha256:" + "1" * 64})
    with pytest.raises(IntegrityError, match=r"weights\.blob"):
        capture_state.verify(unit_dir, seal, unit="unit-0", written=wrong)
    partial = {k: v for k, v in written.items() if k != "control/worker-0.json"}
    read_again.clear()
    capture_state.verify(unit_dir, seal, unit="unit-0", written=partial)
    assert any(p.endswith("control/worker-0.json") for p in read_again), "a file not extracted now is hashed"
