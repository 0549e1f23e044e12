"""Docker launch-unit primitives with a real dockerd: CRIU works inside a rank container started with them,
only the rank container is privileged, and state written by root ends up owned by the invoking user."""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import UnitError
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import containers as du
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import ownership

pytestmark = [pytest.mark.docker, pytest.mark.slow]

# PID 1 of the test container reaps orphans: a dumped process must not linger as a zombie holding its PID,
# or the restore fails with "Can't fork for PID: File exists".
REAPER = ("import os, time\nwhile True:\n    try:\n        os.wait()\n"
          "    except ChildProcessError:\n        time.sleep(0.1)\n")
COUNTER = ("import time\ni = 0\nwhile True:\n    i += 1\n"
           "    open('/state/count.tmp', 'w').write(str(i))\n    __import__('os').replace('/state/count.tmp', '/state/count')\n"
           "    time.sleep(0.05)\n")


def _labels(unit: str = "unit-0") -> dict[str, str]:
    return du.unit_labels(capture_id="cap-test-unit", unit=unit, operation_id="op-capsule-test", recipe="test")


def _count(state: Path) -> int:
    for _i in range(50):
        try:
            return int((state / "count").read_text())
        except (FileNotFoundError, ValueError):
            time.sleep(0.05)
    raise AssertionError("the counter never wrote")


@pytest.mark.criu
def test_criu_dump_and_restore_inside_a_rank_container(tmp_path, runtime_image, docker_client):
    state = tmp_path / "state"
    state.mkdir()
    name = f"coldsnap-test-criu-{uuid.uuid4().hex[:8]}"
    c = du.run_unit_container(image=runtime_image["runtime_image"], name=name, command=["python3", "-c", REAPER],
                              mounts=[{"source": str(state), "target": "/state", "read_only": False,
                                       "kind": "state"}],
                              environment={"PYTHONUNBUFFERED": "1"}, labels=_labels(), client=docker_client)
    try:
        code, out = du.exec_in(c, ["criu", "check"])
        assert code == 0 and "Looks good" in out, out
        code, out = du.exec_in(c, ["sh", "-c",
                                   f"setsid python3 -c \"{COUNTER}\" </dev/null >/dev/null 2>&1 & echo $!"])
        pid = out.strip()
        assert code == 0 and pid.isdigit(), out
        before = _count(state)
        time.sleep(0.3)
        assert _count(state) > before, "the counter runs"
        (state / "img").mkdir()
        code, out = du.exec_in(c, ["criu", "dump", "-t", pid, "-D", "/state/img", "-o", "dump.log"])
        assert code == 0, (state / "img" / "dump.log").read_text()[-2000:]
        frozen = _count(state)
        time.sleep(0.3)
        assert _count(state) == frozen, "the dumped process is gone"
        code, out = du.exec_in(c, ["criu", "restore", "-D", "/state/img", "-d", "-o", "restore.log"])
        assert code == 0, (state / "img" / "restore.log").read_text()[-2000:]
        deadline = time.monotonic() + 10
        while _count(state) <= frozen + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _count(state) > frozen + 2, "the restored process continues from where it was dumped"
        code, out = du.exec_in(c, ["sh", "-c", f"cat /proc/{pid}/cmdline | tr '\\0' ' '"])
        assert "python3" in out, "the restored process has its original PID"
    finally:
        du.remove_unit(c)


