"""Placement is not identity (the seeds' restore contract), with real CRIU: a capture restores onto
another serving port, also while a stranger holds the captured one; every listener of the unit
moves by one shift (the engine's control listener too, which stays on loopback when the service
moves to another address; one the shift would push out of range wraps around) and the receipt
names where it serves. A
requested port someone else holds fails in prepare, naming the holder, and the running workload
stays. A request that changes identity (the command beyond its placement flags) is refused with
the field named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from netports import another_free_port, free_port_in, squatting
from snapshot_workload import Workload, units_of

pytestmark = [pytest.mark.criu, pytest.mark.slow]

UNIT, WORKER = "unit-0", "worker-0"


def on_port(port: int, command_port: int | None = None):
    """A request mutation: serve on ``port`` (services[0].port and the command's --port)."""
    def mutate(req: dict) -> None:
        req["launch"]["execution"]["services"][0]["port"] = port
        cmd = req["launch"]["units"][0]["command"]
        cmd[cmd.index("--port") + 1] = str(command_port or port)
    return mutate


@pytest.fixture(scope="module")
def captured(state_root, tiny_model, env_digest):
    wl = Workload(state_root, tiny_model, env_digest, tp=1, name="placement")
    cap = wl.run(wl.request("capture"))
    assert cap.succeeded, cap.receipt["error"]
    artifact = Path(cap.receipt["result"]["operation"]["artifact"])
    art = json.loads(artifact.read_text())
    evidence = json.loads((state_root / "captures" / art["capture_id"] / "units" / UNIT / "evidence.json").read_text())
    yield wl, artifact, art, evidence
    wl.stop()


def test_restore_onto_another_port_while_a_stranger_holds_the_captured_one(captured, state_root):
    wl, artifact, art, evidence = captured
    captured_listeners = {tuple(x) for x in evidence["workers"][0]["listeners"]}
    assert ("127.0.0.1", wl.port) in captured_listeners or ("0.0.0.0", wl.port) in captured_listeners
    new_port = another_free_port(wl.port)
    shift = new_port - wl.port
    with squatting("127.0.0.1", wl.port):
        res = wl.run(wl.request("restore", artifact=artifact, mutate=on_port(new_port)))
        assert res.succeeded, res.receipt["error"]
        unit = units_of(res.receipt)[0]
        assert unit["served"] == {"address": "127.0.0.1", "port": new_port}
        moved = {(tuple(m["from"]), tuple(m["to"])) for m in unit["listeners_moved"]}
        assert moved == {((a, p), (a, p + shift)) for a, p in captured_listeners}, "one shift for every listener"
        assert wl.complete(port=new_port) == art["acceptance"]["reply"]
        control = json.loads((state_root / "workloads" / wl.name / UNIT / f"control-{WORKER}.json").read_text())
        ctl_captured = json.loads((state_root / "captures" / art["capture_id"] / "units" / UNIT / "control"
                                   / f"{WORKER}.json").read_text())
        assert control["port"] == ctl_captured["port"] + shift
        # The moved engine is the workload: status and sleep/wake reach it through its moved control port.
        status = wl.run(wl.request("status", mutate=on_port(new_port)))
        assert status.succeeded and units_of(status.receipt)[0]["state"] == "ready", status.receipt["error"]
    # The captured images are untouched: the same capture restores back onto its own port, replacing
    # the moved workload.
    back = wl.run(wl.request("restore", artifact=artifact))
    assert back.succeeded, back.receipt["error"]
    assert units_of(back.receipt)[0]["listeners_moved"] == []
    assert wl.complete() == art["acceptance"]["reply"]


def test_a_serving_port_that_pushes_the_control_listener_out_of_range_wraps_it(captured, state_root):
    """Any serving port restores: the engine's control listener (an ephemeral port the user never chose)
    that the shift would push past 65535 (or below 1) wraps around within 1024..65535, and the controller
    reaches the engine there."""
    wl, artifact, art, _evidence = captured
    ctl = json.loads((state_root / "captures" / art["capture_id"] / "units" / UNIT / "control"
                      / f"{WORKER}.json").read_text())["port"]
    if ctl > wl.port:  # serve high enough that ctl + shift > 65535
        new_port = free_port_in(range(max(65536 - (ctl - wl.port), 1024), 65536))
    else:  # serve low enough that ctl + shift < 1
        new_port = free_port_in(range(max(wl.port - ctl - 400, 1), wl.port - ctl + 1))
    moved_ctl = 1024 + (ctl + new_port - wl.port - 1024) % (65536 - 1024)
    assert not 1 <= ctl + new_port - wl.port <= 65535 and 1024 <= moved_ctl <= 65535
    res = wl.run(wl.request("restore", artifact=artifact, mutate=on_port(new_port)))
    assert res.succeeded, res.receipt["error"]
    unit = units_of(res.receipt)[0]
    assert unit["served"] == {"address": "127.0.0.1", "port": new_port}
    assert {(tuple(m["from"]), tuple(m["to"])) for m in unit["listeners_moved"]} >= {
        (("127.0.0.1", ctl), ("127.0.0.1", moved_ctl))}
    control = json.loads((state_root / "workloads" / wl.name / UNIT / f"control-{WORKER}.json").read_text())
    assert control["port"] == moved_ctl
    assert wl.complete(port=new_port) == art["acceptance"]["reply"]
    status = wl.run(wl.request("status", mutate=on_port(new_port)))
    assert status.succeeded and units_of(status.receipt)[0]["state"] == "ready", status.receipt["error"]
    back = wl.run(wl.request("restore", artifact=artifact))
    assert back.succeeded, back.receipt["error"]
    assert wl.complete() == art["acceptance"]["reply"]


def _listening(port: int) -> set[str]:
    """The IPv4 addresses a TCP socket listens on at ``port`` on this host (from /proc/net/tcp)."""
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, hexport = local.split(":")
        if state == "0A" and int(hexport, 16) == port:
            out.add(".".join(str(b) for b in reversed(bytes.fromhex(addr))))
    return out


def test_a_restore_onto_all_interfaces_moves_the_service_and_keeps_the_control_api_on_loopback(captured,
                                                                                               state_root):
    """Only the service's own listener changes address: the engine's control API is never exposed by a
    restore that serves on 0.0.0.0 (and the controller still reaches it on loopback)."""
    wl, artifact, _art, _evidence = captured
    new_port = another_free_port(wl.port)

    def everywhere(req: dict) -> None:
        on_port(new_port)(req)
        req["launch"]["execution"]["services"][0]["address"] = "0.0.0.0"
        cmd = req["launch"]["units"][0]["command"]
        if "--host" in cmd:
            cmd[cmd.index("--host") + 1] = "0.0.0.0"

    res = wl.run(wl.request("restore", artifact=artifact, mutate=everywhere))
    assert res.succeeded, res.receipt["error"]
    assert units_of(res.receipt)[0]["served"] == {"address": "0.0.0.0", "port": new_port}
    assert _listening(new_port) == {"0.0.0.0"}
    control = json.loads((state_root / "workloads" / wl.name / UNIT / f"control-{WORKER}.json").read_text())
    assert _listening(control["port"]) == {"127.0.0.1"}, "the control API stays on loopback"
    status = wl.run(wl.request("status", mutate=everywhere))
    assert status.succeeded and units_of(status.receipt)[0]["state"] == "ready", status.receipt["error"]
    back = wl.run(wl.request("restore", artifact=artifact))
    assert back.succeeded, back.receipt["error"]


def test_the_serving_socket_binds_where_the_restore_command_says(captured, state_root):
    """The command's --host is where the serving socket listens, which may be wider than where the service
    is probed: a restore whose command binds 0.0.0.0 (probed on loopback) listens on every interface, and one
    back on 127.0.0.1 listens on loopback only (a socket captured on 0.0.0.0 used to stay there whatever the
    restore asked, while the receipt said 127.0.0.1)."""
    wl, artifact, _art, _evidence = captured

    def bind_all(req: dict) -> None:
        cmd = req["launch"]["units"][0]["command"]
        if "--host" in cmd:
            cmd[cmd.index("--host") + 1] = "0.0.0.0"
        else:  # the reference engine binds 127.0.0.1 by default
            cmd += ["--host", "0.0.0.0"]

    wide = wl.run(wl.request("restore", artifact=artifact, mutate=bind_all))
    assert wide.succeeded, wide.receipt["error"]
    assert _listening(wl.port) == {"0.0.0.0"}
    control = json.loads((state_root / "workloads" / wl.name / UNIT / f"control-{WORKER}.json").read_text())
    assert _listening(control["port"]) == {"127.0.0.1"}, "the control API stays on loopback"
    back = wl.run(wl.request("restore", artifact=artifact))
    assert back.succeeded, back.receipt["error"]
    assert _listening(wl.port) == {"127.0.0.1"}
    assert units_of(back.receipt)[0]["served"] == {"address": "127.0.0.1", "port": wl.port}


def test_a_requested_port_a_stranger_holds_fails_in_prepare_and_the_workload_keeps_serving(captured):
    wl, artifact, art, _evidence = captured
    pids = wl.engines()
    assert pids, "the previous test leaves the workload running on its captured port"
    wanted = another_free_port(wl.port)
    with squatting("127.0.0.1", wanted) as squatter:
        res = wl.run(wl.request("restore", artifact=artifact, mutate=on_port(wanted)))
        assert not res.succeeded
        msg = res.receipt["error"]["message"]
        assert f"127.0.0.1:{wanted}" in msg and f"pid {squatter.pid}" in msg, msg
        assert "services[].port" in msg, "the fix names how to restore onto another port"
    assert wl.engines() == pids
    assert wl.complete() == art["acceptance"]["reply"]


def test_a_request_that_changes_identity_is_refused_naming_the_field(captured):
    wl, artifact, _art, _evidence = captured
    pids = wl.engines()

    def other_command(req: dict) -> None:
        req["launch"]["units"][0]["command"] += ["--seed", "7"]

    res = wl.run(wl.request("restore", artifact=artifact, mutate=other_command))
    assert not res.succeeded
    assert "$.launch.units[0].command" in res.receipt["error"]["message"], res.receipt["error"]
    assert wl.engines() == pids


def test_a_command_port_that_disagrees_with_the_service_is_refused_at_validation(captured):
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import FormatError
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request

    wl, artifact, _art, _evidence = captured
    req = wl.request("restore", artifact=artifact, mutate=on_port(wl.port + 1, command_port=wl.port + 2))
    with pytest.raises(FormatError, match=r"services\[0\]\.port.*--port"):
        validate_request(req)
