"""The controller engine against real ansible-runner runs of the fixture playbooks (localhost)."""

from __future__ import annotations

import stat
import threading
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import file_lock
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.canonical import canonical_sha256
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.receipt import load_receipt
from controller_helpers import (
    ENV_TOKEN,
    PLAYBOOKS,
    SECRET_VAR,
    all_files,
    local_inventory,
    read_ndjson,
    request_for,
)

from coldsnap.runner import operation_extravars, run_playbook


@pytest.fixture(scope="module")
def success(module_tmp):
    """One successful run of succeed.yml with an env token and a secret extra var."""
    tmp = module_tmp("success")
    req = request_for("capture")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLDSNAP_FIXTURE_API_TOKEN", ENV_TOKEN)
        result = run_playbook(operation="capture", request=req, playbook=PLAYBOOKS / "succeed.yml",
                              extravars=operation_extravars(req, state_root=tmp / "state"), inventory=None,
                              state_root=tmp / "state", timing_sink=tmp / "timing.ndjson", progress=False,
                              secret_extravars={"coldsnap_test_token": SECRET_VAR})
    return result, tmp


def test_success_receipt(success) -> None:
    result, _unused = success
    receipt = load_receipt(result.receipt_path.read_bytes())
    assert result.succeeded and result.exit_code == 0 and receipt["state"] == "succeeded"
    assert receipt["error"] is None
    assert receipt["operation_id"] == "op-20261129-0001" and receipt["operation"] == "capture"
    assert receipt["replay_semantics"] == "conflict-on-existing-output"
    assert receipt["engine"] == "reference" and receipt["snapshot_driver"] == "n610"
    res = receipt["result"]
    counters = [t["counter"] for t in res["tasks"]]
    assert counters == sorted(counters)
    names = [t["task"] for t in res["tasks"]]
    assert names[0] == "Check the extra vars of the contract" and names[-1] == "Publish the operation result"
    assert all(t["host"] == "localhost" and t["status"] == "ok" for t in res["tasks"])
    censored = [t for t in res["tasks"] if t["censored"]]
    assert [t["task"] for t in censored] == ["Use the secret extra var"] and censored[0]["msg"] is None
    assert res["stats"] == {"localhost": {"ok": 9, "changed": 0, "failures": 0, "unreachable": 0, "skipped": 0,
                                          "rescued": 0, "ignored": 0}}
    # set_stats coldsnap_result is the operation result; the lengths prove both secrets reached the playbook.
    assert res["operation"] == {"operation": "capture", "prepare_only": False, "token_length": len(SECRET_VAR),
                                "env_token_length": len(ENV_TOKEN), "awx_job_id": None}
    assert res["custom_stats"] == {"coldsnap_result": res["operation"]}


def test_success_timing(success) -> None:
    result, tmp = success
    receipt = load_receipt(result.receipt_path.read_bytes())
    events = read_ndjson(tmp / "timing.ndjson")
    assert events[-1]["event"] == "envelope"
    assert sum(e["event"] == "envelope" for e in events) == 1
    # The stream's closing digest is the digest of the envelope the receipt embeds (after a JSON round trip).
    assert events[-1]["attrs"]["sha256"] == canonical_sha256(receipt["timing"])
    spans = receipt["timing"]["spans"]
    op = [s for s in spans if s["name"] == "coldsnap.capture"]
    assert len(op) == 1 and op[0]["clock"] == "controller" and op[0]["parent_id"] is None
    tasks = [s for s in spans if s["clock"] == "controller" and s["parent_id"] == op[0]["span_id"]]
    assert len(tasks) == 9
    assert all(s["attrs"]["host"] == "localhost" and "action" in s["attrs"] for s in tasks)
    assert all(s["start_ns"] >= op[0]["start_ns"] and s["end_ns"] <= op[0]["end_ns"] for s in tasks)
    unit = [s for s in spans if s["clock"] == "unit:unit-0"]
    assert sorted(s["name"] for s in unit) == ["unit.criu.restore", "unit.hydrate", "unit.restore"]
    parent = next(s for s in unit if s["name"] == "unit.restore")
    assert all(s["parent_id"] == parent["span_id"] for s in unit if s is not parent)
    # Unit times are kept as the unit measured them: never shifted onto the controller clock.
    assert parent["start_ns"] == 1_000_000_000 and parent["end_ns"] == 1_900_000_000
    assert [m["name"] for m in receipt["timing"]["marks"]] == ["unit.ready"]
    # The live stream announced every task span before closing it.
    starts = {e["span_id"] for e in events if e["event"] == "span-start"}
    assert {s["span_id"] for s in tasks} <= starts
    # The run's own mirror of the stream is identical.
    assert (result.artifact_dir / "timing.ndjson").read_text() == (tmp / "timing.ndjson").read_text()


