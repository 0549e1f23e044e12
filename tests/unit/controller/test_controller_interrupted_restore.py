"""What a restore's receipt says when the run is cut off after its evict step: the events of a run as
ansible-runner reports them, played into the controller's run without Ansible. A cancel while the
activation runs as an async job (live progress) leaves that job running: the workload there is not
known to be gone, and no rollback races it; a cancel of the step in the foreground stops it (evicted)."""

from __future__ import annotations

import io
import threading
from pathlib import Path
from types import SimpleNamespace

from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import eviction

from coldsnap.runner import rollback
from coldsnap.runner.driver import PlaybookRun, RunConfig, eviction_record, with_eviction

PLAY = "ColdSnap restore | evict and activate"
EVICTED = {"unit": "unit-0", "pid": 4242, "pids": [4242], "processes": 1}


def _event(counter: int, name: str, task: str, action: str, res: dict | None = None) -> dict:
    data = {"host": "localhost", "task": task, "task_uuid": task, "play": PLAY,
            "resolved_action": action}
    if res is not None:
        data["res"] = res
    return {"event": name, "counter": counter, "uuid": f"e-{counter}", "event_data": data}


class _CancelledDuringActivation:
    """ansible-runner's ``run``: the evict step reports what it stopped, the activation starts, and the
    user presses Ctrl-C while it runs (the cancel callback then answers True)."""

    def __init__(self, cancel: threading.Event, *, live: bool) -> None:
        self.cancel, self.live = cancel, live

    def run(self, **kw):
        handler = kw["event_handler"]
        evict = {"changed": True, "stopped": [EVICTED],
                 "coldsnap_evicted": {"host": "localhost", "units": [EVICTED]}}
        handler(_event(1, "runner_on_start", "Evict this workload's running engines on the host",
                       "coldsnap.fleet.unit_restore"))
        handler(_event(2, "runner_on_ok", "Evict this workload's running engines on the host",
                       "coldsnap.fleet.unit_restore", evict))
        if self.live:  # launched as an async job; the wait task looks at it
            handler(_event(3, "runner_on_start", "Restore the units on this host (start)", "coldsnap.fleet.unit_restore"))
            handler(_event(4, "runner_on_ok", "Restore the units on this host (start)", "coldsnap.fleet.unit_restore",
                           {"changed": False, "ansible_job_id": "j1", "started": 1, "finished": 0}))
            handler(_event(5, "runner_on_start", "Restore the units on this host", "coldsnap.fleet.job_wait"))
        else:
            handler(_event(3, "runner_on_start", "Restore the units on this host", "coldsnap.fleet.unit_restore"))
        self.cancel.set()
        assert kw["cancel_callback"]() is True
        return SimpleNamespace(rc=254, status="canceled")


def _cancelled_restore(tmp_path: Path, *, live: bool) -> dict:
    config = RunConfig.build(operation="restore", request=None, playbook="playbooks/restore.yml",
                             extravars={"coldsnap_live_progress": live},
                             inventory={"all": {"hosts": {"localhost": {}}}}, state_root=tmp_path)
    (tmp_path / "runs").mkdir(mode=0o700)
    config.run_dir.mkdir(mode=0o700)
    cancel = threading.Event()
    result = PlaybookRun(config, ansible_runner=_CancelledDuringActivation(cancel, live=live), cancel_event=cancel,
                         progress=False, progress_stream=io.StringIO()).run()
    assert result.cancelled and result.exit_code == 130
    return result.receipt


def test_a_cancel_while_the_async_activation_runs_does_not_say_the_workload_is_gone(tmp_path: Path) -> None:
    receipt = _cancelled_restore(tmp_path, live=True)
    record = receipt["result"]["eviction"]
    assert record["previous_workload"] == eviction.UNKNOWN, record
    assert record["evicted"] is True and record["activation_cut_off"] == ["localhost"]
    message = receipt["error"]["message"]
    assert eviction.EVICTED_PHRASE not in message, message
    assert "unit unit-0 on localhost (engine pid 4242)" in message
    assert "may bring them back" in message and "coldsnap status" in message
    assert "operation cancelled while task 'Restore the units on this host' was running" in message


