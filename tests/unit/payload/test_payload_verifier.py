"""The verifier: records, racy/stale evidence, quarantine, digest and path rules (FAULTS 4, 5, 7, 9)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import records
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.hydrate import MemorySink, hydrate_native
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.stage import StageSource, stage_payload
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import PayloadVerifier
from payload_testlib import BAD_DIGESTS, anon_views, capture, make_worker, write_pack_file


@pytest.fixture
def staged(tmp_path):
    """A pack placed by hand (no record yet), old enough not to be racy."""
    cache = NodeCache(tmp_path / "state")
    data = os.urandom(3 * 4096 + 17)
    digest = write_pack_file(tmp_path / "src.pack", data)
    path = cache.path_for(digest)
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    old = time.time_ns() - 10_000_000_000
    os.utime(path, ns=(old, old))
    return cache, digest, len(data), path


def _hash_first_then_reuse(cache, digest, size):
    v1 = PayloadVerifier().verify(cache, digest, size)
    v1.close()
    return v1


def test_absent_record_means_full_hash_then_reuse(staged):
    cache, digest, size, path = staged
    v1 = _hash_first_then_reuse(cache, digest, size)
    assert (v1.reused_record, v1.bytes_hashed, v1.record_written, v1.record_status) == (False, size, True, "absent")
    rec = records.record_path_for(path)
    assert rec.stat().st_mode & 0o777 == 0o600
    doc = json.loads(rec.read_text())
    assert doc["format"] == 1 and doc["kind"] == "coldsnap-payload-validation" and doc["sha256"] == digest
    assert set(doc["identity"]) == {"st_dev", "st_ino", "st_size", "st_mtime_ns", "st_ctime_ns"}
    with PayloadVerifier().verify(cache, digest, size) as v2:
        assert (v2.reused_record, v2.bytes_hashed) == (True, 0)


def test_racy_record_is_rechecked(staged):
    cache, digest, size, path = staged
    _hash_first_then_reuse(cache, digest, size)
    rec = records.record_path_for(path)
    doc = json.loads(rec.read_text())
    # observed in the same tick as the file's last change: proves nothing
    doc["observed_at_ns"] = max(doc["identity"]["st_mtime_ns"], doc["identity"]["st_ctime_ns"]) + 1000
    rec.write_text(json.dumps(doc))
    os.chmod(rec, 0o600)
    with PayloadVerifier().verify(cache, digest, size) as v:
        assert (v.record_status, v.reused_record, v.bytes_hashed) == ("racy", False, size)
    with PayloadVerifier().verify(cache, digest, size) as v:
        assert v.reused_record


@pytest.mark.parametrize("damage", ["mode", "malformed", "other-digest", "duplicate-key"])
def test_untrusted_or_malformed_record_means_rehash(staged, damage):
    cache, digest, size, path = staged
    _hash_first_then_reuse(cache, digest, size)
    rec = records.record_path_for(path)
    if damage == "mode":
        os.chmod(rec, 0o644)
    elif damage == "malformed":
        rec.write_text("{not json")
    elif damage == "other-digest":
        doc = json.loads(rec.read_text())
        doc["sha256"] = "sha256:" + "0" * 64
        rec.write_text(json.dumps(doc))
    else:
        rec.write_text(rec.read_text().replace('"format": 1', '"format": 1, "format": 1'))
    with PayloadVerifier().verify(cache, digest, size) as v:
        assert not v.reused_record and v.bytes_hashed == size


def test_byte_flip_with_mtime_put_back_is_caught_and_quarantined(staged):
    """FAULTS 4: ctime binding changes, full re-hash finds the flip, the file is quarantined."""
    cache, digest, size, path = staged
    _hash_first_then_reuse(cache, digest, size)
    ref = path.with_name("ref")
    subprocess.run(["touch", "-r", str(path), str(ref)], check=True)
    os.chmod(path, 0o644)
    with open(path, "r+b") as fh:
        fh.seek(5000)
        b = fh.read(1)
        fh.seek(5000)
        fh.write(bytes([b[0] ^ 0x01]))
    subprocess.run(["touch", "-r", str(ref), str(path)], check=True)
    assert path.stat().st_mtime_ns == ref.stat().st_mtime_ns
    assert records.check_record(records.record_path_for(path), digest[7:], size,
                                records.FileIdentity.of(path.stat())).status == "stale"
    with pytest.raises(IntegrityError) as err:
        PayloadVerifier().verify(cache, digest, size)
    moved = err.value.details["quarantined"]
    assert moved and str(moved) in str(err.value) and "quarantine" in str(err.value)
    assert not path.exists() and Path(moved).exists() and not records.record_path_for(path).exists()
    assert Path(moved).parent == cache.quarantine_dir


def test_new_inode_with_same_size_and_mtime_is_rehashed(staged):
    """FAULTS 5."""
    cache, digest, size, path = staged
    _hash_first_then_reuse(cache, digest, size)
    st = path.stat()
    twin = path.with_name("twin")
    twin.write_bytes(path.read_bytes())
    os.utime(twin, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.rename(twin, path)
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_ino != st.st_ino
    with PayloadVerifier().verify(cache, digest, size) as v:
        assert (v.reused_record, v.bytes_hashed, v.record_status) == (False, size, "stale")


def test_a_truncated_pack_is_refused_and_quarantined(staged):
    cache, digest, size, path = staged
    os.truncate(path, size - 17)
    with pytest.raises(IntegrityError, match=f"has {size - 17} bytes, the artifact says {size}"):
        PayloadVerifier().verify(cache, digest, size)
    assert not path.exists() and cache.quarantined()


def test_a_wrong_size_from_the_caller_leaves_an_intact_pack_in_the_cache(staged):
    """The pack is the object its name says; only the caller's size is wrong: refused, nothing moved
    (other captures share the object), and with a valid record not even hashed."""
    cache, digest, size, path = staged
    with pytest.raises(IntegrityError, match=f"with {size} bytes \\(verified\\), but the artifact says {size + 1}"
                       ".*intact") as exc:
        PayloadVerifier().verify(cache, digest, size + 1)
    assert exc.value.details["quarantined"] is None and "wrong_object" not in exc.value.details
    assert path.exists() and not cache.quarantined()
    _hash_first_then_reuse(cache, digest, size)  # now with a record
    seen = []
    with pytest.raises(IntegrityError, match="intact"):
        PayloadVerifier().verify(cache, digest, size - 1, progress=lambda d, t: seen.append(d))
    assert seen == [] and path.exists()
    with PayloadVerifier().verify(cache, digest, size) as ok:
        assert ok.reused_record


def test_a_record_that_cannot_be_written_does_not_fail_a_verified_pack(staged, monkeypatch):
    """A full disk (ENOSPC) after the hash: the pack is verified, only unrecorded (the next use re-hashes)."""
    import errno

    cache, digest, size, path = staged

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(records, "write_record", full)
    with PayloadVerifier().verify(cache, digest, size) as v:
        assert (v.reused_record, v.bytes_hashed, v.record_written) == (False, size, False)
    assert not records.record_path_for(path).exists() and path.exists()


def test_read_only_verification_writes_nothing(staged, tmp_path):
    cache, digest, size, path = staged
    before = sorted(p.name for p in cache.root.rglob("*"))
    with PayloadVerifier().verify(cache, digest, size, write_record=False) as v:
        assert not v.record_written and v.bytes_hashed == size
    assert sorted(p.name for p in cache.root.rglob("*")) == before
    with open(path, "r+b") as fh:  # flip the first byte (writing a fixed value may change nothing)
        first = fh.read(1)[0]
        fh.seek(0)
        fh.write(bytes([first ^ 0xFF]))
    with pytest.raises(IntegrityError, match="not quarantined"):
        PayloadVerifier().verify(cache, digest, size, write_record=False)
    assert path.exists()


def test_progress_is_reported_while_hashing(staged):
    cache, digest, size, _path = staged
    seen = []
    with PayloadVerifier().verify(cache, digest, size, progress=lambda d, t: seen.append((d, t))):
        pass
    assert seen and seen[-1] == (size, size)


def test_path_must_match_the_digest(staged, tmp_path):
    cache, digest, size, path = staged
    elsewhere = tmp_path / "x" / "model-weights.pack"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(path.read_bytes())
    with pytest.raises(IntegrityError, match="does not match its digest"):
        PayloadVerifier().verify(elsewhere, digest, size)
    other = cache.objects / ("0" * 64 + ".pack")
    os.link(path, other)
    with pytest.raises(IntegrityError, match="does not match its digest"):
        PayloadVerifier().verify(other, digest, size)


def test_symlinked_pack_is_refused(staged, tmp_path):
    cache, digest, size, path = staged
    real = tmp_path / "real.pack"
    os.rename(path, real)
    path.symlink_to(real)
    with pytest.raises(IntegrityError, match="symbolic link"):
        PayloadVerifier().verify(cache, digest, size)


def test_missing_pack_names_the_fix_and_creates_nothing(tmp_path):
    typo = tmp_path / "typo" / "state"  # a mistyped state root is not created by a verify that fails
    with pytest.raises(ColdSnapError, match="not present"):
        PayloadVerifier().verify(NodeCache(typo), "sha256:" + "a" * 64, 10)
    assert not (tmp_path / "typo").exists()


def test_a_fifo_at_the_pack_or_record_name_never_hangs_the_verifier(staged):
    """The verifier holds the digest's lock: a planted FIFO must not block it (and every stager) for ever."""
    cache, digest, size, path = staged
    record = records.record_path_for(path)
    os.mkfifo(record, 0o600)
    PayloadVerifier().verify(cache, digest, size).close()  # an unusable record: the pack is hashed instead
    assert records.record_path_for(path).is_file()  # and a real record replaces the FIFO
    path.unlink()
    os.mkfifo(path, 0o400)
    with pytest.raises(IntegrityError, match="not a regular file; it was moved to quarantine"):
        PayloadVerifier().verify(cache, digest, size)
    assert not os.path.lexists(path) and cache.quarantined(digest)


