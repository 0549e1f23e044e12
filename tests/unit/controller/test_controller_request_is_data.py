"""A request is data: text in it that looks like Jinja reaches the playbook as that text, never as a
template that runs on the controller. Ansible trusts extra vars as templates, and the request is one;
``coldsnap status`` with a prompt of ``{{ lookup('pipe', ...) }}`` used to run that command as root.
Real ansible-runner runs of a real playbook on localhost."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from coldsnap import api

REPO = Path(__file__).resolve().parents[3]
LOCAL_VARS = f"ansible_connection=local ansible_python_interpreter={sys.executable}"

READS_THE_REQUEST = """\
- name: Read the request's strings the way the collection's roles do
  hosts: all
  gather_facts: false
  tasks:
    - name: Show the prompt
      ansible.builtin.debug:
        msg: "prompt: {{ coldsnap_request.validation.prompt }}"
    - name: Publish what the play saw
      ansible.builtin.set_stats:
        data:
          coldsnap_result:
            prompt: "{{ coldsnap_request.validation.prompt }}"
            environment: "{{ coldsnap_request.launch.units[0].environment }}"
            command: "{{ coldsnap_request.launch.units[0].command }}"
"""


def test_jinja_in_a_request_is_text_on_the_controller(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    attack = "{{ lookup('ansible.builtin.pipe', 'touch " + str(marker) + "') }}"
    request = json.loads((REPO / "tests" / "fixtures" / "requests" / "capture-reference.json").read_text())
    request["operation"] = "status"
    request["artifact"] = {"path": "/var/lib/coldsnap/artifacts/fixture/artifact.json"}
    request["validation"]["prompt"] = "Say {% raw %}hi{% endraw %} " + attack
    request["launch"]["units"][0]["environment"].update({"X": attack, "N": "8", "B": "off", "E": ""})
    request["launch"]["units"][0]["command"] = [*request["launch"]["units"][0]["command"], "--x={#c#}"]
    path = tmp_path / "status.json"
    path.write_text(json.dumps(request))
    playbook = tmp_path / "reads.yml"
    playbook.write_text(READS_THE_REQUEST)
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(f"[coldsnap_units]\nlocalhost {LOCAL_VARS}\n")

    receipt = api.status(path, inventory=inventory, state_root=tmp_path / "state", playbook=playbook)

    assert receipt.succeeded, receipt.error
    assert not marker.exists(), "a template in the request ran on the controller"
    seen = receipt.result["operation"]
    assert seen["prompt"] == request["validation"]["prompt"]
    assert seen["environment"] == request["launch"]["units"][0]["environment"]  # "8", "off", "" stay strings
    assert seen["command"] == request["launch"]["units"][0]["command"]


def test_a_link_planted_below_the_state_root_is_never_written_through(tmp_path: Path) -> None:
    """runs/ (or locks/) of a state root a user owns, made a link to elsewhere (/etc): root used to chmod the
    link's target 0700 and write the run directory into it."""
    import os
    import stat

    import pytest
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError

    victim = tmp_path / "victim"
    victim.mkdir(mode=0o755)
    os.chmod(victim, 0o755)
    request = json.loads((REPO / "tests" / "fixtures" / "requests" / "capture-reference.json").read_text())
    request["operation"] = "stop"
    request["artifact"] = {"path": "/var/lib/coldsnap/artifacts/fixture/artifact.json"}
    path = tmp_path / "stop.json"
    path.write_text(json.dumps(request))
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(f"[coldsnap_units]\nlocalhost {LOCAL_VARS}\n")
    playbook = REPO / "tests" / "fixtures" / "playbooks" / "succeed.yml"
    for planted in ("runs", "locks"):
        state = tmp_path / f"state-{planted}"
        state.mkdir(mode=0o700)
        (state / planted).symlink_to(victim)
        with pytest.raises(ColdSnapError, match="symbolic link"):
            api.stop(path, inventory=inventory, state_root=state, playbook=playbook)
        assert stat.S_IMODE(victim.stat().st_mode) == 0o755 and list(victim.iterdir()) == []
