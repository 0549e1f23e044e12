"""Host-to-host transfer of a payload: the peer pull the restore role uses vs plain scp, same run.

Two hosts on this machine (network namespaces on a bridge, each with its own sshd and private
state root: tests/integration/multihost/netns_hosts.py). A pack of --size-mib MiB (random
bytes) sits in host A's node cache; host B gets it three ways, each from nothing:

* ``scp``: plain ``scp`` run on host B from host A over the same ssh (no verification);
* ``peer pull``: the pull alone (``payload_stage`` with ``source.kind: peer``: bytes over HTTP
  from host A's transfer server, hashed as they arrive, committed into the node cache);
* ``peer playbook``: the whole playbook through ansible-runner (token, server start on host A,
  pull, server stop) — what a restore adds for a payload on another host;
* ``via control node`` (``--with-control-node``): what the role did before, ``fetch`` to the
  control node and ``copy`` out.

Run as root: ``python bench/host_transfer.py --size-mib 1024 [--with-control-node]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration" / "multihost"))

from netns_hosts import NetnsHosts  # noqa: E402

STATE_ROOT = Path("/var/lib/coldsnap-bench-h2h")
PLAYBOOK = REPO / "tests" / "integration" / "multihost" / "pull_payload.yml"


def make_pack(objects: Path, size: int) -> str:
    objects.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    tmp = objects / "incoming"
    with open(tmp, "wb") as f:
        left = size
        while left:
            chunk = os.urandom(min(left, 8 << 20))
            f.write(chunk)
            h.update(chunk)
            left -= len(chunk)
    hexd = h.hexdigest()
    tmp.rename(objects / f"{hexd}.pack")
    return hexd


def clear_b(hosts: NetnsHosts) -> None:
    shutil.rmtree(hosts.work / "hostb-state" / "model-payloads", ignore_errors=True)
    (hosts.work / "hostb-state" / "incoming").mkdir(parents=True, exist_ok=True)
    for f in (hosts.work / "hostb-state" / "incoming").iterdir():
        f.unlink()


def run_playbook(hosts: NetnsHosts, playbook: Path, extravars: dict, work: Path):
    import ansible_runner

    work.mkdir(parents=True)
    r = ansible_runner.run(private_data_dir=str(work), playbook=str(playbook), inventory=hosts.inventory(sys.executable),
                           extravars=extravars, envvars={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"},
                           quiet=True)
    if r.status != "successful":
        raise SystemExit(f"{playbook.name} failed: {r.stdout.read() if r.stdout else r.status}")
    events = [json.loads(p.read_text()) for p in Path(r.config.artifact_dir, "job_events").glob("*.json")]
    return {e["event_data"]["task"]: e["event_data"] for e in events if e.get("event") == "runner_on_ok"}


def task_seconds(event: dict) -> float:
    from datetime import datetime

    start = datetime.fromisoformat(event["start"])
    end = datetime.fromisoformat(event["end"])
    return (end - start).total_seconds()


CONTROL_NODE = """---
- name: Through the control node
  hosts: hostb
  gather_facts: false
  tasks:
    - name: Fetch
      ansible.builtin.fetch:
        src: "{{ src }}"
        dest: "{{ stage }}/"
        flat: true
      delegate_to: hosta
    - name: Copy
      ansible.builtin.copy:
        src: "{{ stage }}/{{ src | basename }}"
        dest: "{{ dest }}"
        mode: "0600"
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--with-control-node", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="h2h-bench-"))
    shutil.rmtree(STATE_ROOT, ignore_errors=True)
    hosts = NetnsHosts(work / "netns", STATE_ROOT).up()
    size = args.size_mib << 20
    figures: dict = {"size_bytes": size}
    try:
        hexd = make_pack(hosts.work / "hosta-state" / "model-payloads" / "sha256", size)
        src = f"{STATE_ROOT}/model-payloads/sha256/{hexd}.pack"
        b = hosts.hosts[1]
        clear_b(hosts)
        t = time.monotonic()
        out = hosts.run_on(b, f"scp -q -i {hosts.key} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
                              f"root@{hosts.hosts[0].address}:{src} {STATE_ROOT}/incoming/x.pack")
        figures["scp_s"] = time.monotonic() - t
        if out.returncode:
            raise SystemExit(f"scp failed: {out.stderr}")
        clear_b(hosts)
        t = time.monotonic()
        tasks = run_playbook(hosts, PLAYBOOK, {"pull_to": "hostb", "pull_from": "hosta", "pull_hex": hexd,
                                               "pull_size": size, "pull_state_root": str(STATE_ROOT)}, work / "peer")
        figures["peer_playbook_s"] = time.monotonic() - t
        figures["peer_pull_s"] = task_seconds(tasks["Pull it into the node cache"])
        figures["peer_serve_start_s"] = task_seconds(tasks["Serve the payload on its capture host"])
        if args.with_control_node:
            clear_b(hosts)
            pb = work / "control-node.yml"
            pb.write_text(CONTROL_NODE)
            stage = work / "stage"
            stage.mkdir()
            t = time.monotonic()
            tasks = run_playbook(hosts, pb, {"src": src, "stage": str(stage),
                                             "dest": f"{STATE_ROOT}/incoming/x.pack"}, work / "cn")
            figures["control_node_s"] = time.monotonic() - t
            figures["control_node_fetch_s"] = task_seconds(tasks["Fetch"])
            figures["control_node_copy_s"] = task_seconds(tasks["Copy"])
    finally:
        hosts.down()
        shutil.rmtree(STATE_ROOT, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    figures["peer_pull_over_scp"] = figures["peer_pull_s"] / figures["scp_s"]
    figures["peer_playbook_over_scp"] = figures["peer_playbook_s"] / figures["scp_s"]
    if "control_node_s" in figures:
        figures["control_node_over_scp"] = figures["control_node_s"] / figures["scp_s"]
    text = json.dumps(figures, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