def test_private_data_dir_layout_and_modes(success) -> None:
    result, _unused = success
    run_dir = result.run_dir
    assert run_dir.parent.name == "runs" and run_dir.name == "op-20261129-0001"
    for d in (run_dir.parent, run_dir, run_dir / "env", run_dir / "inventory", run_dir / "artifacts",
              result.artifact_dir, run_dir / "secrets"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    for f in ("env/extravars", "env/envvars", "env/settings", "inventory/hosts.json", "receipt.json"):
        assert stat.S_IMODE((run_dir / f).stat().st_mode) == 0o600, f
    assert (run_dir / "project").is_symlink() and (run_dir / "project" / "galaxy.yml").is_file()
    assert list((run_dir / "secrets").iterdir()) == []  # the secret extra vars file is gone
    assert (result.artifact_dir / "job_events").is_dir() and (result.artifact_dir / "command").is_file()


def test_nothing_stored_holds_a_secret(success) -> None:
    result, tmp = success
    files = [*all_files(result.run_dir), tmp / "timing.ndjson"]
    assert len(files) > 20
    for path in files:
        data = path.read_bytes()
        assert ENV_TOKEN.encode() not in data, path
        assert SECRET_VAR.encode() not in data, path
    # The leaks were scrubbed where they happened, not merely absent.
    events = "".join(p.read_text() for p in (result.artifact_dir / "job_events").iterdir())
    assert "secret is <redacted>" in events and "env token is <redacted>" in events
    assert "secret is <redacted>" in (result.artifact_dir / "stdout").read_text()
    # The command artifact keeps the environment, redacted by name.
    import json

    command = json.loads((result.artifact_dir / "command").read_text())
    assert command["env"]["COLDSNAP_FIXTURE_API_TOKEN"] == "<redacted>"
    assert "ANSIBLE_COLLECTIONS_PATH" in command["env"]


@pytest.mark.parametrize("verbosity", [1, 3])
def test_secret_extra_vars_reach_a_verbose_run_and_are_stored_nowhere(tmp_path: Path, verbosity: int) -> None:
    """With -v ansible-playbook reports its configuration as events before it reads ``-e @file``: the
    secrets file must still be there then (it was deleted at the first event), and gone afterwards."""
    req = request_for("capture")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLDSNAP_FIXTURE_API_TOKEN", ENV_TOKEN)
        result = run_playbook(operation="capture", request=req, playbook=PLAYBOOKS / "succeed.yml",
                              extravars=operation_extravars(req, state_root=tmp_path / "state"), inventory=None,
                              state_root=tmp_path / "state", progress=False, verbosity=verbosity,
                              secret_extravars={"coldsnap_test_token": SECRET_VAR})
    receipt = load_receipt(result.receipt_path.read_bytes())
    assert result.succeeded, receipt["error"]
    assert receipt["result"]["operation"]["token_length"] == len(SECRET_VAR)
    assert list((result.run_dir / "secrets").iterdir()) == []
    for path in all_files(result.run_dir):
        assert SECRET_VAR.encode() not in path.read_bytes() and ENV_TOKEN.encode() not in path.read_bytes(), path


def test_failing_task(tmp_path: Path) -> None:
    req = request_for("restore")
    result = run_playbook(operation="restore", request=req, playbook=PLAYBOOKS / "fail.yml",
                          extravars=operation_extravars(req), inventory=local_inventory(),
                          state_root=tmp_path, progress=False)
    receipt = load_receipt(result.receipt_path.read_bytes())
    assert not result.succeeded and result.exit_code == 1 and receipt["state"] == "failed"
    assert receipt["replay_semantics"] == "reconcile-replace"
    err = receipt["error"]
    assert err["task"] == "Break the operation" and err["host"] == "localhost"
    assert err["phase"] == "Controller fixture that fails"
    assert "fixture failure: the disk is on fire" in err["message"]
    rows = {t["task"]: t for t in receipt["result"]["tasks"]}
    assert "Never runs" not in rows
    assert rows["Fail but be ignored"]["ignored"] and not rows["Fail but be ignored"]["rescued"]
    assert rows["Fail and get rescued"]["rescued"] and rows["Fail and get rescued"]["status"] == "failed"
    assert not rows["Break the operation"]["rescued"]
    assert receipt["result"]["failed_hosts"] == ["localhost"]
    spans = {s["name"]: s for s in receipt["timing"]["spans"]}
    assert spans["Break the operation"]["status"] == "failed"
    assert spans["coldsnap.restore"]["status"] == "failed"


def test_unreachable_hosts_are_all_listed(tmp_path: Path) -> None:
    dead = {"ansible_host": "127.0.0.1", "ansible_port": 1, "ansible_connection": "ssh",
            "ansible_ssh_timeout": 3, "ansible_password": "inventory-pass-5e6f"}
    result = run_playbook(operation="status", request=None, playbook=PLAYBOOKS / "unreachable.yml", extravars={},
                          inventory=local_inventory(**{"dead-a": dead, "dead-b": dict(dead)}),
                          state_root=tmp_path, progress=False)
    receipt = load_receipt(result.receipt_path.read_bytes())
    assert receipt["state"] == "failed" and receipt["request_sha256"] is None and receipt["engine"] is None
    assert receipt["operation_id"].startswith("status-")
    assert sorted(receipt["result"]["unreachable_hosts"]) == ["dead-a", "dead-b"]
    err = receipt["error"]
    assert "unreachable" in err["message"] and "dead-a" in err["message"] and "dead-b" in err["message"]
    assert "Connection refused" in err["message"] and err["task"] == "Reach every host"
    assert receipt["result"]["stats"]["dead-b"]["unreachable"] == 1
    assert receipt["result"]["operation"] == {"reached": ["localhost"]}
    for path in all_files(result.run_dir):  # an inventory password is a secret too
        assert b"inventory-pass-5e6f" not in path.read_bytes() or path.name == "hosts.json", path


def _sleep_processes() -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes() == b"sleep\x0061.737\x00":
                    state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_cancel_event_stops_the_run_and_writes_a_failed_receipt(tmp_path: Path) -> None:
    assert _sleep_processes() == []
    cancel = threading.Event()
    seen: list[str] = []

    def sink(event: dict) -> None:
        if event["event"] == "span-start" and event["name"] == "Long task":
            seen.append("long")
            threading.Timer(0.5, cancel.set).start()

    req = request_for("warm")
    result = run_playbook(operation="warm", request=req, playbook=PLAYBOOKS / "long.yml",
                          extravars=operation_extravars(req, prepare_only=True), inventory=local_inventory(),
                          state_root=tmp_path, prepare_only=True, timing_sink=sink, progress=False,
                          cancel_event=cancel)
    assert seen == ["long"]
    receipt = load_receipt(result.receipt_path.read_bytes())
    assert result.cancelled and result.exit_code == 130 and receipt["state"] == "failed"
    assert receipt["replay_semantics"] == "safe-repeat" and receipt["prepare_only"] is True
    err = receipt["error"]
    assert "cancelled" in err["message"] and err["task"] == "Long task" and err["host"] == "localhost"
    assert receipt["result"]["in_flight"] == [{"host": "localhost", "task": "Long task",
                                               "play": "Controller fixture with a long task",
                                               "action": "ansible.builtin.command"}]
    assert receipt["result"]["runner"]["cancelled"] is True
    spans = {s["name"]: s for s in receipt["timing"]["spans"]}
    assert spans["Long task"]["status"] == "cancelled"
    assert "Publish the operation result" not in spans
    # ansible-core runs workers in their own sessions: the module's sleep must be gone too.
    assert _sleep_processes() == []


def test_one_run_per_operation_id(tmp_path: Path) -> None:
    req = request_for("status")
    run_dir = tmp_path / "runs" / req["id"]
    run_dir.mkdir(parents=True)
    with file_lock(run_dir / ".lock"), pytest.raises(ColdSnapError, match="already running"):
        run_playbook(operation="status", request=req, playbook=PLAYBOOKS / "succeed.yml",
                     extravars=operation_extravars(req), inventory=None, state_root=tmp_path, progress=False)


def test_request_operation_must_match(tmp_path: Path) -> None:
    with pytest.raises(ColdSnapError, match="not 'restore'"):
        run_playbook(operation="restore", request=request_for("capture"), playbook=PLAYBOOKS / "succeed.yml",
                     extravars={}, inventory=None, state_root=tmp_path)
    with pytest.raises(ColdSnapError, match="does not apply"):
        run_playbook(operation="capture", request=request_for("capture"), playbook=PLAYBOOKS / "succeed.yml",
                     extravars={}, inventory=None, state_root=tmp_path, prepare_only=True)
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_playbook_error_without_a_failed_task(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yml"
    broken.write_text("- name: Broken\n  hosts: all\n  gather_facts: false\n  tasks:\n"
                      "    - name: Unknown module\n      no.such.module_xyz: {}\n")
    result = run_playbook(operation="status", request=None, playbook=broken, extravars={},
                          inventory=local_inventory(), state_root=tmp_path / "state", progress=False)
    receipt = load_receipt(result.receipt_path.read_bytes())
    assert receipt["state"] == "failed" and receipt["error"]["phase"] == "playbook"
    assert "no.such.module_xyz" in receipt["error"]["message"]
    assert receipt["error"]["host"] is None and receipt["result"]["tasks"] == []


def test_secrets_with_quotes_backslashes_tabs_and_url_passwords_are_stored_nowhere(tmp_path: Path) -> None:
    """Ansible prints results as JSON: a password with a quote, a backslash or a tab reaches the events escaped,
    and credentials the broad name rule missed (MYSQL_PWD, *_PAT, a proxy URL with a password) reach the
    command artifact unless they are named or recognised."""
    import json

    secret, env_token = 'S3cr"et\\pass\tXYZ', 'envtok"Q\\uw-123'
    extra_env = {"HTTPS_PROXY": "http://bob:ProxyPassw0rd1@proxy:3128", "MYSQL_PWD": "MysqlPassw0rd2",
                 "GITHUB_PAT": "ghp_PatValue0003", "DATABASE_URL": "postgres://u:DbPassw0rd4@db/x"}
    req = request_for("capture")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLDSNAP_FIXTURE_API_TOKEN", env_token)
        for name, value in extra_env.items():
            mp.setenv(name, value)
        result = run_playbook(operation="capture", request=req, playbook=PLAYBOOKS / "succeed.yml",
                              extravars=operation_extravars(req, state_root=tmp_path / "state"), inventory=None,
                              state_root=tmp_path / "state", progress=False,
                              secret_extravars={"coldsnap_test_token": secret})
    assert result.succeeded
    forms = set()
    for value in (secret, env_token, "ProxyPassw0rd1", "MysqlPassw0rd2", "ghp_PatValue0003", "DbPassw0rd4"):
        once = json.dumps(value)[1:-1]
        forms |= {value, once, json.dumps(once)[1:-1]}
    for path in all_files(result.run_dir):
        data = path.read_text(errors="replace")
        assert not [f for f in forms if f in data], path
    assert "secret is <redacted>" in (result.artifact_dir / "stdout").read_text()
    command = json.loads((result.artifact_dir / "command").read_text())
    assert {command["env"][name] for name in extra_env} == {"<redacted>"}
