"""``coldsnap payload build|verify|inspect`` end to end, through the real entry point."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import pack_relpath
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.manifest import source_dict
from payload_testlib import BAD_DIGESTS, MODEL, make_worker


def coldsnap(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coldsnap.cli", *args], capture_output=True, text=True, check=False,
                          **kw)


@pytest.fixture
def described(tmp_path):
    """A build description plus raw allocation files, as a user would dump them."""
    w = make_worker(tmp_path)
    allocs = []
    for a in w.allocations:
        (tmp_path / f"{a.id}.bin").write_bytes(bytes(w.buffers[a.id]))
        allocs.append({"id": a.id, "address": a.address, "size": a.size, "bytes": f"{a.id}.bin"})
    desc = {"model": MODEL, "allocations": allocs,
            "extents": [{"allocation": e.allocation, "offset": e.offset, "size": e.size,
                         "source": source_dict(e.source)} for e in w.extents]}
    (tmp_path / "desc.json").write_text(json.dumps(desc))
    return w, tmp_path


def test_build_verify_inspect(described):
    w, tmp = described
    r = coldsnap("payload", "build", "--description", str(tmp / "desc.json"), "--out", str(tmp / "out"),
                 "--state-root", str(tmp / "state"), "--safetensors-dir", str(w.ckpt_dir))
    assert r.returncode == 0, r.stderr
    built = json.loads(r.stdout)
    pack = built["pack"]
    assert pack["path"] == pack_relpath(pack["sha256"][7:]) and pack["size"] % 4096 == 0
    assert built["model_bytes"] + built["residual_bytes"] == sum(a.size for a in w.allocations)
    r = coldsnap("payload", "verify", "--state-root", str(tmp / "state"), "--sha256", pack["sha256"],
                 "--size", str(pack["size"]))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["record_reused"] is True  # the canonical writer left a record
    r = coldsnap("payload", "inspect", str(tmp / "out" / "native-manifest.json"))
    summary = json.loads(r.stdout)
    assert summary["pack"]["sha256"] == pack["sha256"] and summary["model_extents"] == len(w.extents)
    r = coldsnap("payload", "inspect", str(tmp / "out" / "replay-plan.json"))
    assert json.loads(r.stdout)["extents"] == len(w.extents)
    r = coldsnap("payload", "inspect", "--hash", str(tmp / "state" / pack["path"]))
    info = json.loads(r.stdout)
    assert info["verified"] is True and info["bytes_hashed"] == pack["size"] and info["record"]["status"] == "valid"
    r = coldsnap("payload", "inspect", str(tmp / "state" / (pack["path"] + ".coldsnap-validation.json")))
    assert json.loads(r.stdout)["sha256"] == pack["sha256"]


def test_build_without_pack_and_bad_description(described):
    _w, tmp = described
    r = coldsnap("payload", "build", "--description", str(tmp / "desc.json"), "--out", str(tmp / "o2"), "--no-pack")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["pack"] is None
    doc = json.loads((tmp / "desc.json").read_text())
    doc["extents"][0]["offset"] = doc["allocations"][0]["size"]
    (tmp / "bad.json").write_text(json.dumps(doc))
    r = coldsnap("payload", "build", "--description", str(tmp / "bad.json"), "--out", str(tmp / "o3"), "--no-pack")
    assert r.returncode == 2 and "past the end" in r.stderr and not (tmp / "o3").exists()
    (tmp / "broken.json").write_text('{"model": ,}')
    r = coldsnap("payload", "build", "--description", str(tmp / "broken.json"), "--out", str(tmp / "o4"), "--no-pack")
    assert r.returncode == 2 and f"build description {tmp / 'broken.json'} is invalid" in r.stderr, r.stderr


def test_paths_that_cannot_be_used_are_one_line_errors_not_tracebacks(described):
    _w, tmp = described
    pack = tmp / "state" / pack_relpath("ab" * 32)
    r = coldsnap("payload", "inspect", str(pack))
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    pack.mkdir(parents=True)  # a directory named like a pack is not reported as a 4096-byte pack
    r = coldsnap("payload", "inspect", str(pack))
    assert r.returncode == 2 and "is not a regular file" in r.stderr and not r.stdout
    (tmp / "afile").write_text("x")
    r = coldsnap("payload", "build", "--description", str(tmp / "desc.json"), "--out", str(tmp / "afile"), "--no-pack")
    assert r.returncode == 1 and str(tmp / "afile") in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_verify_failure_quarantines_and_exits_2(described):
    _w, tmp = described
    r = coldsnap("payload", "build", "--description", str(tmp / "desc.json"), "--out", str(tmp / "out"),
                 "--state-root", str(tmp / "state"))
    pack = json.loads(r.stdout)["pack"]
    path = tmp / "state" / pack["path"]
    os.chmod(path, 0o644)
    with open(path, "r+b") as fh:
        fh.write(b"\xff\xff")
    r = coldsnap("payload", "verify", "--path", str(path), "--sha256", pack["sha256"], "--size", str(pack["size"]))
    assert r.returncode == 2 and "quarantine" in r.stderr and not path.exists()


@pytest.mark.parametrize("bad", BAD_DIGESTS[:5])
def test_cli_refuses_malformed_digests(tmp_path, bad):
    r = coldsnap("payload", "verify", "--state-root", str(tmp_path / "state"), "--sha256", bad, "--size", "1")
    assert r.returncode == 2 and "sha256" in r.stderr and not (tmp_path / "state").exists()


def test_progress_line_on_a_tty(tmp_path):
    data = os.urandom(40 << 20)
    import hashlib

    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    path = tmp_path / "state" / pack_relpath(digest[7:])
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "coldsnap.cli", "payload", "verify", "--path", str(path),
                             "--sha256", digest, "--size", str(len(data))],
                            stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    out, _unused = proc.communicate(timeout=120)
    tty = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        tty += chunk
    os.close(master)
    assert proc.returncode == 0 and json.loads(out)["bytes_hashed"] == len(data)
    assert b"\r" in tty and b"100.0%" in tty and b"GB/s" in tty
    # not a tty: no progress noise
    r = coldsnap("payload", "verify", "--path", str(path), "--sha256", digest, "--size", str(len(data)))
    assert r.returncode == 0 and r.stderr == ""


def test_entry_point_lists_payload():
    r = coldsnap("payload", "--help")
    assert r.returncode == 0 and "verify" in r.stdout and "inspect" in r.stdout and "build" in r.stdout