def test_a_cancel_of_the_activation_in_the_foreground_says_it_was_evicted(tmp_path: Path) -> None:
    # the controller stopped the step's whole process tree: what it evicted does not run
    record = _cancelled_restore(tmp_path, live=False)["result"]["eviction"]
    assert record["previous_workload"] == eviction.EVICTED and "activation_cut_off" not in record


def test_a_playbook_killed_from_outside_during_activation_is_unknown_and_not_rolled_back(tmp_path: Path) -> None:
    # ansible-playbook killed (OOM) while its activation step ran: the module runs on in its own session
    evictions = {"gpu-a": {"units": [EVICTED]}}
    in_flight = [{"host": "gpu-a", "task": "Restore the units on this host", "play": PLAY,
                  "action": "coldsnap.fleet.unit_restore"}]
    record = eviction_record(evictions, succeeded=False, in_flight=in_flight, detached=True)
    assert record["previous_workload"] == eviction.UNKNOWN and record["activation_cut_off"] == ["gpu-a"]
    said = with_eviction("ansible-playbook ended with status failed and no exit status", record)
    assert said.startswith("restore cut off after eviction") and eviction.EVICTED_PHRASE not in said
    # a failure after the activation ended on its own stays `evicted`; one cut off elsewhere too
    assert eviction_record(evictions, succeeded=False, in_flight=[], detached=True)["previous_workload"] == \
        eviction.EVICTED
    other = [{**in_flight[0], "host": "gpu-b"}]
    assert eviction_record(evictions, succeeded=False, in_flight=other, detached=True)["previous_workload"] == \
        eviction.EVICTED
    # no rollback races an activation that may still run
    failed = SimpleNamespace(succeeded=False, cancelled=False, receipt={"result": {"eviction": record}})
    config = SimpleNamespace(request={"workload": {"recipe": "demo"}}, prepare_only=False, state_root=tmp_path)
    assert rollback.after_restore(config, failed, enabled=True, build=None, run=None, say=print) is failed


def _two_host_restore(tmp_path: Path) -> dict:
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request

    from coldsnap.demo import reference_request

    req = reference_request(operation="restore", op_id="two-hosts", model_dir=tmp_path / "model",
                            model={"id": "org/model", "revision": "a" * 40}, port=18000, state_root=tmp_path,
                            env_digest="sha256:" + "1" * 64, artifact=tmp_path / "artifact.json", tp=2)
    for unit, host in zip(req["launch"]["units"], ("gpu-a", "gpu-b"), strict=True):
        unit["host"] = host
    return validate_request(req)


def test_a_cancel_of_a_multi_host_activation_without_live_progress_is_unknown(tmp_path: Path) -> None:
    # Units on several hosts activate as async jobs even without live progress (a host's step waits for the
    # others' units, so none may hold a fork in the foreground): a cancel leaves those jobs running.
    config = RunConfig.build(operation="restore", request=_two_host_restore(tmp_path), playbook="playbooks/restore.yml",
                             extravars={"coldsnap_live_progress": False},
                             inventory={"all": {"hosts": {"localhost": {}, "gpu-a": {}, "gpu-b": {}}}},
                             state_root=tmp_path)
    (tmp_path / "runs").mkdir(mode=0o700)
    config.run_dir.mkdir(mode=0o700)
    cancel = threading.Event()
    result = PlaybookRun(config, ansible_runner=_CancelledDuringActivation(cancel, live=True), cancel_event=cancel,
                         progress=False, progress_stream=io.StringIO()).run()
    record = result.receipt["result"]["eviction"]
    assert record["previous_workload"] == eviction.UNKNOWN, record
    assert record["activation_cut_off"] == ["localhost"]
