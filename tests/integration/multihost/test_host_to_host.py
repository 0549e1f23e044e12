"""A ≥ 1 GB payload moves host to host (two network-namespace hosts reached over ssh): the
capture host serves it, the other pulls it into its node cache, verified as it arrives; an
interrupted pull resumes; nothing passes through the control node and no token is shown."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from netns_hosts import NetnsHosts

pytestmark = [pytest.mark.slow]
STATE_ROOT = Path("/var/lib/coldsnap-h2h")
PLAYBOOK = Path(__file__).with_name("pull_payload.yml")
SIZE = (1 << 30) + 12345  # not a multiple of any buffer
TOKEN = "h2hSecretToken" + "x" * 34


@pytest.fixture(scope="module")
def hosts(module_tmp):
    if not shutil.which("sshd") and not Path("/usr/sbin/sshd").exists():
        pytest.fail("openssh-server is required (scripts/install-system.sh installs it)")
    shutil.rmtree(STATE_ROOT, ignore_errors=True)
    nh = NetnsHosts(module_tmp("h2h"), STATE_ROOT).up()
    yield nh
    nh.down()
    shutil.rmtree(STATE_ROOT, ignore_errors=True)


@pytest.fixture(scope="module")
def payload(hosts):
    """A 1 GiB pack in host A's node cache (written through its private state root)."""
    objects = hosts.work / "hosta-state" / "model-payloads" / "sha256"
    objects.mkdir(parents=True)
    block = os.urandom(1 << 20)
    h = hashlib.sha256()
    tmp = objects / "incoming"
    with open(tmp, "wb") as f:
        for i in range(SIZE >> 20):
            chunk = block[:-8] + i.to_bytes(8, "little")
            f.write(chunk)
            h.update(chunk)
        tail = block[:SIZE & ((1 << 20) - 1)]
        f.write(tail)
        h.update(tail)
    hexd = h.hexdigest()
    final = objects / f"{hexd}.pack"
    tmp.rename(final)
    return hexd, final


def pull(hosts, hexd: str, tmp_path: Path):
    import ansible_runner

    pdd = tmp_path / "pdd"
    pdd.mkdir(parents=True)
    r = ansible_runner.run(
        private_data_dir=str(pdd), playbook=str(PLAYBOOK), inventory=hosts.inventory(sys.executable),
        extravars={"pull_to": "hostb", "pull_from": "hosta", "pull_hex": hexd, "pull_size": SIZE,
                   "pull_state_root": str(STATE_ROOT), "pull_token": TOKEN},
        envvars={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}, quiet=True)
    return r, (r.stdout.read() if r.stdout else "")


def test_a_1gb_payload_moves_host_to_host_verified_and_resumes(hosts, payload, tmp_path):
    hexd, source = payload
    b_objects = hosts.work / "hostb-state" / "model-payloads" / "sha256"
    # An earlier pull stopped after 300 MB: its partial file is kept under the node cache's downloads.
    downloads = hosts.work / "hostb-state" / "model-payloads" / "downloads"
    downloads.mkdir(parents=True)
    with open(source, "rb") as src, open(downloads / f"{hexd}.peer-partial", "wb") as part:
        part.write(src.read(300 << 20))
    r, out = pull(hosts, hexd, tmp_path)
    assert r.status == "successful", out
    events = [json.loads(p.read_text()) for p in Path(r.config.artifact_dir, "job_events").glob("*.json")]
    # The token is in no event, no output and no file the transfer left on either host.
    seen = [str(p) for p in Path(r.config.artifact_dir).rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]
    assert not seen and TOKEN not in out
    for h in hosts.hosts:
        grep = hosts.run_on(h, f"grep -rl {TOKEN} {STATE_ROOT} || true")
        assert grep.stdout.strip() == "", grep.stdout
    pulled = next(e["event_data"]["res"] for e in events if e.get("event") == "runner_on_ok"
                  and e["event_data"].get("task") == "Pull it into the node cache")
    assert pulled["changed"] and pulled["bytes_copied"] == SIZE - (300 << 20)  # resumed, not restarted
    assert pulled["source"].startswith("peer 10.77.0.1:")
    staged = b_objects / f"{hexd}.pack"
    assert staged.stat().st_size == SIZE and oct(staged.stat().st_mode & 0o777) == "0o400"
    assert not (downloads / f"{hexd}.peer-partial").exists()
    check = hosts.run_on(hosts.hosts[1], f"sha256sum {STATE_ROOT}/model-payloads/sha256/{hexd}.pack")
    assert check.stdout.split()[0] == hexd
    # The server is gone and its run file with it; its log never shows the token.
    assert not list((hosts.work / "hosta-state" / "runs" / "transfers").glob("*.json"))
    # A second run finds the payload verified and moves nothing.
    r2, out2 = pull(hosts, hexd, tmp_path / "again")
    assert r2.status == "successful", out2
    events2 = [json.loads(p.read_text()) for p in Path(r2.config.artifact_dir, "job_events").glob("*.json")]
    again = next(e["event_data"]["res"] for e in events2 if e.get("event") == "runner_on_ok"
                 and e["event_data"].get("task") == "Pull it into the node cache")
    assert not again["changed"] and again["bytes_copied"] == 0


def test_a_corrupt_source_is_refused_on_arrival_and_nothing_is_staged(hosts, payload, tmp_path):
    hexd, source = payload
    b_pack = hosts.work / "hostb-state" / "model-payloads" / "sha256" / f"{hexd}.pack"
    b_pack.unlink(missing_ok=True)

    def flip() -> None:  # one byte of the capture host's copy, flipped (and flipped back after)
        with open(source, "r+b") as f:
            f.seek(SIZE // 2)
            byte = f.read(1)
            f.seek(SIZE // 2)
            f.write(bytes([byte[0] ^ 0xFF]))

    flip()
    try:
        r, out = pull(hosts, hexd, tmp_path)
        assert r.status == "failed"
        assert "hashes to sha256:" in out and f"expected sha256:{hexd}" in out
        assert not b_pack.exists()
        assert not list((hosts.work / "hostb-state" / "model-payloads").rglob("*.peer-partial"))
    finally:
        flip()
