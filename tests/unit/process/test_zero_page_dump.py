"""Zero pages left out of a dump: ColdSnap's CRIU build does not write a private anonymous page whose
bytes are all zero (freed heaps, the GPU memory a CUDA checkpoint parks in host memory); restored, such
a page reads as zeros again. What matters is that every byte comes back: zeros written over data,
zeros in a child over its parent's data (memory shared copy-on-write after ``fork``), data beside them.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import criu as criu_mod

MIB = 1 << 20
SIZE = 32 * MIB
PAGE = 4096

# Both processes map SIZE bytes private and anonymous, fill it with data, then the parent forks: the
# child inherits the data copy-on-write and writes zeros over the even MiB of it; the parent writes
# zeros over the odd MiB of its own copy, and over one single page in the middle of a data run.
TREE = r"""
import ctypes, hashlib, json, mmap, os, sys, time

SIZE, MIB, PAGE = SIZE_BYTES, 1 << 20, 4096
m = mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
seed = hashlib.sha256(b"zero pages").digest()
for off in range(0, SIZE, PAGE):
    m[off:off + PAGE] = (seed[:31] + bytes([off // PAGE % 251 + 1])) * (PAGE // 32)
out = sys.argv[1]
r, w = os.pipe()
child = os.fork()
if child == 0:
    for off in range(0, SIZE, 2 * MIB):
        m[off:off + MIB] = bytes(MIB)
    os.write(w, hashlib.sha256(m[:]).hexdigest().encode())
    while True:
        time.sleep(1)
for off in range(MIB, SIZE, 2 * MIB):
    m[off:off + MIB] = bytes(MIB)
m[4 * MIB + 7 * PAGE:4 * MIB + 8 * PAGE] = bytes(PAGE)
child_sha = os.read(r, 64).decode()
info = {"pid": os.getpid(), "child": child, "addr": ctypes.addressof(ctypes.c_char.from_buffer(m)),
        "sha256": hashlib.sha256(m[:]).hexdigest(), "child_sha256": child_sha}
with open(out + ".tmp", "w") as fh:
    json.dump(info, fh)
os.rename(out + ".tmp", out)
while True:
    time.sleep(1)
""".replace("SIZE_BYTES", str(SIZE))


def pages_bytes(images: Path) -> int:
    return sum(f.stat().st_size for f in images.glob("pages-*.img"))


def gone(pid: int, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while os.path.exists(f"/proc/{pid}"):
        assert time.time() < deadline, f"pid {pid} still exists {timeout:g} s after the dump killed it"
        time.sleep(0.02)


def read(pid: int, addr: int, size: int) -> bytes:
    with open(f"/proc/{pid}/mem", "rb") as mem:
        mem.seek(addr)
        return mem.read(size)


@pytest.mark.criu
def test_zeros_come_back_as_zeros_and_data_as_data(tmp_path, criu_build, reap, spawn_ready):
    criu, coldsnap_build = criu_build
    proc, info = spawn_ready(TREE, "process tree")
    reap(info["child"])
    criu_mod.dump(criu, info["pid"], tmp_path / "images")
    proc.wait(timeout=30)
    gone(info["child"])  # reaped by whoever inherited it: its pid must be free to restore it
    restored = criu_mod.restore(criu, tmp_path / "images", work_dir=tmp_path / "work").pid
    reap(restored)
    assert restored == info["pid"]
    parent = read(restored, info["addr"], SIZE)
    child = read(info["child"], info["addr"], SIZE)
    assert hashlib.sha256(parent).hexdigest() == info["sha256"], "the parent's bytes come back"
    assert hashlib.sha256(child).hexdigest() == info["child_sha256"], (
        "the child's zeros stay zeros: not its parent's data, which it shared copy-on-write")
    assert parent[4 * MIB + 7 * PAGE:4 * MIB + 8 * PAGE] == bytes(PAGE)
    assert parent[4 * MIB + 8 * PAGE:4 * MIB + 9 * PAGE] != bytes(PAGE)
    assert child[:MIB] == bytes(MIB) and child[MIB:2 * MIB] != bytes(MIB)
    if coldsnap_build:
        # Half of each process's mapping is zeros: ColdSnap's build leaves 2 x 16 MiB out (the rest
        # of the images is the interpreters' own memory, ~6 MiB each).
        assert pages_bytes(tmp_path / "images") < 2 * SIZE - 16 * MIB, sorted(
            (f.name, f.stat().st_size) for f in (tmp_path / "images").glob("pages-*.img"))


@pytest.mark.criu
def test_without_the_request_every_present_page_is_dumped(tmp_path, criu_build, reap, spawn_ready):
    """The same tree dumped by CRIU without the environment variable: all 2 x 32 MiB written."""
    criu, coldsnap_build = criu_build
    if not coldsnap_build:
        pytest.skip("another CRIU build dumps every page anyway")  # never in CI: install-system.sh builds it
    _proc, info = spawn_ready(TREE, "process tree")
    reap(info["child"])
    images = tmp_path / "images"
    images.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if k != criu_mod.CRIU_SKIP_ZERO_ENV}
    subprocess.run([criu.binary, "dump", "-t", str(info["pid"]), "-D", str(images), "-o", "dump.log",
                    "--leave-running"], check=True, env=env, capture_output=True)
    assert pages_bytes(images) >= 2 * SIZE


@pytest.mark.parametrize("version_text,ours", [("Version: 4.1.1\nGitID: coldsnap-3efccbd52e76\n", True),
                                               ("Version: 4.1.1\n", False),
                                               ("Version: 4.1\nGitID: v4.1-2-gabcdef\n", False)])
def test_only_coldsnaps_build_is_taken_for_one(tmp_path, version_text, ours):
    """The requests these tests check are ignored by other CRIU builds: which one runs is read once,
    from ``criu --version``, with the version itself."""
    fake = tmp_path / "criu"
    fake.write_text(f"#!/bin/sh\nprintf '{version_text}'\n")
    fake.chmod(0o755)
    criu = criu_mod.find_criu(str(fake))
    assert criu.major == 4 and criu.coldsnap_build is ours