def test_a_lock_file_planted_as_a_link_is_never_followed(staged, tmp_path):
    cache, digest, size, _path = staged
    cache.locks.mkdir(parents=True, exist_ok=True)
    victim = tmp_path / "victim"
    (cache.locks / f"{digest.split(':')[1]}.lock").symlink_to(victim)
    with pytest.raises(ColdSnapError, match="is a symbolic link or not a regular file"):
        PayloadVerifier().verify(cache, digest, size)
    assert not os.path.lexists(victim)


def test_a_state_root_another_user_planted_in_a_world_writable_directory_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    planted = shared / "state"
    planted.mkdir()
    if os.geteuid() != 0:
        pytest.skip("needs root to give the planted root to another user")
    os.chown(planted, 65534, 65534)
    with pytest.raises(ColdSnapError, match="anyone may write to"):
        NodeCache(planted).ensure_dirs()
    assert not (planted / "model-payloads").exists()


@pytest.mark.parametrize("bad", BAD_DIGESTS)
def test_malformed_digests_are_refused_before_any_path_is_built(tmp_path, bad, monkeypatch):
    """FAULTS 7: through the cache, the verifier and the stager; nothing is created on disk."""
    import pathlib

    root = tmp_path / "state"
    built: list[str] = []
    real_truediv = pathlib.PurePath.__truediv__

    def spy(self, other):
        if isinstance(other, str) and (other.endswith((".pack", ".lock", ".json")) or bad in other):
            built.append(other)
        return real_truediv(self, other)

    monkeypatch.setattr(pathlib.PurePath, "__truediv__", spy)
    with pytest.raises(ColdSnapError):
        NodeCache(root).path_for(bad)
    with pytest.raises(ColdSnapError):
        PayloadVerifier().verify(NodeCache(root), bad, 10)
    with pytest.raises(ColdSnapError):
        stage_payload(root, bad, 10, StageSource("local", path=tmp_path / "x"))
    with pytest.raises(ColdSnapError):
        NodeCache(root).lock(bad).__enter__()
    assert built == [] and not root.exists()


