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
import yaml
from module_runner import ansible_env

PLAYBOOKS = Path(__file__).resolve().parents[3] / "playbooks"
TWO_HOSTS = [{"id": "unit-0", "host": "localhost"}, {"id": "unit-1", "host": "gpu-b"}]


def _play(tmp_path: Path, playbook: str, operation: str, units: list, inventory: str, *extra: str,
          env: dict | None = None, request: dict | None = None):
    extra_vars = tmp_path / "vars.json"
    extra_vars.write_text(json.dumps({"coldsnap_request": {"format": 4, "operation": operation, "id": "op-1",
                                                           "launch": {"units": units}, **(request or {})}}))
    exe = Path(sys.executable).parent / "ansible-playbook"
    proc = subprocess.run([str(exe if exe.exists() else shutil.which("ansible-playbook")), "-i", inventory,
                           "-c", "local", str(PLAYBOOKS / f"{playbook}.yml"), "-e", f"@{extra_vars}",
                           "-e", f"coldsnap_state_root={tmp_path / 'state'}", *extra],
                          capture_output=True, text=True, env={**ansible_env(), **(env or {})}, timeout=300,
                          check=False)
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


@pytest.mark.parametrize(("playbook", "operation", "extra"), [
    ("wake", "wake", ()), ("restore", "restore", ("-e", "coldsnap_capture_overlay=true"))])
def test_fewer_forks_than_unit_hosts_fail_before_a_step_whose_units_wait_for_one_another(tmp_path, playbook,
                                                                                         operation, extra):
    # A wake (and an in-place overlay capture) runs on each host in the foreground while its units wait for one
    # another: one host per fork would wake them one after another, the first waiting for ever.
    rc, out = _play(tmp_path, playbook, operation, TWO_HOSTS, "localhost,gpu-b,", "--forks", "1", *extra)
    assert rc != 0 and "the request's units are on 2 hosts" in out and "this run has 1 forks" in out, out[-3000:]
    assert not (tmp_path / "state").exists()


def test_enough_forks_pass_the_fork_check(tmp_path):
    # it goes on to the playbook's own checks (here: the artifact a wake needs is not there)
    rc, out = _play(tmp_path, "wake", "wake", TWO_HOSTS, "localhost,gpu-b,", "--forks", "2",
                    request={"artifact": {"path": str(tmp_path / "missing.json")}})
    assert rc != 0 and "a wake brings the weights back from it" in out and "this run has" not in out, out[-3000:]
    rc, out = _play(tmp_path, "sleep", "sleep", TWO_HOSTS, "localhost,gpu-b,", "--forks", "1")
    assert "this run has" not in out, out[-3000:]


def _plays():
    for path in sorted(PLAYBOOKS.glob("*.yml")):
        for play in yaml.safe_load(path.read_text()) or []:
            if "hosts" in play:
                yield path.name, play


@pytest.mark.parametrize(("name", "play"), [(n, p) for n, p in _plays() if p.get("any_errors_fatal")],
                         ids=lambda v: v if isinstance(v, str) else v["name"])
def test_plays_that_stop_every_host_on_a_failure_run_in_step_whatever_the_configured_strategy(name, play):
    # ANSIBLE_STRATEGY=free (ansible.cfg, an AWX setting) ignores any_errors_fatal and runs run_once tasks (the
    # coordinator's start and stop) on every host: one host would stop the coordinator the others still use.
    assert play.get("strategy") == "linear", f"{name}: {play['name']}"


def test_free_strategy_from_the_configuration_gives_no_warning_about_ignored_keywords(tmp_path):
    rc, out = _play(tmp_path, "sleep", "sleep", TWO_HOSTS, "localhost,gpu-b,", "--limit", "localhost",
                    env={"ANSIBLE_STRATEGY": "free"})
    assert rc != 0 and "this run leaves out gpu-b" in out, out[-3000:]
    assert "free strategy" not in out, out[-3000:]


@pytest.mark.parametrize("setting", ["coldsnap_progress_delay=0", "coldsnap_async_limit=4h", "coldsnap_async_limit=0"])
def test_a_zero_or_no_number_for_the_waits_fails_before_anything_runs(tmp_path, setting):
    # each wait's retries are the limit over the delay: a 0 failed the wait of an activation already started
    # in the background, after the eviction
    rc, out = _play(tmp_path, "restore", "restore", TWO_HOSTS, "localhost,gpu-b,", "-e", setting)
    assert rc != 0 and "must be a whole number of seconds > 0" in out and "nothing was touched" in out, out[-3000:]
    assert not (tmp_path / "state").exists()
