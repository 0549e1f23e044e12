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