def test_only_the_rank_container_is_privileged_and_names_labels_logs_are_canonical(tmp_path, runtime_image,
                                                                                   docker_client):
    policy = du.privilege_policy(docker_client, probe_image=runtime_image["runtime_image"])
    name = du.canonical_container_name("test", f"u{uuid.uuid4().hex[:6]}")
    log = tmp_path / "logs" / "unit.log"
    rank = du.run_unit_container(image=runtime_image["runtime_image"], name=name,
                                 command=["sh", "-c", "echo started; echo oops >&2"], mounts=[], environment={},
                                 labels=_labels(), detach=False, log_path=log, client=docker_client)
    plain = du.run_unit_container(image=runtime_image["runtime_image"], name=name + "-plain", command=["true"],
                                  mounts=[], environment={}, labels=_labels("unit-1"), privileged_rank=False,
                                  client=docker_client)
    try:
        hc = docker_client.api.inspect_container(rank.id)["HostConfig"]
        assert hc["NetworkMode"] == "host"
        if policy["privileged"]:
            assert hc["Privileged"] is True
        else:
            assert hc["CapAdd"] == ["ALL"] and hc["CapDrop"] == policy["cap_drop"]
            assert "seccomp=unconfined" in hc["SecurityOpt"] and hc["MaskedPaths"] == []
        phc = docker_client.api.inspect_container(plain.id)["HostConfig"]
        assert not phc["Privileged"] and not phc["CapAdd"] and not phc["SecurityOpt"]
        assert phc["MaskedPaths"], "an ordinary unit keeps Docker's masked /proc paths"
        rank.reload()
        assert rank.name == name and rank.labels["org.coldsnap.log-path"] == str(log)
        assert rank.labels["org.coldsnap.capture-id"] == "cap-test-unit"
        assert rank.labels["org.coldsnap.operation-id"] == "op-capsule-test"
        assert du.wait_unit(rank) == 0
        # stdout and stderr are separate streams: their relative order in the log is not defined.
        assert sorted(log.read_text().splitlines()) == ["oops", "started"]
        assert [c.name for c in du.find_units(docker_client, **{"org.coldsnap.unit": "unit-1"})] == [name + "-plain"]
        with pytest.raises(UnitError, match="already exists"):
            du.run_unit_container(image=runtime_image["runtime_image"], name=name, command=["true"], mounts=[],
                                  environment={}, labels=_labels(), privileged_rank=False, client=docker_client)
        again = du.run_unit_container(image=runtime_image["runtime_image"], name=name, command=["true"], mounts=[],
                                      environment={}, labels=_labels(), privileged_rank=False, replace=True,
                                      client=docker_client)
        assert again.id != rank.id
        du.remove_unit(again)
    finally:
        du.remove_unit(rank)
        du.remove_unit(plain)


@pytest.fixture
def unprivileged_user():
    """A throw-away local user created for this test (and deleted afterwards)."""
    if os.geteuid() != 0:
        pytest.skip("creating a user needs root")
    name = f"cstest{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=False)


def _tree(root: Path) -> dict[str, tuple[int, int, int]]:
    out = {}
    for p in [root, *sorted(root.rglob("*"))]:
        st = os.lstat(p)
        out[str(p.relative_to(root))] = (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode))
    return out


def test_state_written_by_root_ends_up_owned_by_the_invoking_user(tmp_path, runtime_image, docker_client,
                                                                  unprivileged_user):
    state = tmp_path / "captures" / "cap" / "units" / "unit-0"
    other = tmp_path / "not-ours"
    state.mkdir(parents=True)
    other.mkdir()
    (other / "keep").write_text("root's")
    script = ("mkdir -p /state/criu /state/logs && head -c 4096 /dev/urandom > /state/criu/pages-1.img && "
              "echo log > /state/logs/capture.log && cp /bin/true /state/tool && chmod 4755 /state/tool && "
              "chmod 2750 /state/criu && ln -s /etc/shadow /state/link && chmod 600 /state/logs/capture.log")
    c = du.run_unit_container(image=runtime_image["runtime_image"], name=f"coldsnap-test-own-{uuid.uuid4().hex[:6]}",
                              command=["sh", "-c", script], mounts=[{"source": str(state), "target": "/state",
                                                                     "read_only": False, "kind": "state"}],
                              environment={}, labels=_labels(), client=docker_client)
    try:
        assert du.wait_unit(c, timeout=60) == 0, du.unit_logs(c)
    finally:
        du.remove_unit(c)
    before = _tree(state)
    assert {owner for owner, _gid, _mode in before.values() if owner != 0} == set(), "the unit wrote as root"
    uid, gid = unprivileged_user.pw_uid, unprivileged_user.pw_gid
    shadow = os.stat("/etc/shadow")

    res = ownership.chown_state_paths([state], uid, gid, method="container", image=runtime_image["runtime_image"],
                                      client=docker_client)
    assert res["method"] == "container" and res["changed"] == len(before)
    after = _tree(state)
    assert set(after) == set(before)
    for rel, (u, g, mode) in after.items():
        assert (u, g) == (uid, gid), rel
        assert mode == before[rel][2], f"{rel}: mode bits changed"
    assert after["tool"][2] == 0o4755 and after["criu"][2] == 0o2750
    assert (os.stat("/etc/shadow").st_uid, os.stat("/etc/shadow").st_mode) == (shadow.st_uid, shadow.st_mode)
    assert os.stat(other / "keep").st_uid == 0, "only the exact paths given are touched"
    # Idempotent: nothing left to change.
    again = ownership.chown_state_paths([state], uid, gid, method="container",
                                        image=runtime_image["runtime_image"], client=docker_client)
    assert again["changed"] == 0
    assert not docker_client.containers.list(all=True, filters={"label": "org.coldsnap.role=ownership-helper"})