def test_payload_swapped_after_verification_hydrates_the_verified_bytes(tmp_path):
    """FAULTS 9: hydration reads the verified fd; an in-place change is caught before memory is touched."""
    w = make_worker(tmp_path)
    wp, out, cache = capture(tmp_path, w)
    path = cache.path_for(wp.pack.sha256)
    original = path.read_bytes()
    v = PayloadVerifier().verify(cache, wp.pack.sha256, wp.pack.size)
    # swap: a new file with other bytes (same size) renamed over the verified name
    evil = path.with_name("evil")
    evil.write_bytes(bytes(b ^ 0xFF for b in original))
    os.rename(evil, path)
    views = anon_views(w)
    hydrate_native(out / "native-manifest.json", v, out / "weights.blob", MemorySink(views))
    for a in w.allocations:
        assert views[a.id][:] == bytes(w.buffers[a.id])
    v.close()


def test_payload_rewritten_in_place_after_verification_is_refused(tmp_path):
    w = make_worker(tmp_path)
    wp, out, cache = capture(tmp_path, w)
    path = cache.path_for(wp.pack.sha256)
    ref = path.with_name("ref")
    subprocess.run(["touch", "-r", str(path), str(ref)], check=True)
    v = PayloadVerifier().verify(cache, wp.pack.sha256, wp.pack.size)
    os.chmod(path, 0o644)
    with open(path, "r+b") as fh:
        fh.write(b"\x00")
    subprocess.run(["touch", "-r", str(ref), str(path)], check=True)  # even with the mtime put back
    views = anon_views(w)
    with pytest.raises(IntegrityError, match="changed after it was verified"):
        hydrate_native(out / "native-manifest.json", v, out / "weights.blob", MemorySink(views))
    assert all(views[a.id][:] == bytes([0xA5]) * a.size for a in w.allocations)
    v.close()


