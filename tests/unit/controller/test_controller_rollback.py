"""The controller's rollback of a restore that failed after eviction (coldsnap.runner.rollback), without
Ansible: when it is tried (only for what this state root's controller restored, the same hosts, units and
engine pids), what the failed run's receipt then says, and what is remembered and forgotten. The whole
path with real CRIU: tests/integration/snapshot/test_faults.py."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.timing import SpanRecorder

from coldsnap.receipts import write_receipt
from coldsnap.runner import rollback
from coldsnap.runner.driver import OperationResult

ARTIFACTS: dict[str, Path] = {}


@pytest.fixture(autouse=True)
def generations(tmp_path):
    """Two committed generations of the workload and a ``current`` link at the second, as the store has."""
    store = tmp_path / "artifacts" / "abc"
    for n, cap in ((1, "cap-1"), (2, "cap-2")):
        d = store / f"00000{n}"
        d.mkdir(parents=True)
        (d / "artifact.json").write_text(json.dumps({"capture_id": cap, "capsule": {"units": [
            {"unit": "u0", "image_id": f"sha256:{n}" + "0" * 63}]}}))
    (store / "current").symlink_to("000001")
    ARTIFACTS["current"] = store / "current" / "artifact.json"
    ARTIFACTS["store"] = store
    yield


def request(op_id: str) -> dict:
    return {"id": op_id, "operation": "restore", "workload": {"recipe": "demo"},
            "artifact": {"path": str(ARTIFACTS["current"])}}


@dataclasses.dataclass
class Config:
    state_root: Path
    request: dict
    operation_id: str
    prepare_only: bool = False
    operation: str = "restore"
    public_vars: dict = dataclasses.field(default_factory=lambda: {"coldsnap_request": {}, "mine": 1})
    secret_vars: dict = dataclasses.field(default_factory=lambda: {"registry_password": "s3cret"})
    inventory: dict | None = None
    caller_env: dict = dataclasses.field(default_factory=dict)
    verbosity: int = 0
    keep_artifacts: int = 10


def result_of(tmp_path: Path, op_id: str, *, succeeded: bool, units=None, eviction=None, message="boom") -> OperationResult:
    run_dir = tmp_path / "runs" / op_id
    (run_dir / "artifacts").mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    res = {"operation": {"units": units or []}}
    if eviction is not None:
        res["eviction"] = eviction
    receipt = {"format": 2, "kind": "coldsnap-operation-receipt", "operation_id": op_id, "operation": "restore",
               "prepare_only": False, "state": "succeeded" if succeeded else "failed", "request_sha256": None,
               "engine": None, "snapshot_driver": None, "replay_semantics": "reconcile-replace",
               "started_at": now.isoformat().replace("+00:00", "Z"),
               "completed_at": now.isoformat().replace("+00:00", "Z"), "duration_seconds": 1.0,
               "timing": SpanRecorder("controller").finish(op_id), "result": res,
               "error": None if succeeded else {"message": message, "host": "h1", "task": "t", "phase": "p"}}
    path = write_receipt(run_dir / "receipt.json", receipt)  # validates the format
    return OperationResult(operation_id=op_id, operation="restore", succeeded=succeeded, cancelled=False,
                           receipt=receipt, receipt_path=path, run_dir=run_dir, artifact_dir=run_dir / "artifacts",
                           runner_status="successful" if succeeded else "failed", rc=0 if succeeded else 2)


RUNNING = [{"host": "h1", "unit": "u0", "capture_id": "cap-1", "workers": [{"worker": "w0", "pid": 4242}]}]
EVICTED = {"previous_workload": "evicted", "evicted": True, "hosts": ["h1"],
           "units": [{"host": "h1", "unit": "u0", "pid": 4242, "pids": [4242], "processes": 3, "restored": False}]}


def after(tmp_path, config, result, *, enabled=True, outcome=None, raises=None):
    calls = []

    def build(**kw):
        calls.append(kw)
        if raises:
            raise raises
        return kw

    def run(cfg):
        return outcome

    lines: list[str] = []
    out = rollback.after_restore(config, result, enabled=enabled, build=build, run=run, say=lines.append)
    return out, calls, lines


def test_a_success_is_remembered_privately_and_a_stop_forgets_it(tmp_path):
    cfg = Config(tmp_path, request("op-1"), "op-1")
    rollback.after_restore(cfg, result_of(tmp_path, "op-1", succeeded=True, units=RUNNING), enabled=True,
                           build=None, run=None, say=print)
    path = rollback.serving_path(tmp_path, "demo")
    assert path.stat().st_mode & 0o777 == 0o600
    rec = json.loads(path.read_text())
    assert rec["operation_id"] == "op-1" and rec["capture_id"] == "cap-1"
    assert rec["units"] == [{"host": "h1", "unit": "u0", "pids": [4242], "image": "sha256:1" + "0" * 63}]
    # the descriptor is pinned: a capture moves `current` on, the record still names what runs
    pinned = rec["request"]["artifact"]
    assert pinned["path"] == str(ARTIFACTS["store"] / "000001" / "artifact.json")
    assert pinned["sha256"].startswith("sha256:") and len(pinned["sha256"]) == 71
    rollback.forget(tmp_path, "demo")
    assert not path.exists()


def test_a_failure_after_eviction_restores_the_recorded_request_as_its_rollback(tmp_path):
    rollback.remember(tmp_path, request("op-1"), result_of(tmp_path, "op-1", succeeded=True, units=RUNNING).receipt)
    failed = result_of(tmp_path, "op-2", succeeded=False, eviction=EVICTED,
                       message="restore failed after eviction: the workload that ran before was evicted and is not "
                               "running: unit u0. The cause: unit u0: the engine died")
    rb = result_of(tmp_path, "op-2-rollback", succeeded=True, units=RUNNING)
    (ARTIFACTS["store"] / "current").unlink()
    (ARTIFACTS["store"] / "current").symlink_to("000002")  # a capture since: `current` is generation 2
    out, calls, lines = after(tmp_path, Config(tmp_path, request("op-2"), "op-2"), failed, outcome=rb)
    kw = calls[0]
    assert kw["operation"] == "restore" and kw["request"]["id"] == "op-2-rollback"
    assert kw["request"]["artifact"]["path"] == str(ARTIFACTS["store"] / "000001" / "artifact.json"), \
        "what ran (generation 1), not what `current` names now"
    assert kw["request"]["workload"] == {"recipe": "demo"}
    assert "coldsnap_request" not in kw["extravars"] and kw["extravars"]["mine"] == 1, "contract vars set anew"
    assert kw["secret_extravars"] == {"registry_password": "s3cret"}, "the same credentials, as secrets"
    assert lines and "rolling back" in lines[0]
    msg = out.receipt["error"]["message"]
    assert msg == ("restore failed after eviction and was rolled back: the workload that ran before was restored "
                   "again (capture cap-1) by restore op-2-rollback and serves. The cause: unit u0: the "
                   "engine died"), msg
    assert out.receipt["result"]["eviction"]["previous_workload"] == "rolled-back"
    assert out.receipt["result"]["rollback"]["state"] == "succeeded" and not out.succeeded
    on_disk = json.loads(out.receipt_path.read_text())
    assert on_disk == out.receipt, "the failed run's receipt file says it too"
    assert json.loads(rollback.serving_path(tmp_path, "demo").read_text())["operation_id"] == "op-2-rollback"


@pytest.mark.parametrize("case", ["disabled", "no record", "other pids", "other unit"])
def test_no_rollback_without_a_record_of_exactly_what_was_evicted(tmp_path, case):
    if case != "no record":
        units = RUNNING if case != "other unit" else [{**RUNNING[0], "unit": "u9"}]
        rollback.remember(tmp_path, request("op-1"), result_of(tmp_path, "op-1", succeeded=True, units=units).receipt)
    evicted = json.loads(json.dumps(EVICTED))
    if case == "other pids":  # another controller restored the workload since
        evicted["units"][0]["pids"] = [777]
    failed = result_of(tmp_path, "op-2", succeeded=False, eviction=evicted)
    out, calls, _lines = after(tmp_path, Config(tmp_path, request("op-2"), "op-2"), failed, enabled=case != "disabled")
    assert not calls
    info = out.receipt["result"]["rollback"]
    assert info["attempted"] is False
    assert {"disabled": "--no-rollback", "no record": "no record", "other pids": "another controller",
            "other unit": "was not part of"}[case] in info["why"], info
    assert out.receipt["result"]["eviction"]["previous_workload"] == "evicted"
    assert out.receipt["error"]["message"].endswith(f"No rollback: {info['why']}.")


def test_nothing_to_do_before_eviction_or_for_prepare_only(tmp_path):
    rollback.remember(tmp_path, request("op-1"), result_of(tmp_path, "op-1", succeeded=True, units=RUNNING).receipt)
    untouched = result_of(tmp_path, "op-2", succeeded=False, eviction={**EVICTED, "previous_workload": "untouched"})
    out, calls, _lines = after(tmp_path, Config(tmp_path, request("op-2"), "op-2"), untouched)
    assert not calls and "rollback" not in out.receipt["result"]
    failed = result_of(tmp_path, "op-3", succeeded=False, eviction=EVICTED)
    out, calls, _lines = after(tmp_path, Config(tmp_path, request("op-3"), "op-3", prepare_only=True), failed)
    assert not calls and "rollback" not in out.receipt["result"]


def test_a_rollback_that_cannot_start_or_fails_says_so(tmp_path):
    rollback.remember(tmp_path, request("op-1"), result_of(tmp_path, "op-1", succeeded=True, units=RUNNING).receipt)
    failed = result_of(tmp_path, "op-2", succeeded=False, eviction=EVICTED)
    gone = ColdSnapError("$.artifact.path: /x/artifact.json does not exist on this controller", fix="capture first")
    out, _calls, _lines = after(tmp_path, Config(tmp_path, request("op-2"), "op-2"), failed, raises=gone)
    info = out.receipt["result"]["rollback"]
    assert info["attempted"] and info["state"] == "failed" and "does not exist" in info["why"]
    assert "The rollback (restore op-2-rollback, to what operation op-1 restored) failed too" in \
        out.receipt["error"]["message"]
    failed = result_of(tmp_path, "op-3", succeeded=False, eviction=EVICTED)
    rb = result_of(tmp_path, "op-3-rollback", succeeded=False, eviction=EVICTED, message="the engine died again")
    out, _calls, _lines = after(tmp_path, Config(tmp_path, request("op-3"), "op-3"), failed, outcome=rb)
    assert out.receipt["result"]["rollback"]["why"] == "the engine died again"
    assert out.receipt["result"]["eviction"]["previous_workload"] == "evicted"
    assert json.loads(rollback.serving_path(tmp_path, "demo").read_text())["operation_id"] == "op-1"


def test_docker_units_roll_back_only_to_the_capsule_that_ran(tmp_path):
    rollback.remember(tmp_path, request("op-1"), result_of(tmp_path, "op-1", succeeded=True, units=RUNNING).receipt)
    record = rollback.recorded(tmp_path, "demo")
    ran = {"host": "h1", "unit": "u0", "container": "cs-demo-u0", "status": "running"}
    assert rollback.same_workload(record, [{**ran, "image": "sha256:1" + "0" * 63}]) is None
    assert "not the capsule" in rollback.same_workload(record, [{**ran, "image": "sha256:2" + "0" * 63}])
    assert "not known" in rollback.same_workload(record, [ran])


def test_a_success_that_cannot_be_recorded_is_a_warning_and_no_rollback_target(tmp_path):
    rollback.remember(tmp_path, request("op-1"), result_of(tmp_path, "op-1", succeeded=True, units=RUNNING).receipt)
    gone = {**request("op-2"), "artifact": {"path": str(tmp_path / "nowhere" / "artifact.json")}}
    ok = result_of(tmp_path, "op-2", succeeded=True, units=RUNNING)
    out = rollback.after_restore(Config(tmp_path, gone, "op-2"), ok, enabled=True, build=None, run=None, say=print)
    assert out.succeeded and "could not record" in out.receipt["result"]["controller_warnings"][-1]
    assert rollback.recorded(tmp_path, "demo") is None, "no rollback to a guess"


def test_a_cancelled_restore_or_rollback_says_so(tmp_path):
    rollback.remember(tmp_path, request("op-1"), result_of(tmp_path, "op-1", succeeded=True, units=RUNNING).receipt)
    failed = result_of(tmp_path, "op-2", succeeded=False, eviction=EVICTED)
    out = rollback.after_restore(Config(tmp_path, request("op-2"), "op-2"), failed, enabled=True,
                                 build=lambda **kw: kw, run=None, say=print, cancelled=lambda: True)
    assert out.receipt["result"]["rollback"] == {"attempted": False, "why": "the restore was cancelled"}
    failed = result_of(tmp_path, "op-3", succeeded=False, eviction=EVICTED)
    rb = dataclasses.replace(result_of(tmp_path, "op-3-rollback", succeeded=False, eviction=EVICTED), cancelled=True)
    out, _calls, _lines = after(tmp_path, Config(tmp_path, request("op-3"), "op-3"), failed, outcome=rb)
    assert out.receipt["result"]["rollback"]["state"] == "cancelled" and out.cancelled and out.exit_code == 130


def test_a_hand_over_is_kept_only_for_a_rollback_that_could_run(tmp_path):
    """Kept with nothing to roll back to (--no-rollback, no record), a restore's unused hand-over held the
    evicted workload away from the next run for two minutes."""
    assert not rollback.keeps_handover(tmp_path, request("op-1"), enabled=True), "nothing recorded yet"
    rollback.remember(tmp_path, request("op-1"), result_of(tmp_path, "op-1", succeeded=True, units=RUNNING).receipt)
    assert rollback.keeps_handover(tmp_path, request("op-2"), enabled=True)
    assert not rollback.keeps_handover(tmp_path, request("op-2"), enabled=False), "--no-rollback"
    assert not rollback.keeps_handover(tmp_path, {"id": "op-3", "operation": "restore"}, enabled=True)


def test_a_cancelled_restore_gives_back_its_hand_over_and_a_rollback_takes_it(tmp_path):
    """No rollback follows a cancel: the hand-over its evict step left (its ``always`` did not run) is given
    back by the release playbook, under ``<id>-release`` and the restore's run id; a rollback takes it."""
    rollback.remember(tmp_path, request("op-1"), result_of(tmp_path, "op-1", succeeded=True, units=RUNNING).receipt)
    failed = dataclasses.replace(result_of(tmp_path, "op-2", succeeded=False, eviction=EVICTED), cancelled=True)
    config = Config(tmp_path, request("op-2"), "op-2",
                    public_vars={"coldsnap_request": {}, "coldsnap_run_id": "r7", "coldsnap_keep_handover": True})
    builds, released = [], []

    def build(**kw):
        builds.append(kw)
        return kw

    ok = result_of(tmp_path, "op-2-release", succeeded=True)
    out = rollback.after_restore(config, failed, enabled=True, build=build, run=None, say=print,
                                 release=lambda cfg: released.append(cfg) or ok)
    assert out.receipt["result"]["rollback"] == {"attempted": False, "why": "the restore was cancelled",
                                                 "handover": "given back"}
    (cfg,) = released
    assert cfg["playbook"] == "coldsnap.fleet.release" and cfg["request"]["id"] == "op-2-release"
    assert cfg["operation"] == "restore"
    warm = rollback.after_restore(dataclasses.replace(config, operation="warm"), failed, enabled=True, build=build,
                                  run=None, say=print, release=lambda cfg: released.append(cfg) or ok)
    assert warm.receipt["result"]["rollback"]["handover"] == "given back"
    assert released[-1]["operation"] == "warm", "a warm restore's release is run as one"
    assert cfg["extravars"] == {"coldsnap_run_id": "r7", "coldsnap_handover_of": "op-2"}, "its run id, not kept"
    # the release itself fails: said, with the wait the next restore then has
    nope = result_of(tmp_path, "op-3-release", succeeded=False, message="host h1 unreachable")
    out = rollback.after_restore(Config(tmp_path, request("op-3"), "op-3"), dataclasses.replace(
        result_of(tmp_path, "op-3", succeeded=False, eviction=EVICTED), cancelled=True), enabled=True, build=build,
        run=None, say=print, release=lambda cfg: nope)
    assert out.receipt["result"]["rollback"]["handover"].startswith("not given back (host h1 unreachable)")
    # a rollback that runs takes the hand-over: nothing is given back
    released.clear()
    failed = result_of(tmp_path, "op-4", succeeded=False, eviction=EVICTED)
    rb = result_of(tmp_path, "op-4-rollback", succeeded=True, units=RUNNING)
    out = rollback.after_restore(Config(tmp_path, request("op-4"), "op-4"), failed, enabled=True, build=build,
                                 run=lambda cfg: rb, say=print, release=released.append)
    assert out.receipt["result"]["rollback"]["state"] == "succeeded" and not released
