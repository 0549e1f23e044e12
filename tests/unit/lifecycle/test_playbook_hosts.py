"""A playbook run that leaves out localhost or a unit host of the request (a --limit, an AWX job
template's limit, a unit host missing from the inventory) would act on part of a workload: a restore
evicting one host of two, a delete forgetting a descriptor whose captures stay on the other. Every
playbook that acts on unit hosts fails first, naming what is left out, before any other play runs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from module_runner import ansible_env

PLAYBOOKS = Path(__file__).resolve().parents[3] / "playbooks"
TWO_HOSTS = [{"id": "unit-0", "host": "localhost"}, {"id": "unit-1", "host": "gpu-b"}]


def _play(tmp_path: Path, playbook: str, operation: str, units: list, inventory: str, *extra: str):
    extra_vars = tmp_path / "vars.json"
    extra_vars.write_text(json.dumps({"coldsnap_request": {"format": 4, "operation": operation, "id": "op-1",
                                                           "launch": {"units": units}}}))
    exe = Path(sys.executable).parent / "ansible-playbook"
    proc = subprocess.run([str(exe if exe.exists() else shutil.which("ansible-playbook")), "-i", inventory,
                           "-c", "local", str(PLAYBOOKS / f"{playbook}.yml"), "-e", f"@{extra_vars}",
                           "-e", f"coldsnap_state_root={tmp_path / 'state'}", *extra],
                          capture_output=True, text=True, env=ansible_env(), timeout=300, check=False)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize(("playbook", "operation"), [
    ("capture", "capture"), ("restore", "restore"), ("warm", "warm"), ("sleep", "sleep"), ("wake", "wake"),
    ("status", "status"), ("stop", "stop"), ("delete", "delete")])
def test_a_limit_that_leaves_out_a_unit_host_fails_before_anything_runs(tmp_path, playbook, operation):
    rc, out = _play(tmp_path, playbook, operation, TWO_HOSTS, "localhost,gpu-b,", "--limit", "localhost")
    assert rc != 0 and "this run leaves out gpu-b" in out, out[-3000:]
    # The guard is the first play after the request's own check: nothing else ran, nothing was written.
    assert "every unit host and localhost take part" in out
    assert "ok=0" in out or "ok=1" in out, out[-3000:]
    assert not (tmp_path / "state").exists()


def test_a_limit_that_leaves_out_localhost_fails_naming_it(tmp_path):
    rc, out = _play(tmp_path, "restore", "restore", TWO_HOSTS, "localhost,gpu-b,", "--limit", "gpu-b")
    assert rc != 0 and "this run leaves out localhost" in out, out[-3000:]


def test_a_unit_host_missing_from_the_inventory_fails_naming_it(tmp_path):
    rc, out = _play(tmp_path, "sleep", "sleep", TWO_HOSTS, "localhost,")
    assert rc != 0 and "this run leaves out gpu-b" in out, out[-3000:]


def test_a_run_with_every_host_passes_the_check(tmp_path):
    # A request for another operation stops at the playbook's own check, which runs after this one.
    rc, out = _play(tmp_path, "delete", "status", [{"id": "unit-0", "host": "localhost"}], "localhost,",
                    "--limit", "localhost")
    assert rc != 0 and "Pass a delete request" in out, out[-3000:]
    assert "leaves out" not in out