def test_first_look_reports_each_payload_and_never_raises(staged, tmp_path):
    """The restore's first look (host_facts payloads): verified, absent and corrupt side by side."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import first_look

    cache, digest, size, path = staged
    absent = "sha256:" + "ab" * 32
    # Check mode: the same answers, no record written, but reported as the change a real run makes.
    dry = first_look(cache.state_root, [{"sha256": digest, "size": size}, {"sha256": absent, "size": 4096}],
                     check_mode=True)
    assert dry[digest]["verified"] is True and dry[digest]["changed"] is True
    assert not records.record_path_for(path).exists()
    assert dry[absent]["verified"] is False and "not" in dry[absent]["msg"] and dry[absent]["changed"] is False
    # For real: the record is written (changed), a second look reuses it and changes nothing.
    first = first_look(cache.state_root, [{"sha256": digest, "size": size}], check_mode=False)
    assert (first[digest]["verified"], first[digest]["changed"], first[digest]["record_status"]) == (True, True, "absent")
    again = first_look(cache.state_root, [{"sha256": digest, "size": size}], check_mode=False)
    assert (again[digest]["changed"], again[digest]["record_reused"], again[digest]["bytes_hashed"]) == (False, True, 0)
    # One flipped byte: refused, quarantined (a change), never the verified pack.
    records.record_path_for(path).unlink()
    data = bytearray(path.read_bytes())
    data[5] ^= 1
    path.write_bytes(bytes(data))
    old = time.time_ns() - 10_000_000_000
    os.utime(path, ns=(old, old))
    dry_bad = first_look(cache.state_root, [{"sha256": digest, "size": size}], check_mode=True)[digest]
    assert dry_bad["verified"] is False and dry_bad["changed"] is True and path.exists()  # would quarantine
    bad = first_look(cache.state_root, [{"sha256": digest, "size": size}], check_mode=False)[digest]
    assert bad["verified"] is False and bad["changed"] is True and bad["quarantined"]
    assert not path.exists() and Path(bad["quarantined"]).is_file()


def test_a_killed_writers_temp_is_removed_before_a_new_writer_reserves_space(tmp_path):
    """FAULTS 1 and 3: the space a kill -9'd writer left in its temp is given back to the next writer
    (before its fallocate), never kept until some writer commits; a live writer's temp stays."""
    import fcntl

    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.writer import PackWriter

    cache = NodeCache(tmp_path / "state")
    cache.ensure_dirs()
    dead = cache.objects / ".incoming.pack.tmp-0123456789ab"
    dead.write_bytes(b"\0" * 8192)
    live = cache.objects / ".incoming.pack.tmp-ba9876543210"
    live.write_bytes(b"\0" * 8192)
    held = os.open(live, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        with PackWriter(cache, size=4096) as w:
            assert not dead.exists() and live.exists(), "the dead writer's temp goes first"
            w.write(b"\1" * 4096)
            w.commit()
    finally:
        os.close(held)


def test_staging_check_mode_refuses_a_local_source_a_real_run_would_refuse(tmp_path):
    """Check mode looks at a local source read-only: missing, not a file, or of another size is said
    the way a real run says it; nothing is written under the state root."""
    root = tmp_path / "state"
    sha = "sha256:" + "ab" * 32
    wrong_size = tmp_path / "wrong.pack"
    wrong_size.write_bytes(b"x" * 100)
    cases = ((tmp_path / "nope", ColdSnapError, "does not exist"), (tmp_path, ColdSnapError, "not a regular file"),
             (wrong_size, IntegrityError, "has 100 bytes"))
    for check_mode in (True, False):
        for path, error, needle in cases:
            with pytest.raises(error, match=needle):
                stage_payload(root, sha, 4096, StageSource("local", path=path), check_mode=check_mode)
        if check_mode:
            assert not root.exists()
    right = tmp_path / "right.pack"
    right.write_bytes(b"x" * 4096)
    assert stage_payload(root, sha, 4096, StageSource("local", path=right), check_mode=True).changed


def test_a_corrupt_pack_that_cannot_be_quarantined_is_removed_and_the_error_says_why(staged, monkeypatch):
    """No room for the quarantine directory (ENOSPC, no inode left): the wrong object still leaves the name of
    the right one, and the message names the real failure instead of blaming another file system."""
    import errno

    cache, digest, size, path = staged
    with open(path, "r+b") as fh:
        fh.seek(100)
        fh.write(b"\xff")

    def full(*_a, **_k):  # what NodeCache.quarantine's mkdir raises on a full file system
        raise OSError(errno.ENOSPC, "No space left on device", str(cache.quarantine_dir))

    monkeypatch.setattr(type(cache), "quarantine", full)
    with pytest.raises(IntegrityError, match=r"could not be quarantined \(No space left on device: .*quarantine\) "
                                             r"and was removed instead") as err:
        PayloadVerifier().verify(cache, digest, size)
    assert err.value.details["quarantined"] is None and err.value.details["wrong_object"]
    assert not path.exists() and not records.record_path_for(path).exists()


def _a_pack_beside_a_planted_link(tmp_path, planted: str):
    """A pack's directory in a user's tree (``model-payloads/sha256``) whose ``planted`` sibling is a link to
    a directory only root may write: (that directory, the pack's path, its digest, its bytes)."""
    elsewhere = tmp_path / "root-only"
    elsewhere.mkdir(mode=0o700)
    data = os.urandom(4096)
    digest = write_pack_file(tmp_path / "src.pack", data)
    path = tmp_path / "user" / "model-payloads" / "sha256" / f"{digest.split(':')[1]}.pack"
    path.parent.mkdir(parents=True)
    (path.parent.parent / planted).symlink_to(elsewhere)
    return elsewhere, path, digest, data


def test_a_link_planted_at_quarantine_of_a_pack_given_by_path_is_never_followed(tmp_path):
    """A pack given by its path lies in a directory its owner controls: a link planted at its ``quarantine``
    must not make the verifier (root) move the wrong bytes into the directory the link names."""
    elsewhere, path, digest, data = _a_pack_beside_a_planted_link(tmp_path, "quarantine")
    (path.parent.parent / "locks").mkdir()
    path.write_bytes(b"\x00" + data[1:])
    with pytest.raises(IntegrityError, match=r"could not be quarantined \(a link or a file where a directory of "
                                             r"its own belongs: .*quarantine\) and was removed instead") as err:
        PayloadVerifier().verify(path, digest, len(data))
    assert err.value.details["quarantined"] is None
    assert list(elsewhere.iterdir()) == [] and not path.exists()


def test_a_link_planted_at_locks_of_a_pack_given_by_path_is_never_followed(tmp_path):
    """A link planted at the ``locks`` directory of a pack given by its path made the verifier (root) create
    its lock file in the directory the link names; now the pack is verified read-only (no lock, no record)."""
    elsewhere, path, digest, data = _a_pack_beside_a_planted_link(tmp_path, "locks")
    path.write_bytes(data)
    with PayloadVerifier().verify(path, digest, len(data)) as v:
        assert v.as_result()["verified"] and not v.record_written
    assert list(elsewhere.iterdir()) == [] and not records.record_path_for(path).exists()
