"""AWX/Tower contract: a job template runs the playbook with its extra vars; set_stats become the job's artifacts.

AWX drives ansible-runner the same way; this test does what AWX does (plain
``ansible_runner.run`` with the job template's extra vars, no coldsnap
controller involved) and checks that :func:`set_stats_artifacts` extracts the
operation result from the events, exactly as the controller's receipt does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from controller_helpers import PLAYBOOKS, REPO, REQUEST, local_inventory, request_for

from coldsnap._collection import collection_root
from coldsnap.runner import STATS_RESULT_KEY, operation_extravars, set_stats_artifacts

AWX_DOCS = REPO / "docs" / "awx"
# What AWX adds to every job's extra vars (values as a manual launch of template 12 would give).
AWX_VARS = {"awx_job_id": 42, "tower_job_id": 42, "awx_job_template_id": 12, "tower_job_template_id": 12,
            "awx_job_template_name": "ColdSnap status", "awx_job_launch_type": "manual",
            "awx_user_name": "admin", "awx_user_id": 1, "awx_inventory_name": "gpu fleet", "awx_inventory_id": 3,
            "awx_project_revision": "0123456789abcdef0123456789abcdef01234567", "awx_project_scm_branch": "main"}


def test_job_template_extra_vars_and_set_stats_artifacts(tmp_path: Path) -> None:
    import ansible_runner

    req = request_for("restore")
    # What a job template passes: our contract's extra vars plus AWX's own.
    extravars = {**operation_extravars(req, prepare_only=True), "awx_job_id": 42, "tower_job_id": 42,
                 "awx_job_template_name": "coldsnap restore", "awx_job_launch_type": "manual",
                 "awx_user_name": "admin", "awx_inventory_name": "gpu fleet"}
    events: list[dict] = []
    pdd = tmp_path / "pdd"
    pdd.mkdir()
    r = ansible_runner.run(
        private_data_dir=str(pdd), playbook=str(PLAYBOOKS / "succeed.yml"), extravars=extravars,
        inventory={"all": {"hosts": {"localhost": {"ansible_connection": "local",
                                                   "ansible_python_interpreter": sys.executable}}}},
        envvars={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"},
        quiet=True, event_handler=lambda e: events.append(e) or True)
    assert r.status == "successful", r.stdout.read() if r.stdout else r.status
    artifacts = set_stats_artifacts(events)
    assert artifacts == {STATS_RESULT_KEY: {"operation": "restore", "prepare_only": True, "token_length": 0,
                                            "env_token_length": 0, "awx_job_id": 42}}
    # The same artifacts are on disk in the runner's own event record (what AWX stores as job artifacts).
    on_disk = [json.loads(p.read_text()) for p in Path(r.config.artifact_dir, "job_events").glob("*.json")]
    assert set_stats_artifacts(sorted(on_disk, key=lambda e: e["counter"])) == artifacts


def survey_answers(state_root: Path) -> dict[str, str]:
    """The answers of docs/awx/survey.json as AWX merges them into the extra vars: strings."""
    spec = json.loads((AWX_DOCS / "survey.json").read_text())["spec"]
    answers = {q["variable"]: q["default"] for q in spec}
    assert all(isinstance(v, str) for v in answers.values())
    assert set(answers) == {"coldsnap_state_root", "coldsnap_prepare_only"}
    answers["coldsnap_state_root"] = str(state_root)  # the operator's answer
    return answers


def test_job_template_runs_the_collection_playbook_through_the_awx_project(tmp_path: Path) -> None:
    """The collection's status.yml, through docs/awx/project's wrapper, on a workload that is not running."""
    import ansible_runner
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import StateLayout
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import engine_control as ec
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import load_request

    # No artifact: nothing was captured, nothing runs. Under the survey's state root (a string) this
    # workload left the control file of an engine that is gone: status must find it there (crashed).
    req = json.loads(REQUEST.read_text()) | {"operation": "status"}
    wdir = StateLayout(tmp_path / "state").workload(req["workload"]["recipe"], "unit-0")
    wdir.mkdir(parents=True)
    ec.control_file_path(wdir, "worker-0").write_text(json.dumps({"port": 9, "token": "t" * 32, "pid": 2 ** 22 + 1}))
    # Launch-time structured extra vars (the request, as docs/awx.md builds it) + survey answers + AWX's own.
    extravars = {"coldsnap_request": load_request(json.dumps(req)), **survey_answers(tmp_path / "state"), **AWX_VARS}
    events: list[dict] = []
    pdd = tmp_path / "pdd"
    pdd.mkdir()
    r = ansible_runner.run(
        private_data_dir=str(pdd), project_dir=str(AWX_DOCS / "project"), playbook="status.yml",
        extravars=extravars, inventory=local_inventory(),
        envvars={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
                 "ANSIBLE_COLLECTIONS_PATH": str(collection_root())},
        quiet=True, event_handler=lambda e: events.append(e) or True)
    assert r.status == "successful", r.stdout.read() if r.stdout else r.status
    result = set_stats_artifacts(events)[STATS_RESULT_KEY]
    assert result["state"] == "status"
    assert [(u["unit"], u["host"], u["state"], u["ok"]) for u in result["units"]] == [
        ("unit-0", "localhost", "crashed", True)]
    # Status reads; it stages nothing (not even the activation runtime) on the host.
    assert not (tmp_path / "state" / "activation-runtime").exists()
    on_disk = [json.loads(p.read_text()) for p in Path(r.config.artifact_dir, "job_events").glob("*.json")]
    assert set_stats_artifacts(sorted(on_disk, key=lambda e: e["counter"]))[STATS_RESULT_KEY] == result
