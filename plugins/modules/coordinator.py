#!/usr/bin/python
# Copyright: ColdSnap maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module coldsnap.fleet.coordinator: the activation-scoped CSKV coordinator."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: coordinator
short_description: Start, stop or inspect the activation-scoped CSKV coordinator
version_added: "0.1.0"
description:
  - Runs one CSKV v1 coordinator per activation on the chosen host as a detached background process.
    Ranks use it for barriers (CRIU, CUDA, process release) and to exchange fresh transport endpoints.
  - The server writes an endpoint descriptor (address, port, scope, random token) with mode 0600 to
    O(endpoint_file). Only processes of the same user can read the token; it is generated inside the
    server process and never returned, logged or passed on a command line.
  - A pid file (C(<endpoint_file>.pid)) and the server's log (C(<endpoint_file>.log)) live beside it.
extends_documentation_fragment:
  - coldsnap.fleet.attributes
  - coldsnap.fleet.attributes.ACTION_GROUP
  - coldsnap.fleet.state.UNUSED
options:
  state:
    description:
      - V(started) ensures a coordinator for O(scope) is running and healthy.
      - V(stopped) stops it (SIGTERM, then SIGKILL after a timeout) and removes its endpoint file, pid record
        and code copy; its log (C(<endpoint_file>.log), for diagnosis) and its lock file stay.
      - V(status) only reports.
    type: str
    choices: [started, stopped, status]
    default: started
  endpoint_file:
    description:
      - Path of the endpoint descriptor. Its directory is created with mode 0700 when missing.
      - A path that names a directory is refused, and so is one where a file the coordinator did not
        write already sits (at the path itself, C(<endpoint_file>.pid) or C(.<endpoint_file>.code));
        such paths are never removed or replaced. Paths that differ only by C(..) or a symbolic link in the
        directory name the same coordinator.
    type: path
    required: true
  address:
    description:
      - IP address to listen on. The default is loopback only; give V(0.0.0.0) or an interface address
        only when ranks on other hosts must reach the coordinator.
    type: str
    default: 127.0.0.1
  port:
    description:
      - TCP port; V(0) picks a free ephemeral port (read it from RV(endpoint.port)).
    type: int
    default: 0
  scope:
    description:
      - The operation id of the activation. Required when O(state=started). Starting again with the same
        scope is a no-op; a coordinator of another scope on the same O(endpoint_file) is an error.
    type: str
  python:
    description:
      - Python (>= 3.11) that runs the server on the host. Defaults to the interpreter running this module.
    type: path
  timeout:
    description:
      - Seconds to wait for the server to become ready (start) or to exit after SIGTERM (stop); more than 0.
      - A server not ready in time is stopped and its files removed; the task fails.
    type: float
    default: 15
attributes:
  check_mode:
    support: full
  diff_mode:
    support: none
  idempotent:
    support: full
notes:
  - The token never leaves the 0600 endpoint file; consumers on the host read that file.
  - See docs/coordinator.md in the collection for the CSKV v1 wire format.
author:
  - ColdSnap maintainers (@coldsnap)
"""

EXAMPLES = r"""
- name: Start the coordinator for this activation
  coldsnap.fleet.coordinator:
    state: started
    endpoint_file: "{{ coldsnap_state_root }}/runs/{{ operation_id }}/coordinator.json"
    scope: "{{ operation_id }}"
  register: coord
  run_once: true
  delegate_to: "{{ groups['coldsnap_units'][0] }}"

- name: Show where ranks connect
  ansible.builtin.debug:
    msg: "coordinator at {{ coord.endpoint.address }}:{{ coord.endpoint.port }}"

- name: Stop it when the activation is done
  coldsnap.fleet.coordinator:
    state: stopped
    endpoint_file: "{{ coldsnap_state_root }}/runs/{{ operation_id }}/coordinator.json"
"""

RETURN = r"""
endpoint:
  description: Where the coordinator listens (never the token). Null when it is not running.
  returned: always
  type: dict
  contains:
    address:
      description: IP address the coordinator listens on.
      type: str
      sample: 127.0.0.1
    port:
      description: TCP port the coordinator listens on.
      type: int
      sample: 40123
    scope:
      description: The operation id the coordinator serves.
      type: str
      sample: op-20261129-0001
    endpoint_file:
      description: Path of the 0600 endpoint descriptor (which holds the token).
      type: str
      sample: /var/lib/coldsnap/runs/op-20261129-0001/coordinator.json
running:
  description: Whether the coordinator process runs (after the task).
  returned: always
  type: bool
  sample: true
healthy:
  description: Whether it answered a CSKV health request.
  returned: always
  type: bool
  sample: true
pid:
  description: Process id of the server, or null.
  returned: always
  type: int
  sample: 4242
state:
  description: The requested state.
  returned: always
  type: str
  sample: started
msg:
  description: What was found or done.
  returned: always
  type: str
  sample: "started, running, pid 4242, coordinator 127.0.0.1:40123 (scope op-1)"
"""

import traceback

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import STATE_ROOT_ARG
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.daemon import (
    coordinator_status,
    start_coordinator,
    stop_coordinator,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.endpoint import read_endpoint


def run_module(params: dict, check_mode: bool):
    """Dispatch on state; returns the daemon state (no token)."""
    state = params["state"]
    if state == "started":
        return start_coordinator(
            params["endpoint_file"],
            scope=params["scope"],
            address=params["address"],
            port=params["port"],
            python=params["python"],
            check_mode=check_mode,
            startup_timeout=params["timeout"],
        )
    if state == "stopped":
        return stop_coordinator(params["endpoint_file"], check_mode=check_mode, timeout=params["timeout"])
    return coordinator_status(params["endpoint_file"])


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "state": {"type": "str", "choices": ["started", "stopped", "status"], "default": "started"},
            "endpoint_file": {"type": "path", "required": True},
            "address": {"type": "str", "default": "127.0.0.1"},
            "port": {"type": "int", "default": 0},
            "scope": {"type": "str"},
            "python": {"type": "path"},
            "timeout": {"type": "float", "default": 15.0},
            "state_root": dict(STATE_ROOT_ARG),
        },
        required_if=[("state", "started", ["scope"])],
        supports_check_mode=True,
    )
    try:
        result = run_module(module.params, module.check_mode)
    except ColdSnapError as exc:
        module.fail_json(msg=str(exc))
    except Exception as exc:  # an unexpected bug: keep the traceback for the report
        module.fail_json(msg=f"coordinator: unexpected {type(exc).__name__}: {exc}",
                         exception=traceback.format_exc())
    # Belt and braces: should any future field carry the token, Ansible masks it.
    try:
        module.no_log_values.add(read_endpoint(module.params["endpoint_file"]).token)
    except (ColdSnapError, OSError):
        pass
    module.exit_json(state=module.params["state"], **result.as_dict())


if __name__ == "__main__":
    main()
