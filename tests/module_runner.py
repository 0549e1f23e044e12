"""Run one of the collection's modules the way a user does: ``ansible localhost -m coldsnap.fleet.<module>``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from coldsnap._collection import collection_root

ANSIBLE = Path(sys.executable).parent / "ansible"
HAVE_ANSIBLE = ANSIBLE.exists() or shutil.which("ansible") is not None


def ansible_env() -> dict[str, str]:
    """The environment an ``ansible``/``ansible-playbook`` command of the tests runs with: this checkout's
    collection, this interpreter, no colour and no localhost warnings."""
    return {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(collection_root()),
            "ANSIBLE_PYTHON_INTERPRETER": sys.executable, "ANSIBLE_LOCALHOST_WARNING": "false",
            "ANSIBLE_INVENTORY_UNPARSED_WARNING": "false", "ANSIBLE_NOCOLOR": "1"}


def run_module(module: str, args: dict, *extra: str) -> dict:
    """The task result of ``ansible localhost -m coldsnap.fleet.<module> -a <args as JSON> <extra>``."""
    env = {**ansible_env(), "ANSIBLE_LOAD_CALLBACK_PLUGINS": "true", "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.json"}
    proc = subprocess.run([str(ANSIBLE if ANSIBLE.exists() else shutil.which("ansible")), "localhost",
                           "-m", f"coldsnap.fleet.{module}", "-a", json.dumps(args), *extra],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    text = proc.stdout
    start = 0 if text.startswith("{") else text.index("\n{") + 1
    return json.loads(text[start:])["plays"][0]["tasks"][0]["hosts"]["localhost"]
