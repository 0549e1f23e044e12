"""FAULTS 25 and the seeds' portability qualification on two managed hosts: a TP2 reference
engine captured with rank 0 on host A and rank 1 on host B, restored with the ranks swapped.
Each host has its own address, network namespace and state root; Ansible reaches them
over ssh; the coordinator and gloo run over the bridge between them."""

from __future__ import annotations

import copy
import json
import shlex
import shutil
import sys
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import environment
from netns_hosts import NetnsHosts

import coldsnap  # noqa: F401  # pylint: disable=unused-import
from coldsnap.demo import reference_request
from coldsnap.runner import operation_extravars, run_playbook

pytestmark = [pytest.mark.criu, pytest.mark.slow]
STATE_ROOT = Path("/var/lib/coldsnap-multihost")


@pytest.fixture(scope="module")
def hosts(module_tmp):
    if not shutil.which("sshd") and not Path("/usr/sbin/sshd").exists():
        pytest.fail("openssh-server is required (scripts/install-system.sh installs it)")
    shutil.rmtree(STATE_ROOT, ignore_errors=True)  # this test's own control-node state root
    nh = NetnsHosts(module_tmp("netns"), STATE_ROOT).up()
    yield nh
    nh.down()


@pytest.fixture(scope="module")
def model(module_tmp):
    from coldsnap_engines.reference.config import PRESETS
    from coldsnap_engines.reference.weights import make_model

    d = module_tmp("mh-model") / "reference-tiny"
    return d, make_model(d, PRESETS["tiny"], model_id="coldsnap/reference-tiny")


def tp2(operation: str, op_id: str, model, placement: tuple[str, str], **kw) -> dict:
    model_dir, ident = model
    req = reference_request(operation=operation, op_id=op_id, model_dir=model_dir, model=ident, port=18400,
                            state_root=STATE_ROOT, env_digest=environment.compute(), tp=2, threads=1, **kw)
    for unit, host in zip(req["launch"]["units"], placement, strict=True):
        unit["host"] = host
        unit["environment"]["GLOO_SOCKET_IFNAME"] = "eth0"
    req["workload"]["recipe"] = "multihost-tp2"
    return req


def run(req: dict, inventory: dict, *, prepare_only: bool = False, envvars: dict | None = None):
    # No terminal: the long steps run in the foreground unless the playbooks put them in the background.
    return run_playbook(operation=req["operation"], request=req, playbook=f"coldsnap.fleet.{req['operation']}",
                        extravars=operation_extravars(req, prepare_only=prepare_only, state_root=STATE_ROOT),
                        inventory=copy.deepcopy(inventory), state_root=STATE_ROOT, prepare_only=prepare_only,
                        envvars=envvars)


@pytest.fixture(scope="module")
def swapped(hosts, model):
    """Capture with rank 0 on host A and rank 1 on host B, then restore with the ranks swapped."""
    inv = hosts.inventory(sys.executable)
    cap = run(tp2("capture", "mh-capture", model, ("hosta", "hostb"),
                  artifact_dir=STATE_ROOT / "artifacts" / "mh-capture"), inv)
    assert cap.succeeded, cap.receipt["error"]
    artifact = Path(cap.receipt["result"]["operation"]["artifact"])
    res = run(tp2("restore", "mh-restore", model, ("hostb", "hosta"), artifact=artifact), inv)
    return artifact, json.loads(artifact.read_text()), res


