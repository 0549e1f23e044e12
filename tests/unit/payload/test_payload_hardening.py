"""Payload faults the audit found: build outputs that never mix, space and permission errors that name
the object, explicit-path verification that leaves the user's directories alone, stage sources that
cannot hang the digest's lock, and killed verifiers' record temps cleaned (FAULTS 1-3, 6)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common import fsutil
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import records
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import (
    MANIFEST_NAME,
    REPLAY_PLAN_NAME,
    RESIDUAL_NAME,
    pack_relpath,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.pack import (
    MemoryReader,
    write_worker_payload,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.stage import StageSource, stage_payload
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import (
    STAGE_FIX,
    PayloadVerifier,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.writer import PackWriter
from payload_testlib import MODEL, make_worker, outcome_within, write_pack_file

NOBODY = 65534
OUTPUTS = sorted([RESIDUAL_NAME, MANIFEST_NAME, REPLAY_PLAN_NAME])


def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (a tmpfs mount, or another user's view of the files)")


@contextlib.contextmanager
def _tmpfs(path: Path, options: str):
    """A small tmpfs mounted at ``path`` for the block (root only)."""
    _needs_root()
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True,
                       check=False)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def open_dir():
    """A directory every user may traverse (tmp_path lies below a 0700 directory of root's)."""
    _needs_root()
    d = Path(tempfile.mkdtemp(prefix="coldsnap-test-", dir="/tmp"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _as_other_user(fn) -> tuple[str, str, str | None]:
    """Run ``fn()`` in a forked child as uid/gid 65534; (exception type or 'ok', message, fix)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
            try:
                out = ["ok", repr(fn()), None]
            except BaseException as exc:  # reported to the parent
                out = [type(exc).__name__, str(exc), getattr(exc, "fix", None)]
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    kind, msg, fix = json.loads(data)
    return kind, msg, fix


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _staged_pack(state: Path, n: int = 8192) -> tuple[NodeCache, str, int, Path]:
    """A pack placed by hand (no record), old enough not to be racy."""
    cache = NodeCache(state)
    data = os.urandom(n)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    path = cache.path_for(digest)
    write_pack_file(path, data)
    old = time.time_ns() - 10_000_000_000
    os.utime(path, ns=(old, old))
    return cache, digest, n, path


# ----------------------------------------------------------------- 1: build outputs never mix
def test_no_space_for_the_manifest_is_a_clear_error_and_the_previous_outputs_stay_whole(tmp_path):
    first, second = make_worker(tmp_path / "w1", seed=1), make_worker(tmp_path / "w2", seed=7)
    residual2 = sum(a.size for a in second.allocations) - sum(e.size for e in second.extents)
    with _tmpfs(tmp_path / "small", "size=1m") as fs:
        out = fs / "out"
        write_worker_payload(out, first.allocations, first.extents, MemoryReader(first.buffers), export_pack=False,
                             cache=None, model=MODEL)
        before = _files(out)
        assert sorted(before) == OUTPUTS
        vfs = os.statvfs(fs)
        pages = -(-residual2 // vfs.f_frsize)
        filler = fs / "filler"
        filler.write_bytes(bytes((vfs.f_bavail - pages) * vfs.f_frsize))  # the new blob fits, its manifest not
        with pytest.raises(ColdSnapError, match="no space left") as err:
            write_worker_payload(out, second.allocations, second.extents, MemoryReader(second.buffers),
                                 export_pack=False, cache=None, model=MODEL)
        assert MANIFEST_NAME in str(err.value) and "free space" in str(err.value)
        assert _files(out) == before, "the previous outputs stay as they were: no new blob beside the old manifest"
        filler.unlink()
        wp = write_worker_payload(out, second.allocations, second.extents, MemoryReader(second.buffers),
                                  export_pack=False, cache=None, model=MODEL)
        after = _files(out)
        assert sorted(after) == OUTPUTS and after[RESIDUAL_NAME] != before[RESIDUAL_NAME]
        manifest = json.loads(after[MANIFEST_NAME])
        assert manifest["residual"]["sha256"] == "sha256:" + hashlib.sha256(after[RESIDUAL_NAME]).hexdigest()
        assert wp.residual.sha256 == manifest["residual"]["sha256"]


def test_a_pack_that_fails_after_the_blob_leaves_the_previous_outputs_whole(tmp_path):
    first, second = make_worker(tmp_path / "w1", seed=1), make_worker(tmp_path / "w2", seed=7)
    cache = NodeCache(tmp_path / "state")
    out = tmp_path / "unit"
    write_worker_payload(out, first.allocations, first.extents, MemoryReader(first.buffers), export_pack=True,
                         cache=cache, model=MODEL)
    before = _files(out)

    class Drifting(MemoryReader):
        """An engine that was not quiesced: after the first pass (and the blob) its weights change."""

        reads = 0

        def read(self, allocation, offset, size):
            self.reads += 1
            if self.reads == len(second.extents) + 1:
                e = second.extents[0]
                second.buffers[e.allocation][e.offset] ^= 1
            return super().read(allocation, offset, size)

    with pytest.raises(IntegrityError, match="changed while the pack was written"):
        write_worker_payload(out, second.allocations, second.extents, Drifting(second.buffers), export_pack=True,
                             cache=cache, model=MODEL)
    assert _files(out) == before


def test_a_state_root_that_cannot_hold_the_pack_fails_before_any_output_is_written(tmp_path):
    w = make_worker(tmp_path)
    (tmp_path / "statefile").write_text("x")
    out = tmp_path / "unit"
    with pytest.raises(OSError):
        write_worker_payload(out, w.allocations, w.extents, MemoryReader(w.buffers), export_pack=True,
                             cache=NodeCache(tmp_path / "statefile"), model=MODEL)
    assert not out.exists()


# --------------------------------------------------- 2: what verify says it cannot see or use
def test_a_user_who_cannot_read_the_state_root_is_told_so_not_to_stage_again(open_dir):
    cache, digest, size, _path = _staged_pack(open_dir / "state")
    os.chmod(open_dir / "state", 0o700)  # root's, private
    kind, msg, fix = _as_other_user(lambda: PayloadVerifier().verify(cache, digest, size).close())
    assert kind == "ColdSnapError", msg
    assert "permission denied" in msg and str(cache.path_for(digest)) in msg and "not present" not in msg
    assert fix == "run as the state root's owner (or root)"


def test_a_socket_at_the_pack_name_is_not_a_regular_file(tmp_path, monkeypatch):
    cache, digest, size, path = _staged_pack(tmp_path / "state")
    path.unlink()
    monkeypatch.chdir(path.parent)  # a socket's path must be short
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(path.name)
        with pytest.raises(IntegrityError, match="is not a regular file"):
            PayloadVerifier().verify(cache, digest, size)


# ------------------------------------- 3: verifying a file never changes the user's directories
def test_verifying_a_pack_by_its_path_leaves_the_directories_above_it_as_they_were(tmp_path):
    repo = tmp_path / "snapshot"  # e.g. a downloaded repository that mirrors model-payloads/sha256/<hex>.pack
    data = os.urandom(8192)
    digest = write_pack_file(repo / pack_relpath(hashlib.sha256(data).hexdigest()), data)
    path = repo / pack_relpath(digest[7:])
    os.chmod(repo, 0o755)
    before = sorted(str(p.relative_to(repo)) for p in repo.rglob("*"))
    with PayloadVerifier().verify(path, digest, len(data)) as v:
        assert v.bytes_hashed == len(data) and not v.record_written
    assert stat.S_IMODE(os.stat(repo).st_mode) == 0o755
    assert sorted(str(p.relative_to(repo)) for p in repo.rglob("*")) == before, "no lock or record directory made"


def test_a_pack_path_inside_a_state_root_is_locked_and_recorded_without_a_chmod(tmp_path):
    cache, digest, size, path = _staged_pack(tmp_path / "state")
    cache.ensure_dirs()
    os.chmod(cache.state_root, 0o755)
    with PayloadVerifier().verify(path, digest, size) as v:
        assert v.record_written
    assert stat.S_IMODE(os.stat(cache.state_root).st_mode) == 0o755
    assert (cache.locks / f"{digest[7:]}.lock").is_file()


def test_cli_verify_by_path_keeps_the_directory_mode(tmp_path):
    repo = tmp_path / "snapshot"
    data = os.urandom(4096)
    digest = write_pack_file(repo / pack_relpath(hashlib.sha256(data).hexdigest()), data)
    os.chmod(repo, 0o755)
    r = subprocess.run([sys.executable, "-m", "coldsnap.cli", "payload", "verify", "--path",
                        str(repo / pack_relpath(digest[7:])), "--sha256", digest, "--size", str(len(data))],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["verified"] is True
    assert stat.S_IMODE(os.stat(repo).st_mode) == 0o755


# --------------------------------------------------- 4: local sources that cannot be used
def test_a_fifo_as_local_source_is_refused_before_the_lock_and_never_hangs(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    state = tmp_path / "state"
    digest = "sha256:" + hashlib.sha256(b"x" * 4096).hexdigest()
    outcome = outcome_within(lambda: stage_payload(state, digest, 4096, StageSource("local", path=fifo),
                                                   lock_timeout=2), 20, fifo=fifo)
    assert isinstance(outcome, ColdSnapError) and "not a regular file" in str(outcome)
    assert str(fifo) in str(outcome)
    assert not state.exists(), "refused before the digest's lock (and the state root) was made"


def test_an_unreadable_local_source_names_the_file_and_the_fix(open_dir):
    data = os.urandom(4096)
    src = open_dir / "export.pack"
    src.write_bytes(data)
    os.chmod(src, 0o600)  # root's: the other user cannot read it
    state = open_dir / "state"
    state.mkdir(mode=0o700)
    os.chown(state, NOBODY, NOBODY)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    checked = _as_other_user(lambda: stage_payload(state, digest, len(data), StageSource("local", path=src),
                                                   check_mode=True))
    kind, msg, fix = _as_other_user(lambda: stage_payload(state, digest, len(data), StageSource("local", path=src)))
    assert checked == (kind, msg, fix), "check mode says what the real run says"
    assert kind == "ColdSnapError", msg
    assert str(src) in msg and "permission denied" in msg
    assert fix == "make it readable by this user"
    assert not NodeCache(state).path_for(digest).exists()


def _export_and_cache(open_dir: Path) -> tuple[Path, Path, NodeCache, str, int]:
    """A pack to stage that every user may read, and root's state root with its node cache made."""
    data = os.urandom(4096)
    src = open_dir / "export.pack"
    src.write_bytes(data)
    os.chmod(src, 0o644)
    state = open_dir / "state"
    cache = NodeCache(state)
    cache.ensure_dirs()  # root's
    return src, state, cache, "sha256:" + hashlib.sha256(data).hexdigest(), len(data)


def _stage_as_nobody(state: Path, digest: str, size: int, src: Path, **kw) -> tuple[str, str, str | None]:
    return _as_other_user(lambda: stage_payload(state, digest, size, StageSource("local", path=src), **kw).changed)


def test_a_node_cache_another_user_made_is_named_with_its_owner_not_a_bare_permission_error(open_dir):
    """The user's own state root, whose cache directories an earlier run as root (sudo) made."""
    src, state, cache, digest, size = _export_and_cache(open_dir)
    os.chown(state, NOBODY, NOBODY)
    os.chown(cache.root, NOBODY, NOBODY)
    checked = _stage_as_nobody(state, digest, size, src, check_mode=True)
    kind, msg, fix = _stage_as_nobody(state, digest, size, src)
    assert checked == (kind, msg, fix), "check mode says what the real run says"
    assert kind == "ColdSnapError", msg
    assert f"{cache.objects} (uid 0), {cache.locks} (uid 0) cannot be written" in msg and "permission denied" in msg
    assert fix == f"run as the state root's owner (or root), or give this user the node cache (chown -R {NOBODY} " \
                  f"{cache.root})"
    for theirs in (cache.objects, cache.locks):
        os.chown(theirs, NOBODY, NOBODY)
    assert _stage_as_nobody(state, digest, size, src)[:2] == ("ok", "True")


def test_a_node_cache_given_to_a_user_in_a_state_root_it_cannot_write_stages(open_dir):
    """A shared layout: root's state root, the node cache below it handed to the user who stages."""
    src, state, cache, digest, size = _export_and_cache(open_dir)
    os.chmod(state, 0o755)  # root's, not writable by the user
    subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(cache.root)], check=True)
    assert _stage_as_nobody(state, digest, size, src, check_mode=True)[:2] == ("ok", "True")
    assert _stage_as_nobody(state, digest, size, src)[:2] == ("ok", "True")


def test_a_staged_pack_is_reused_whatever_became_of_its_source(tmp_path):
    data = os.urandom(4096)
    src = tmp_path / "export.pack"
    src.write_bytes(data)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert stage_payload(tmp_path / "state", digest, len(data), StageSource("local", path=src)).changed
    src.unlink()
    os.mkfifo(src)
    assert not stage_payload(tmp_path / "state", digest, len(data), StageSource("local", path=src)).changed


# ----------------------------------------- 5: a killed verifier's record temp is cleaned
def test_a_record_temp_of_a_killed_verifier_is_removed_by_the_next_verify(tmp_path):
    cache, digest, size, path = _staged_pack(tmp_path / "state")
    record = records.record_path_for(path)
    code = f"""
import os, signal, sys
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import PayloadVerifier
def killed(*a, **k):  # SIGKILL between the record temp's fsync and its rename
    os.kill(os.getpid(), signal.SIGKILL)
os.replace = killed
PayloadVerifier().verify(NodeCache({str(cache.state_root)!r}), {digest!r}, {size})
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.returncode == -9, r.stderr
    temps = [p for p in cache.objects.iterdir() if fsutil.is_temp_name(p.name)]
    assert [p.name.startswith(f".{record.name}.tmp-") for p in temps] == [True]
    # Another digest's writer is alive: its temp (flocked) must survive the cleaning.
    with PackWriter(cache, size=4096) as live:
        with PayloadVerifier().verify(cache, digest, size) as v:
            assert v.record_written
        left = sorted(p.name for p in cache.objects.iterdir() if fsutil.is_temp_name(p.name))
        assert left == [live.tmp.name]
    assert record.is_file()


# ------------------------------------------- 6: no space or no inodes names the cache
def test_no_inodes_left_names_the_cache_not_a_temp(tmp_path):
    with _tmpfs(tmp_path / "small", "size=4m,nr_inodes=64") as fs:
        cache, digest, size, _path = _staged_pack(fs / "state")
        cache.ensure_dirs()
        fill = fs / "fill"
        fill.mkdir()
        with pytest.raises(OSError) as full:  # every inode taken
            for i in range(10_000):
                (fill / str(i)).touch()
        assert full.value.errno == errno.ENOSPC
        with pytest.raises(ColdSnapError, match="no space left") as err:
            with PackWriter(cache, size=4096):
                pass
        assert str(cache.objects) in str(err.value) and ".tmp-" not in str(err.value)
        with pytest.raises(ColdSnapError, match="no space left") as err:
            with cache.lock(digest):
                pass
        assert str(cache.locks) in str(err.value)
        with pytest.raises(ColdSnapError, match="no space left") as err:
            NodeCache(fs / "other").ensure_dirs()
        assert str(fs / "other" / "model-payloads") in str(err.value)
        # A verification goes on without lock or record on a full file system, as before.
        with PayloadVerifier().verify(cache, digest, size) as v:
            assert v.bytes_hashed == size and not v.record_written


# ------------------------------------------------------------------------ 7: messages
def _coldsnap(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coldsnap.cli", *args], capture_output=True, text=True,
                          check=False)


def test_inspect_of_a_dangling_symlink_says_it_is_a_link(tmp_path):
    link = tmp_path / "state" / pack_relpath("ab" * 32)
    link.parent.mkdir(parents=True)
    link.symlink_to(tmp_path / "nowhere")
    r = _coldsnap("payload", "inspect", str(link))
    assert r.returncode == 2 and "symbolic link" in r.stderr and "refused" in r.stderr, r.stderr
    assert "does not exist" not in r.stderr and "Traceback" not in r.stderr


def test_build_with_a_directory_as_bytes_file_says_so(tmp_path):
    w = make_worker(tmp_path)
    allocs = []
    for a in w.allocations:
        (tmp_path / f"{a.id}.bin").write_bytes(bytes(w.buffers[a.id]))
        allocs.append({"id": a.id, "address": a.address, "size": a.size, "bytes": f"{a.id}.bin"})
    allocs[0]["bytes"] = "adir"
    (tmp_path / "adir").mkdir()
    desc = {"model": MODEL, "allocations": allocs, "extents": []}
    (tmp_path / "desc.json").write_text(json.dumps(desc))
    r = _coldsnap("payload", "build", "--description", str(tmp_path / "desc.json"), "--out", str(tmp_path / "o"),
                  "--no-pack")
    assert r.returncode == 2 and "is a directory" in r.stderr and str(tmp_path / "adir") in r.stderr, r.stderr
    assert "missing or shorter" not in r.stderr and not (tmp_path / "o").exists()


def test_a_multi_pack_failure_says_its_fix_once(tmp_path):
    cache = NodeCache(tmp_path / "state")
    packs = [(cache, "sha256:" + c * 64, 10) for c in "ab"]
    with pytest.raises(ColdSnapError) as err:
        PayloadVerifier().verify_many(packs)
    text = str(err.value)
    assert "2 of 2 model payloads failed" in text and text.count(STAGE_FIX) == 1, text


def test_a_document_or_pack_this_user_cannot_read_says_what_to_do(open_dir):
    from coldsnap.commands._io import read_input
    from coldsnap.commands.payload import _inspect_pack

    doc = open_dir / "manifest.json"
    doc.write_text("{}")
    os.chmod(doc, 0o600)  # root's
    kind, msg, fix = _as_other_user(lambda: read_input(str(doc)))
    assert kind == "ColdSnapError" and str(doc) in msg and "permission denied" in msg, msg
    assert fix == "make it readable by this user, or run as its owner (or root)"
    cache, _digest, _size, path = _staged_pack(open_dir / "state")
    os.chmod(cache.state_root, 0o700)
    kind, msg, fix = _as_other_user(lambda: _inspect_pack(path, False))
    assert kind == "ColdSnapError" and str(path) in msg and "permission denied" in msg, msg
    assert fix == "run as the state root's owner (or root)"


def test_the_cache_directories_are_private_whatever_the_umask(tmp_path):
    # Below the 0700 state root every directory is 0700 too: pack and lock names tell what the host serves.
    cache = NodeCache(tmp_path / "state")
    old = os.umask(0o022)
    try:
        cache.ensure_dirs()
    finally:
        os.umask(old)
    for d in (cache.state_root, cache.root, cache.objects, cache.locks):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
