"""Several packs verified at once, and the two hashing paths of streams.hash_fd (behaviour only, never speed)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import streams
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import PayloadVerifier

# Sizes around the chunk sizes of both paths: empty, under one buffer, exact multiples, one byte over.
SIZES = [0, 1, 4095, streams.INLINE_CHUNK, streams.INLINE_CHUNK + 1, streams.HASH_CHUNK * 7, 2 * streams.CHUNK + 17]


def _packs(tmp_path, sizes, *, seed=0):
    """Packs placed in a node cache by hand (no record), old enough not to be racy."""
    cache = NodeCache(tmp_path / "state")
    out = []
    for i, size in enumerate(sizes):
        data = (hashlib.sha256(f"{seed}/{i}".encode()).digest() * (size // 32 + 1))[:size]
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        path = cache.path_for(digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        old = time.time_ns() - 10_000_000_000
        os.utime(path, ns=(old, old))
        out.append((path, digest, size))
    return cache, out


@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("size", SIZES)
def test_both_hash_paths_hash_every_byte(tmp_path, size, pipelined):
    data = os.urandom(size)
    path = tmp_path / "f"
    path.write_bytes(data + b"tail that is not hashed")
    calls = []
    fd = os.open(path, os.O_RDONLY)
    try:
        got = streams.hash_fd(fd, size, progress=lambda d, t: calls.append((d, t)), pipelined=pipelined)
        assert got == hashlib.sha256(data).hexdigest()
        if size > 3:
            half = size // 2
            assert streams.hash_fd(fd, size - half, offset=half, pipelined=pipelined) == \
                hashlib.sha256(data[half:]).hexdigest()
    finally:
        os.close(fd)
    assert calls and calls[-1] == (size, size)
    assert [d for d, _t in calls] == sorted(d for d, _t in calls)


@pytest.mark.parametrize("pipelined", [True, False])
def test_both_hash_paths_report_truncation_the_same_way(tmp_path, pipelined):
    path = tmp_path / "short"
    path.write_bytes(b"x" * (streams.INLINE_CHUNK + 5))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(IntegrityError, match=r"^model payload X ended after 262149 bytes while reading") as exc:
            streams.hash_fd(fd, streams.CHUNK + 1, what="model payload X", pipelined=pipelined)
    finally:
        os.close(fd)
    assert "truncated" in str(exc.value)


def test_default_jobs_is_the_usable_cpus():
    assert streams.default_jobs() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("jobs", [None, 1, 3, 64])
def test_verify_many_verifies_every_pack_and_writes_records(tmp_path, jobs):
    cache, packs = _packs(tmp_path, [4096 * (i + 1) + i for i in range(6)])
    seen = []
    lock = threading.Lock()

    def progress(done, total):
        with lock:
            seen.append((done, total))

    verified = PayloadVerifier().verify_many([(cache, d, s) for _p, d, s in packs], jobs=jobs, progress=progress)
    try:
        assert [v.sha256 for v in verified] == [d for _p, d, _s in packs]
        assert all(not v.reused_record and v.bytes_hashed == v.size and v.record_written for v in verified)
        assert all(os.fstat(v.fd).st_ino == os.stat(p).st_ino for v, (p, _d, _s) in zip(verified, packs, strict=True))
    finally:
        for v in verified:
            v.close()
    total = sum(s for _p, _d, s in packs)
    assert seen[-1] == (total, total) and all(t == total for _d, t in seen)
    # Second run: every record is reused, nothing hashed.
    again = PayloadVerifier().verify_many(list(packs), jobs=jobs)
    assert all(v.reused_record and v.bytes_hashed == 0 for v in again)
    for v in again:
        v.close()


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_verify_many_names_the_one_corrupt_pack_and_quarantines_only_it(tmp_path, where):
    cache, packs = _packs(tmp_path, [3 * 4096 + 7, 5 * 4096, 2 * streams.CHUNK + 3, 4096])
    bad = {"first": 0, "middle": 2, "last": 3}[where]
    path, digest, size = packs[bad]
    with open(path, "r+b") as fh:  # flip one byte near the end (past every chunk boundary)
        fh.seek(size - 2)
        byte = fh.read(1)
        fh.seek(size - 2)
        fh.write(bytes([byte[0] ^ 0x01]))
    opened_before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(IntegrityError) as exc:
        PayloadVerifier().verify_many([(cache, d, s) for _p, d, s in packs], jobs=4)
    msg = str(exc.value)
    assert str(path) in msg and f"not {digest}" in msg and "quarantine" in msg
    assert exc.value.details["quarantined"]
    for i, (p, _d, _s) in enumerate(packs):
        assert p.exists() == (i != bad)
        if i != bad:
            assert str(p) not in msg
    assert len(os.listdir("/proc/self/fd")) == opened_before  # the packs that passed were closed


def test_verify_many_reports_every_failure_truncated_missing_and_corrupt(tmp_path):
    cache, packs = _packs(tmp_path, [4096, 8192, 12288, 16384])
    os.truncate(packs[0][0], 4000)  # wrong size: refused before hashing
    packs[1][0].unlink()  # absent
    with open(packs[3][0], "r+b") as fh:
        fh.write(b"\x00\x01")
    with pytest.raises(ColdSnapError) as exc:
        PayloadVerifier().verify_many([(cache, d, s) for _p, d, s in packs])
    assert not isinstance(exc.value, IntegrityError)  # one failure is "not present", not an integrity failure
    msg = str(exc.value)
    assert msg.startswith("3 of 4 model payloads failed verification: [0] ")
    assert "has 4000 bytes, the artifact says 4096" in msg and "is not present at" in msg
    assert "hashes to sha256:" in msg and str(packs[3][0]) in msg and str(packs[2][0]) not in msg
    assert exc.value.details["failed"] == [packs[0][1], packs[1][1], packs[3][1]]
    assert packs[2][0].exists()


def test_verify_many_refuses_bad_arguments_before_touching_files(tmp_path):
    cache, packs = _packs(tmp_path, [4096])
    _p, digest, size = packs[0]
    for jobs in (0, -1, True, 1.5):
        with pytest.raises(ColdSnapError, match="jobs"):
            PayloadVerifier().verify_many([(cache, digest, size)], jobs=jobs)
    with pytest.raises(ColdSnapError, match="listed twice"):
        PayloadVerifier().verify_many([(cache, digest, size), (cache, digest, size)])
    with pytest.raises(ColdSnapError, match="digest"):
        PayloadVerifier().verify_many([(cache, digest, size), (cache, "sha256:../x", 1)])
    assert PayloadVerifier().verify_many([]) == []
    assert not any(p.name.endswith(".coldsnap-validation.json") for p in packs[0][0].parent.iterdir())


def test_verify_many_read_only_leaves_no_record(tmp_path):
    cache, packs = _packs(tmp_path, [4096, 8192])
    verified = PayloadVerifier().verify_many([(cache, d, s) for _p, d, s in packs], write_record=False)
    assert all(not v.record_written and v.bytes_hashed == v.size for v in verified)
    for v in verified:
        v.close()
    assert sorted(p.name for p in packs[0][0].parent.iterdir()) == sorted(p.name for p, _d, _s in packs)


def test_cli_verifies_several_packs_and_names_the_corrupt_one(tmp_path):
    cache, packs = _packs(tmp_path, [4096, 3 * 4096, 5 * 4096])
    args = [sys.executable, "-m", "coldsnap.cli", "payload", "verify", "--state-root", str(cache.state_root), "--jobs", "2"]
    for _p, d, s in packs:
        args += ["--sha256", d, "--size", str(s)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["verified"] is True and [x["sha256"] for x in out["payloads"]] == [d for _p, d, _s in packs]
    assert out["bytes_hashed"] == sum(s for _p, _d, s in packs)
    with open(packs[1][0], "r+b") as fh:
        fh.write(b"\xff")
    r = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and str(packs[1][0]) in r.stderr and "quarantine" in r.stderr
    r = subprocess.run(args[:-2], capture_output=True, text=True, timeout=120, check=False)  # one --size short
    assert r.returncode == 2 and "--size" in r.stderr
