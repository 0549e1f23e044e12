"""The roles check their variables before any task runs: a missing request or activation is named by
Ansible's argument validation (also for the task files the playbooks include), never a raw Jinja error,
and nothing is evicted first."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from module_runner import ansible_env

PLAYBOOK = """- hosts: localhost
  gather_facts: false
  tasks:
    - ansible.builtin.include_role:
        name: coldsnap.fleet.{role}
        tasks_from: {tasks_from}
"""


@pytest.mark.parametrize(("role", "tasks_from", "missing"), [
    ("coldsnap_capture", "main", "coldsnap_host_activation, coldsnap_request"),
    ("coldsnap_coordinator", "main", "coldsnap_request"),
    ("coldsnap_restore", "main", "coldsnap_artifact, coldsnap_request"),
    ("coldsnap_restore", "activate", "coldsnap_artifact, coldsnap_host_activation, coldsnap_request"),
    ("coldsnap_overlay", "main", "coldsnap_artifact, coldsnap_host_activation, coldsnap_request"),
])
def test_a_role_without_its_variables_names_them(tmp_path: Path, role: str, tasks_from: str, missing: str) -> None:
    playbook = tmp_path / "pb.yml"
    playbook.write_text(PLAYBOOK.format(role=role, tasks_from=tasks_from))
    ansible_playbook = Path(sys.executable).parent / "ansible-playbook"
    proc = subprocess.run([str(ansible_playbook if ansible_playbook.exists() else shutil.which("ansible-playbook")),
                           "-i", "localhost,", "-c", "local", str(playbook), "-e", f"coldsnap_state_root={tmp_path}"],
                          capture_output=True, text=True, env=ansible_env(), timeout=300, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and f"missing required arguments: {missing}" in out, out[-3000:]
    assert "is undefined" not in out, out[-3000:]


@pytest.mark.parametrize(("operation", "fails"), [("status", False), ("stop", False), ("wake", True),
                                                  ("restore", True)])
def test_the_playbooks_run_as_awx_does_say_the_artifact_is_gone(tmp_path: Path, operation: str, fails: bool) -> None:
    """After `coldsnap delete` removed a running generation's artifact, the collection's playbooks run directly
    (an AWX job template) act on what runs for status and stop, and refuse a wake or restore naming the
    artifact, never with a raw lookup error."""
    import json

    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request

    request = json.loads((Path(__file__).resolve().parents[2] / "fixtures" / "requests"
                          / "capture-reference.json").read_text())
    request["operation"] = operation
    request["artifact"] = {"path": str(tmp_path / "deleted" / "artifact.json")}
    if operation == "restore":
        request["artifact"]["sha256"] = "sha256:" + "0" * 64
    request["workload"]["recipe"] = f"gone-{operation}"
    extravars = tmp_path / "extravars.json"
    extravars.write_text(json.dumps({"coldsnap_request": validate_request(request, document="request"),
                                     "coldsnap_state_root": str(tmp_path / "state"), "coldsnap_prepare_only": False}))
    ansible_playbook = Path(sys.executable).parent / "ansible-playbook"
    playbook = Path(__file__).resolve().parents[3] / "playbooks" / f"{operation}.yml"
    proc = subprocess.run([str(ansible_playbook if ansible_playbook.exists() else shutil.which("ansible-playbook")),
                           "-i", "localhost,", "-c", "local", "-e", f"ansible_python_interpreter={sys.executable}",
                           "-e", f"@{extravars}", str(playbook)],
                          capture_output=True, text=True, env=ansible_env(), timeout=300, check=False)
    out = proc.stdout + proc.stderr
    assert "lookup plugin" not in out and "Finalization of task args" not in out, out[-3000:]
    if fails:
        assert proc.returncode != 0 and "is not there" in out, out[-3000:]
    else:
        assert proc.returncode == 0, out[-3000:]


ROLES = Path(__file__).resolve().parents[3] / "roles"
# Helpers of another default, never set by a user: coldsnap_coordinator_bind's inventory address.
INTERNAL_DEFAULTS = {"coldsnap_coordinator_inventory_address"}


@pytest.mark.parametrize("role", sorted(p.name for p in ROLES.iterdir() if (p / "defaults" / "main.yml").exists()))
def test_every_role_default_is_a_documented_argument(role: str) -> None:
    """A variable a role's defaults set is an option of one of its entry points (argument_specs): a user who
    sets it is told what it does, and a wrong type is named before any task runs."""
    import yaml

    defaults = set(yaml.safe_load((ROLES / role / "defaults" / "main.yml").read_text()) or {})
    specs = yaml.safe_load((ROLES / role / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    options = {name for entry in specs.values() for name in (entry.get("options") or {})}
    assert defaults - options - INTERNAL_DEFAULTS == set(), f"{role}: defaults without an argument spec"