def _http_on(hosts, host, path: str, body: dict | None = None, timeout: int = 30) -> str:
    """The reply body of the engine port inside ``host``'s namespace, or 'UNREACHABLE ...' (python3 only)."""
    code = ("import urllib.request as u\n"
            "try:\n"
            f"    r = u.urlopen(u.Request('http://127.0.0.1:18400{path}', data={json.dumps(body).encode() if body else None!r}),"
            f" timeout={timeout})\n"
            "    print(r.read().decode(), end='')\n"
            "except OSError as e:\n"
            "    print('UNREACHABLE', e)\n")
    out = hosts.run_on(host, f"python3 -c {shlex.quote(code)}")
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_tp2_capture_on_one_placement_restore_with_ranks_swapped(hosts, swapped):
    _artifact, art, res = swapped
    assert [c["host"] for c in art["capsule"]["units"]] == ["hosta", "hostb"]
    accepted = art["acceptance"]["reply"]
    assert res.succeeded, res.receipt["error"]
    units = {u["unit"]: u for u in res.receipt["result"]["operation"]["units"]}
    assert units["unit-0"]["host"] == "hostb" and units["unit-1"]["host"] == "hosta"
    assert units["unit-0"]["reply"] == accepted
    # Rank 0 now serves inside host B's network namespace; rank 1 runs on host A.
    b, a = hosts.hosts[1], hosts.hosts[0]
    out = _http_on(hosts, b, "/v1/completions", {"prompt": "ColdSnap says:", "max_tokens": 16})
    assert json.loads(out)["choices"][0]["text"] == accepted
    # Host B pulled unit-0's capsule and payload from host A, host to host (its transfer server).
    staged = hosts.run_on(b, f"ls {STATE_ROOT}/model-payloads/sha256/ | grep -c pack$")
    assert int(staged.stdout.strip() or 0) >= 1
    assert _http_on(hosts, a, "/health", timeout=5).startswith("UNREACHABLE")  # nothing serves on A now
    events = [e for e in (json.loads(f.read_text()) for f in sorted((res.artifact_dir / "job_events").glob("*.json")))
              if e.get("event") == "runner_on_ok"]
    pulled = [e["event_data"]["res"] for e in events
              if e["event_data"].get("task", "").startswith(("Pull it into the node cache", "Pull the capsule's files"))
              and e["event_data"].get("host") == "hostb" and "bytes_received" in e["event_data"]["res"]]
    assert pulled, "host B should have pulled from host A"
    served = [e["event_data"]["res"] for e in events
              if e["event_data"].get("task") == "Serve the payload on its capture host"]
    # each capture host served the other: on its own inventory address only, never on all interfaces
    assert sorted(r["address"] for r in served) == sorted(h.address for h in hosts.hosts)
    # nothing of it passed through the control node, and no transfer server is left on host A
    assert not list(STATE_ROOT.glob("runs/*/transfer"))
    leftover = hosts.run_on(a, f"ls {STATE_ROOT}/runs/transfers/ 2>/dev/null | grep -c json$ || true")
    assert int(leftover.stdout.strip() or 0) == 0


def test_fault25_unreachable_host_stops_before_eviction(hosts, model, swapped):
    inv = hosts.inventory(sys.executable)
    artifact, _art, res = swapped
    assert res.succeeded, "needs the running swapped restore"
    # This workload's engines only (its model directory is in their command line): the hosts share the
    # machine's pid namespace, where other engines may run.
    mine = f"pgrep -f '[c]oldsnap-reference-engine --model {model[0]} ' || true"
    before = {h.name: hosts.run_on(h, mine).stdout.split() for h in hosts.hosts}
    assert any(before.values()), "the swapped restore should be running"
    broken = copy.deepcopy(inv)
    broken["all"]["hosts"]["hosta"]["ansible_host"] = "10.77.0.99"  # nobody there
    broken["all"]["hosts"]["hosta"]["ansible_ssh_common_args"] += " -o ConnectTimeout=3"
    res = run(tp2("restore", "mh-restore-unreachable", model, ("hostb", "hosta"), artifact=artifact), broken)
    assert not res.succeeded
    assert "hosta" in json.dumps(res.receipt["result"]["unreachable_hosts"])
    assert "prepare" in res.receipt["error"]["phase"]
    after = {h.name: hosts.run_on(h, mine).stdout.split() for h in hosts.hosts}
    assert after == before, "no host may be evicted when one was unreachable during preparation"


def test_one_fork_for_two_unit_hosts_restores_and_a_wake_is_refused_before_it_starts(hosts, model, swapped):
    """Fewer forks than unit hosts (an AWX job template's Forks, ANSIBLE_FORKS) without live progress: the
    activation, whose units wait for one another across the hosts, still runs on both hosts at once; a wake,
    which runs in the foreground, is refused before it touches anything instead of waking one host at a time."""
    inv = hosts.inventory(sys.executable)
    artifact, art, _res = swapped
    one_fork = {"ANSIBLE_FORKS": "1"}
    # where the swapped restore runs it (the hosts share one pid namespace: the captured pids are free there)
    res = run(tp2("restore", "mh-restore-one-fork", model, ("hostb", "hosta"), artifact=artifact), inv,
              envvars=one_fork)
    assert res.succeeded, res.receipt["error"]
    units = {u["unit"]: u for u in res.receipt["result"]["operation"]["units"]}
    assert units["unit-0"]["host"] == "hostb" and units["unit-0"]["reply"] == art["acceptance"]["reply"]
    wake = run(tp2("wake", "mh-wake-one-fork", model, ("hostb", "hosta"), artifact=artifact), inv, envvars=one_fork)
    assert not wake.succeeded
    assert "units are on 2 hosts" in wake.receipt["error"]["message"] and "forks" in wake.receipt["error"]["message"]
    # refused in the first play, before any unit host ran a module
    assert {t["play"] for t in wake.receipt["result"]["tasks"]} == {"ColdSnap | every unit host and localhost take part"}
