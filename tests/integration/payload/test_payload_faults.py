"""FAULTS.md 1, 2, 3 and 6 for real: SIGKILLed writers, ENOSPC on a small tmpfs, racing workers."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import records
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.pack import (
    MemoryReader,
    write_worker_payload,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.stage import StageSource, stage_payload
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import PayloadVerifier
from payload_testlib import MODEL, make_worker

CHILD = Path(__file__).resolve().parent / "payload_child.py"


def _source(tmp_path: Path, size: int, seed: int = 7) -> tuple[Path, str]:
    data = random.Random(seed).randbytes(size)
    src = tmp_path / "export.pack"
    src.write_bytes(data)
    return src, "sha256:" + hashlib.sha256(data).hexdigest()


def _child(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(CHILD), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def _kill_at_random_offset(proc: subprocess.Popen, rng: random.Random) -> int:
    """Let the child report progress until a random point, then SIGKILL it mid-write."""
    killed_at = -1
    while True:
        line = proc.stdout.readline()
        assert line.startswith("progress "), f"child ended early: {line!r} {proc.stderr.read()}"
        done, total = map(int, line.split()[1:])
        if (done < total and rng.random() < 0.5) or done >= total - 1:
            os.kill(proc.pid, signal.SIGKILL)
            killed_at = done
            break
        proc.stdin.write("\n")
        proc.stdin.flush()
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    return killed_at


def _temps(cache: NodeCache) -> list[str]:
    return sorted(p.name for p in cache.objects.iterdir() if ".tmp-" in p.name) if cache.objects.exists() else []


@pytest.mark.parametrize("seed", [1, 2])
def test_kill9_of_a_stager_at_a_random_offset(tmp_path, seed):
    """FAULTS 1 (staging): nothing under the final name; the rerun cleans the temp and succeeds."""
    size = 40 << 20
    src, digest = _source(tmp_path, size)
    state = tmp_path / "state"
    cache = NodeCache(state)
    proc = _child("stage", str(state), digest, str(size), str(src), "--step")
    _kill_at_random_offset(proc, random.Random(seed))
    assert not cache.path_for(digest).exists() and not cache.record_path_for(digest).exists()
    assert len(_temps(cache)) == 1, "the killed writer's partial file stays under its temporary name"
    r = stage_payload(state, digest, size, StageSource("local", path=src))
    assert r.changed and r.bytes_copied == size
    assert _temps(cache) == []
    with PayloadVerifier().verify(cache, digest, size) as v:
        assert v.reused_record


def test_kill9_of_a_capture_writer(tmp_path):
    """FAULTS 1 (capture: digest unknown while writing): the dead temp is cleaned by the next write."""
    state = tmp_path / "state"
    cache = NodeCache(state)
    proc = _child("capture", str(state), str(tmp_path / "unit"), "3", "--step")
    # progress covers pass 1 (model bytes), the residual, then the pack: kill inside the pack phase
    model_bytes = sum(e.size for e in make_worker(tmp_path / "probe", seed=3).extents)
    while True:
        line = proc.stdout.readline()
        assert line.startswith("progress"), proc.stderr.read()
        done, total = map(int, line.split()[1:])
        if total - model_bytes < done < total:
            break
        proc.stdin.write("\n")
        proc.stdin.flush()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert [p for p in cache.objects.iterdir() if p.name.endswith(".pack")] == []
    assert len(_temps(cache)) == 1 and _temps(cache)[0].startswith(".incoming.pack.tmp-")
    w = make_worker(tmp_path / "again", seed=3)
    wp = write_worker_payload(tmp_path / "unit2", w.allocations, w.extents, MemoryReader(w.buffers),
                              export_pack=True, cache=cache, model=MODEL)
    assert _temps(cache) == [] and cache.path_for(wp.pack.sha256).is_file()


def test_kill9_between_rename_and_record_means_rehash(tmp_path):
    """FAULTS 2."""
    size = 5 << 20
    src, digest = _source(tmp_path, size)
    state = tmp_path / "state"
    cache = NodeCache(state)
    proc = _child("stage", str(state), digest, str(size), str(src), "--die-before-record")
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert cache.path_for(digest).is_file() and not cache.record_path_for(digest).exists()
    with PayloadVerifier().verify(cache, digest, size) as v:
        assert (v.record_status, v.reused_record, v.bytes_hashed, v.record_written) == ("absent", False, size, True)
    with PayloadVerifier().verify(cache, digest, size) as v:
        assert v.reused_record


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_enospc_while_staging_then_success_once_space_is_freed(tmp_path):
    """FAULTS 3: clear error, temp removed, no record; succeeds after space is freed."""
    size = 6 << 20
    src, digest = _source(tmp_path, size)
    with small_tmpfs(tmp_path / "small", "8m") as fs:
        filler = fs / "filler"
        filler.write_bytes(bytes(5 << 20))
        cache = NodeCache(fs / "state")
        with pytest.raises(ColdSnapError, match="no space left") as err:
            stage_payload(fs / "state", digest, size, StageSource("local", path=src))
        assert "free space" in str(err.value)
        assert _temps(cache) == [] and not cache.path_for(digest).exists()
        assert not cache.record_path_for(digest).exists()
        filler.unlink()
        r = stage_payload(fs / "state", digest, size, StageSource("local", path=src))
        assert r.changed and cache.record_path_for(digest).exists()


def test_enospc_while_writing_capture_outputs(tmp_path):
    """FAULTS 3 for the capture writer: the residual blob (no preallocation) and the pack both fail cleanly."""
    w = make_worker(tmp_path, seed=4)
    big = bytearray(random.Random(1).randbytes(3 << 20))
    w.buffers["arena1"] += big  # a large residual tail on the highest allocation
    w.allocations[1] = replace(w.allocations[1], size=len(w.buffers["arena1"]))
    with small_tmpfs(tmp_path / "small", "2m") as fs:
        cache = NodeCache(fs / "state")
        with pytest.raises(ColdSnapError, match="no space left"):
            write_worker_payload(fs / "unit", w.allocations, w.extents, MemoryReader(w.buffers), export_pack=True,
                                 cache=cache, model=MODEL)
        left = [p.name for p in (fs / "unit").iterdir()] if (fs / "unit").exists() else []
        assert left == [], "no partial residual blob may remain"
    with small_tmpfs(tmp_path / "small2", "3200k") as fs:
        (fs / "filler").write_bytes(bytes((3200 - 12) << 10))  # leaves less room than the pack needs
        cache = NodeCache(fs / "state")
        out = tmp_path / "unit-on-disk"
        with pytest.raises(ColdSnapError, match="no space left"):
            write_worker_payload(out, w.allocations, w.extents, MemoryReader(w.buffers), export_pack=True,
                                 cache=cache, model=MODEL)
        assert _temps(cache) == [] and [p for p in cache.objects.iterdir() if p.suffix == ".pack"] == []
        (fs / "filler").unlink()  # space freed: the same capture writes its pack
        write_worker_payload(out, w.allocations, w.extents, MemoryReader(w.buffers), export_pack=True,
                             cache=cache, model=MODEL)
        assert _temps(cache) == [] and len([p for p in cache.objects.iterdir() if p.suffix == ".pack"]) == 1


def test_two_workers_staging_one_digest_converge_without_torn_bytes(tmp_path):
    """FAULTS 6: one writes, the other waits on the per-digest lock and reuses it."""
    size = 48 << 20
    src, digest = _source(tmp_path, size)
    state = tmp_path / "state"
    cache = NodeCache(state)
    final = cache.path_for(digest)
    go = tmp_path / "go"
    procs = [_child("stage", str(state), digest, str(size), str(src), "--go-file", str(go)) for _i in range(2)]
    seen: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        # Whenever the final name exists it must hold the complete, correct bytes.
        while not stop.is_set():
            try:
                data = final.read_bytes()
            except FileNotFoundError:
                time.sleep(0.002)
                continue
            seen.append("sha256:" + hashlib.sha256(data).hexdigest())

    watcher = threading.Thread(target=watch)
    watcher.start()
    time.sleep(0.3)  # both children imported and waiting
    go.touch()
    results = []
    try:
        for p in procs:
            out, errs = p.communicate(timeout=120)
            assert p.returncode == 0, errs
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        stop.set()
        watcher.join()
    assert sorted(r["changed"] for r in results) == [False, True]
    writer = next(r for r in results if r["changed"])
    waiter = next(r for r in results if not r["changed"])
    assert writer["bytes_copied"] == size and waiter["bytes_copied"] == 0 and waiter["record_reused"]
    assert seen and set(seen) == {digest}
    assert _temps(cache) == []


def test_duplicate_capture_workers_converge_on_one_object(tmp_path):
    """Data-parallel workers with identical bytes write one object; the second reuses it."""
    state = tmp_path / "state"
    go = tmp_path / "go"
    procs = [_child("capture", str(state), str(tmp_path / f"unit{i}"), "5", "--go-file", str(go)) for i in range(2)]
    time.sleep(0.3)
    go.touch()
    results = []
    for p in procs:
        out, errs = p.communicate(timeout=120)
        assert p.returncode == 0, errs
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0]["sha256"] == results[1]["sha256"]
    assert sorted(r["reused"] for r in results) == [False, True]
    cache = NodeCache(state)
    packs = [p.name for p in cache.objects.iterdir() if p.name.endswith(".pack")]
    assert packs == [results[0]["sha256"][7:] + ".pack"] and _temps(cache) == []
    assert records.check_record(cache.record_path_for(results[0]["sha256"]), results[0]["sha256"][7:],
                                results[0]["size"],
                                records.FileIdentity.of(cache.path_for(results[0]["sha256"]).stat())).valid


def test_enospc_while_staging_from_a_peer(tmp_path, monkeypatch):
    """FAULTS 3 for a host-to-host stage: too little space is refused before any byte is fetched;
    a disk that fills during the transfer ends in the same clear error, and the half file is removed
    (a partial kept on a full disk would fail every other write there). Then it succeeds."""
    import secrets as _secrets

    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import stage as stage_mod
    from ansible_collections.coldsnap.fleet.plugins.module_utils.transfer.server import (
        PeerServer,
        bind,
        file_table,
    )

    data = os.urandom(3 << 20)
    hexd = hashlib.sha256(data).hexdigest()
    src = tmp_path / "src"
    src.mkdir()
    (src / f"{hexd}.pack").write_bytes(data)
    token = _secrets.token_hex(32)
    server = PeerServer(bind("127.0.0.1", 0), file_table(src), token)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    source = StageSource("peer", token=token, address="127.0.0.1", port=server.server_address[1])
    try:
        with small_tmpfs(tmp_path / "small", "4m") as fs:
            filler = fs / "filler"
            filler.write_bytes(bytes(2 << 20))
            cache = NodeCache(fs / "state")
            with pytest.raises(ColdSnapError, match=r"no space on the file system .* bytes needed") as early:
                stage_payload(fs / "state", f"sha256:{hexd}", len(data), source)
            assert "free space" in str(early.value) and token not in str(early.value)
            assert not stage_mod.peer_partial(cache, hexd).exists()
            monkeypatch.setattr(stage_mod, "_free_bytes", lambda _p: None)  # a file system that cannot tell
            with pytest.raises(ColdSnapError, match="no space left") as late:
                stage_payload(fs / "state", f"sha256:{hexd}", len(data), source)
            assert "partial file was removed" in str(late.value)
            assert not stage_mod.peer_partial(cache, hexd).exists() and not cache.path_for(f"sha256:{hexd}").exists()
            filler.unlink()
            done = stage_payload(fs / "state", f"sha256:{hexd}", len(data), source)
            assert done.changed and done.path.read_bytes() == data
    finally:
        server.shutdown()
