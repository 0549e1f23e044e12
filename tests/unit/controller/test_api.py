"""coldsnap.api: request checks, prepare_only, ansible-runner callbacks, the inventory pre-check and the
message without the collection. Runs are real ansible-runner runs of the fixture playbook on localhost."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError, FormatError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.receipt import load_receipt
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import (
    OPERATIONS,
    validate_request,
)

from coldsnap import api
from coldsnap.runner.inventory import check_unit_hosts

REPO = Path(__file__).resolve().parents[3]
SUCCEED = REPO / "tests" / "fixtures" / "playbooks" / "succeed.yml"
SECRET = "sekret-api-41c7e2d9b05a"
LOCAL_VARS = f"ansible_connection=local ansible_python_interpreter={sys.executable}"


def _request(text: str, operation: str = "capture", host: str = "localhost") -> dict:
    req = json.loads(text)
    req["operation"] = operation
    if operation != "capture":
        req["artifact"] = {"path": "/var/lib/coldsnap/artifacts/fixture/artifact.json"}
    req["launch"]["units"][0]["host"] = host
    return req


def test_one_function_per_operation() -> None:
    for op in OPERATIONS:
        fn = getattr(api, op.replace("-", "_"))
        assert fn.__name__ == op.replace("-", "_") and f"{op!r}" in fn.__doc__
        assert op in api.SUMMARIES


def test_load_validates_and_normalizes(tmp_path: Path, example_request_text: str) -> None:
    raw = json.loads(example_request_text)
    path = tmp_path / "request.json"
    path.write_text(example_request_text)
    assert api.load(raw) == api.load(path) == api.load(str(path)) == validate_request(raw)
    assert api.load(api.load(raw)) == api.load(raw)  # a normalized request stays valid and unchanged
    raw["launch"]["units"][0]["surprise"] = 1
    with pytest.raises(FormatError, match=r"launch\.units\[0\]\.surprise"):
        api.load(raw)
    with pytest.raises(ColdSnapError, match="no such file"):
        api.load(tmp_path / "missing.json")


def test_operation_mismatch_is_refused(tmp_path: Path, example_request_text: str) -> None:
    with pytest.raises(ColdSnapError) as err:
        api.restore(_request(example_request_text, "capture"), state_root=tmp_path / "state")
    assert "is for operation 'capture', not 'restore' (its field operation)" in str(err.value)
    assert "coldsnap.api.capture" in err.value.fix
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("operation", [op for op in OPERATIONS if op not in ("restore", "warm")])
def test_prepare_only_is_for_restore_and_warm_only(tmp_path: Path, example_request_text: str, operation) -> None:
    fn = getattr(api, operation.replace("-", "_"))
    with pytest.raises(ColdSnapError, match=f"does not apply to operation '{operation}'") as err:
        fn(_request(example_request_text, operation), prepare_only=True, state_root=tmp_path / "state")
    assert "restore or warm" in err.value.fix
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("kind", ["extravars", "secrets"])
def test_contract_vars_are_not_extra_vars(tmp_path: Path, example_request_text: str, kind) -> None:
    with pytest.raises(ColdSnapError, match="coldsnap_prepare_only is set by the controller"):
        api.warm(_request(example_request_text, "warm"), state_root=tmp_path, **{kind: {"coldsnap_prepare_only": True}})


def test_run_playbook_refuses_a_contract_var_that_disagrees(tmp_path: Path, example_request_text: str) -> None:
    from coldsnap.runner import operation_extravars, run_playbook

    req = api.load(_request(example_request_text, "warm"))
    with pytest.raises(ColdSnapError, match="coldsnap_prepare_only = True disagrees"):
        run_playbook(operation="warm", request=req, playbook=SUCCEED, inventory=None, state_root=tmp_path,
                     extravars=operation_extravars(req, prepare_only=True), prepare_only=False)


@pytest.fixture(scope="module")
def warm_run(tmp_path_factory):
    """One prepare-only warm of the fixture playbook, with an INI inventory and both callbacks."""
    tmp = tmp_path_factory.mktemp("api")
    inventory = tmp / "hosts.ini"
    inventory.write_text(f"[coldsnap_units]\nlocalhost {LOCAL_VARS}\n")
    request = tmp / "warm.json"
    text = (REPO / "tests" / "fixtures" / "requests" / "capture-reference.json").read_text()
    request.write_text(json.dumps(_request(text, "warm")))
    events: list[dict] = []
    statuses: list[tuple[dict, object]] = []

    def on_status(data: dict, runner_config=None) -> None:
        statuses.append((data, runner_config))
        if data["status"] == "successful":
            raise RuntimeError("a bug in the caller's status handler")

    receipt = api.warm(request, prepare_only=True, inventory=inventory, state_root=tmp / "state",
                       playbook=SUCCEED, secrets={"coldsnap_test_token": SECRET},
                       event_handler=events.append, status_handler=on_status)
    return receipt, events, statuses


def test_prepare_only_reaches_playbook_and_receipt(warm_run) -> None:
    receipt, _events, _statuses = warm_run
    assert receipt.succeeded and receipt.exit_code == 0 and not receipt.cancelled
    assert receipt.prepare_only is True and receipt.replay_semantics == "safe-repeat"
    # What the playbook read as coldsnap_prepare_only (set_stats of succeed.yml).
    assert receipt.result["operation"]["prepare_only"] is True
    assert receipt.result["operation"]["token_length"] == len(SECRET)


def test_receipt_is_typed(warm_run) -> None:
    receipt, _events, _statuses = warm_run
    assert receipt.path is not None and load_receipt(receipt.path.read_bytes()) == receipt.raw
    assert api.Receipt.load(receipt.path) == receipt
    assert receipt.operation == "warm" and receipt.operation_id == receipt.raw["operation_id"]
    assert receipt.state == "succeeded" and receipt.error is None
    assert isinstance(receipt.started_at, dt.datetime) and receipt.started_at.tzinfo is not None
    assert receipt.completed_at >= receipt.started_at
    assert receipt.duration_seconds == receipt.raw["duration_seconds"] > 0
    assert receipt.engine == "reference" and receipt.request_sha256.startswith("sha256:")
    assert receipt.timing["spans"] and receipt.result["stats"]["localhost"]["failures"] == 0
    with pytest.raises(AttributeError):
        receipt.state = "failed"  # frozen


def test_handlers_are_passed_through(warm_run) -> None:
    receipt, events, statuses = warm_run
    # The handler got every event ansible-runner stored, in order: also lines ansible-playbook printed
    # before its callbacks were loaded ("verbose" events; e.g. a library's deprecation warning on import).
    stored = [json.loads(f.read_text()) for f in receipt.path.parent.glob("artifacts/*/job_events/*.json")]
    assert [e["uuid"] for e in events] == [e["uuid"] for e in sorted(stored, key=lambda e: e["counter"])]
    names = [e["event"] for e in events if e["event"] != "verbose"]
    assert names[0] == "playbook_on_start" and names[-1] == "playbook_on_stats"
    assert len({e["uuid"] for e in events}) == len(events)
    stats = next(e for e in events if e["event"] == "playbook_on_stats")
    assert stats["event_data"]["artifact_data"]["coldsnap_result"] == receipt.result["operation"]
    # The events are what job_events/ stores: the secret the playbook leaked is scrubbed.
    assert SECRET not in json.dumps(events) and "secret is <redacted>" in json.dumps(events)
    assert [s["status"] for s, _cfg in statuses] == ["starting", "running", "successful"]
    assert all(cfg is not None for _s, cfg in statuses)
    starting = statuses[0][0]
    assert starting["command"][0].endswith("ansible-playbook") and SECRET not in json.dumps(starting)
    # The caller's handler raised: a warning in the receipt, not a failed run.
    warnings = receipt.result["controller_warnings"]
    assert any("on_status: RuntimeError: a bug in the caller's status handler" in w for w in warnings)


YAML_INVENTORY = "all:\n  children:\n    gpus:\n      hosts:\n        gpu-a: {}\n        gpu-c:\n          ansible_host: 10.0.0.3\n"
INI_INVENTORY = "[gpus]\ngpu-a\ngpu-c ansible_host=10.0.0.3\n"


@pytest.mark.parametrize(("name", "text"), [("hosts.yml", YAML_INVENTORY), ("hosts.ini", INI_INVENTORY)])
def test_inventory_precheck_names_the_missing_host(tmp_path: Path, example_request_text: str, name, text) -> None:
    inventory = tmp_path / name
    inventory.write_text(text)
    req = _request(example_request_text, "status", host="gpu-b")
    with pytest.raises(ColdSnapError) as err:
        api.status(req, inventory=inventory, state_root=tmp_path / "state", playbook=SUCCEED)
    message = str(err.value)
    assert f"launch.units[0].host 'gpu-b' is not in inventory {inventory}" in message
    assert "Ansible reads 2 hosts there: gpu-a, gpu-c" in message
    assert "add the missing hosts to the inventory, or set launch.units[].host" in err.value.fix
    assert not (tmp_path / "state").exists()  # before anything ran


@pytest.mark.parametrize(("name", "text"), [("hosts.yml", YAML_INVENTORY), ("hosts.ini", INI_INVENTORY)])
def test_inventory_precheck_passes_present_hosts(tmp_path: Path, example_request_text: str, name, text) -> None:
    inventory = tmp_path / name
    inventory.write_text(text)
    for host in ("gpu-a", "gpu-c", "localhost"):  # localhost: Ansible's implicit localhost
        check_unit_hosts(api.load(_request(example_request_text, "status", host=host)), inventory)
    inventory_dict = {"all": {"hosts": {"gpu-a": {}}}}
    check_unit_hosts(api.load(_request(example_request_text, "status", host="gpu-a")), inventory_dict)
    with pytest.raises(ColdSnapError, match="'gpu-c' is not in the inventory dict"):
        check_unit_hosts(api.load(_request(example_request_text, "status", host="gpu-c")), inventory_dict)


def test_cli_runs_through_the_api(tmp_path: Path, example_request_text: str, capsys) -> None:
    from coldsnap.cli import main

    inventory = tmp_path / "hosts.ini"
    inventory.write_text("[gpus]\ngpu-a\n")
    path = tmp_path / "request.json"
    path.write_text(json.dumps(_request(example_request_text, "status", host="gpu-b")))
    rc = main(["status", "--request-json", str(path), "--inventory", str(inventory),
               "--state-root", str(tmp_path / "state")])
    err = capsys.readouterr().err
    assert rc == 2 and "coldsnap: error: launch.units[0].host 'gpu-b' is not in inventory" in err


def _without_collection(tmp_path: Path, code: str) -> subprocess.CompletedProcess:
    """The base interpreter with this venv's packages but not its collections .pth (nor any other
    place the controller looks for the collection)."""
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "ANSIBLE_COLLECTIONS_PATH": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([sysconfig.get_paths()["purelib"], str(REPO / "src")])}
    base = getattr(sys, "_base_executable", sys.executable)
    return subprocess.run([base, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False)


def test_missing_collection_is_a_clear_message(tmp_path: Path) -> None:
    probe = _without_collection(tmp_path, "import coldsnap, sys; print(sys.prefix)")
    assert probe.returncode == 0, probe.stderr
    assert not (Path(probe.stdout.strip()) / "collections" / "ansible_collections" / "coldsnap").exists()

    helped = _without_collection(tmp_path, "import sys; from coldsnap.cli import main; sys.exit(main(['--help']))")
    assert helped.returncode == 0 and "usage: coldsnap" in helped.stdout, helped.stderr
    assert "collection coldsnap.fleet is not importable" in helped.stdout and "Traceback" not in helped.stderr

    ran = _without_collection(tmp_path, "import sys; from coldsnap.cli import main; "
                                        "sys.exit(main(['restore', '--request-json', 'r.json']))")
    assert ran.returncode == 2 and "Traceback" not in ran.stderr
    assert ran.stderr.startswith("coldsnap: error: the Ansible collection coldsnap.fleet is not importable")
    assert "scripts/setup-venv.sh" in ran.stderr and "ansible-galaxy collection install" in ran.stderr

    imported = _without_collection(tmp_path, "import coldsnap.api")
    assert imported.returncode == 1
    assert imported.stderr.strip().splitlines()[-1].startswith(
        "coldsnap._collection.CollectionNotFound: the Ansible collection coldsnap.fleet is not importable")


def test_an_inventory_that_cannot_be_read_or_parsed_is_refused_not_replaced_by_localhost(
        tmp_path: Path, example_request_text: str) -> None:
    req = api.load(_request(example_request_text, "status", host="localhost"))
    garbage = tmp_path / "hosts.ini"
    garbage.write_text("[gpu\nfoo = = bar\n")
    with pytest.raises(ColdSnapError, match="cannot be parsed"):
        check_unit_hosts(req, garbage)
    with pytest.raises(ColdSnapError, match="does not exist"):
        check_unit_hosts(req, tmp_path / "missing.ini")
    check_unit_hosts(req, "localhost,")  # a host list is no path
