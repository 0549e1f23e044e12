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

from controller_helpers import PLAYBOOKS, request_for

from coldsnap.runner import STATS_RESULT_KEY, operation_extravars, set_stats_artifacts


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
