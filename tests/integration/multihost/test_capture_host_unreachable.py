"""FAULTS 25 on the capsule path: a unit restored on host B whose OCI-layout capsule is on its capture
host A, which cannot be reached. Ansible reports a delegated task's unreachable host as the host the task
runs for, so without care the receipt named B (reachable, ready) unreachable and never A. The restore
role's capsule pull fails naming the capture host, as its payload pull does, and pulls nothing; the
receipt's unreachable hosts leave B out."""

from __future__ import annotations

import io
import socket
import sys
from pathlib import Path

import yaml
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.timing import SpanRecorder

from coldsnap.runner.driver import _error
from coldsnap.runner.events import EventCollector
from coldsnap.runner.progress import ProgressReporter
from coldsnap.runner.redaction import Redactor

PLAYBOOK = """
- name: Bring unit-0's capsule from its capture host
  hosts: hostb
  gather_facts: false
  vars:
    coldsnap_request: {id: f25-capsule}
  tasks:
    - name: Stage the capsule
      ansible.builtin.include_role:
        name: coldsnap.fleet.coldsnap_restore
        tasks_from: stage_capsule
      vars:
        coldsnap_restore_capsule: {unit: unit-0, host: hosta, location: "{{ capsule_dir }}"}
"""


def _closed_port() -> int:
    """A local TCP port nothing listens on (ssh to it is refused: the host is unreachable)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_capture_host_is_named_and_the_restoring_host_is_not(tmp_path):
    import ansible_runner

    state = tmp_path / "state"
    capsule_dir = state / "capsules" / "oci" / ("ab" * 32)
    inventory = {"all": {"hosts": {
        "hostb": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable},
        "hosta": {"ansible_host": "127.0.0.1", "ansible_port": _closed_port(), "ansible_user": "nobody",
                  "ansible_ssh_common_args": "-o ConnectTimeout=5 -o StrictHostKeyChecking=no"},
    }}}
    pdd = tmp_path / "pdd"
    (pdd / "project").mkdir(parents=True)
    (pdd / "project" / "restore_capsule.yml").write_text(PLAYBOOK)
    collector = EventCollector(SpanRecorder("controller"), parent_span_id=None, redactor=Redactor(),
                               progress=ProgressReporter(False, stream=io.StringIO()))
    r = ansible_runner.run(
        private_data_dir=str(pdd), playbook="restore_capsule.yml", inventory=yaml.safe_dump(inventory),
        extravars={"coldsnap_restore_state_root": str(state), "capsule_dir": str(capsule_dir),
                   "coldsnap_restore_progress_root": str(tmp_path / "progress")},
        envvars={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}, event_handler=collector, quiet=True)
    assert r.status == "failed"
    assert "hostb" not in collector.unreachable_hosts, "host B was reachable: the capture host is the one to name"
    error = _error(collector, cancelled=False, in_flight=[], controller_error=None, runner_status=r.status, rc=r.rc)
    assert error["host"] == "hostb" and "capture host hosta is unreachable" in error["message"], error
    assert not capsule_dir.exists()
