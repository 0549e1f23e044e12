"""Runtime ``docker`` restores that break part way: the captured port held on the host by a stranger, a
restore onto another port, CRIU or the rank container killed while it restores. A real dockerd and CRIU."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import load_artifact
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import containers as docker_unit
from docker_workload import DockerWorkload, not_owned, throwaway_user
from netports import another_free_port

pytestmark = [pytest.mark.docker, pytest.mark.criu, pytest.mark.slow]

RECIPE = "dockerfaults"


@pytest.fixture(scope="module")
def captured(module_tmp, runtime_image, tiny_model, recipes) -> Iterator[tuple]:
    recipes.append(RECIPE)
    with throwaway_user() as user:
        wl = DockerWorkload(module_tmp("docker-faults"), tiny_model, runtime_image["runtime_image"], RECIPE,
                            owner=(user.uid, user.gid))
        res = wl.run(wl.request("capture"))
        assert res.succeeded, res.receipt["error"]
        path = Path(res.receipt["result"]["operation"]["artifact"])
        yield wl, path, load_artifact(path.read_bytes()), user
        wl.stop()


def _listening(port: int) -> bool:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            next(fh)
            for line in fh:
                f = line.split()
                if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                    return True
    return False


def _capsule_id(art: dict) -> str:
    return art["capsule"]["units"][0]["image_id"]


# ``::`` (dual stack) holds the IPv4 port too; every pairing of addresses against the same port check:
# tests/unit/snapshot/test_ports_and_gpu_map.py
@pytest.mark.parametrize("address", ["::"])
def test_a_stranger_on_the_captured_port_is_refused_in_prepare(captured, address):
    import docker

    wl, path, art, user = captured
    wl.stop()
    fam = socket.AF_INET6 if ":" in address else socket.AF_INET
    squatter = socket.socket(fam)
    if fam == socket.AF_INET6:
        squatter.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind((address, wl.port))
    squatter.listen()
    try:
        res = wl.run(wl.request("restore", artifact=path))
        assert not res.succeeded
        err = res.receipt["error"]
        assert "prepare" in err["phase"], err
        assert str(wl.port) in err["message"] and "taken" in err["message"], err
    finally:
        squatter.close()
    assert wl.container() is None
    docker.from_env().images.get(_capsule_id(art))
    assert not_owned([wl.state_root / "workloads" / RECIPE], user.uid, user.gid) == []


def test_restore_onto_another_port_leaves_the_old_one_free(captured):
    wl, path, art, _user = captured
    wl.stop()
    new_port = another_free_port(wl.port)

    def on_port(req: dict) -> None:
        req["launch"]["execution"]["services"][0]["port"] = new_port
        cmd = req["launch"]["units"][0]["command"]
        cmd[cmd.index("--port") + 1] = str(new_port)

    try:
        res = wl.run(wl.request("restore", artifact=path, mutate=on_port))
        assert res.succeeded, res.receipt["error"]
        assert wl.complete(port=new_port) == art["acceptance"]["reply"]
        assert not _listening(wl.port), "the captured port is not listened on any more"
    finally:
        wl.stop()


def _host_pids_in_ns(ns: str) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{d}/ns/pid") == ns:
                    out.append(int(d))
    return out


def _ns_pid(host_pid: int) -> int | None:
    with contextlib.suppress(OSError), open(f"/proc/{host_pid}/status") as fh:
        for line in fh:
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    return None


class CriuKiller(threading.Thread):
    """Kills (-9) the rank container's `criu restore` of this state root once the engine's root is back."""

    def __init__(self, state_root: Path, engine_pid: int, *, container: bool = False) -> None:
        super().__init__(daemon=True)
        self.state_root, self.engine_pid, self.container = str(state_root), engine_pid, container
        self.done = threading.Event()
        self.killed: str | None = None

    def _criu(self) -> int | None:
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
                if argv and argv[0].endswith(b"criu") and b"restore" in argv and \
                        any(self.state_root.encode() in a for a in argv):
                    return int(d)
        return None

    def run(self) -> None:
        deadline = time.monotonic() + 300
        while not self.done.is_set() and time.monotonic() < deadline:
            criu = self._criu()
            if criu is None:
                time.sleep(0.002)
                continue
            ns = os.readlink(f"/proc/{criu}/ns/pid")
            while time.monotonic() < deadline:
                if any(_ns_pid(p) == self.engine_pid for p in _host_pids_in_ns(ns)):
                    break
                time.sleep(0.001)
            if self.container:
                import docker

                name = docker_unit.canonical_container_name(RECIPE, "unit-0")
                docker.from_env().containers.get(name).kill()
                self.killed = "container"
            else:
                os.kill(criu, 9)
                self.killed = "criu"
            return


# the rank container killed while something ran before: its message is the first restore's below
@pytest.mark.parametrize("what", ["criu"])
def test_a_restore_killed_part_way_leaves_nothing_and_the_rollback_restores_what_ran(captured, what):
    import docker

    wl, path, art, user = captured
    ok = wl.run(wl.request("restore", artifact=path))
    assert ok.succeeded, ok.receipt["error"]
    client = docker.from_env()
    before = wl.container().id
    engine_pid = ok.receipt["result"]["operation"]["units"][0]["workers"][0]["pid"]
    killer = CriuKiller(wl.state_root, engine_pid, container=what == "container")
    killer.start()
    try:
        req = wl.request("restore", artifact=path)
        res = wl.run(req)
        killer.done.set()
        killer.join()
        assert killer.killed == what
        assert not res.succeeded
        err = res.receipt["error"]
        assert "killed by SIGKILL" in err["message"], err
        rollback = res.receipt["result"]["rollback"]
        assert rollback["attempted"] and rollback["state"] == "succeeded", (rollback, err["message"])
        c = wl.container()
        assert c is not None and c.id != before and c.status == "running"
        assert wl.complete() == art["acceptance"]["reply"]
        client.images.get(_capsule_id(art))
        written = [wl.state_root / "workloads" / RECIPE, wl.state_root / "runs" / req["id"] / "units"]
        assert not_owned(written, user.uid, user.gid) == []
    finally:
        killer.done.set()
        wl.stop()


def _captured_pid(wl: DockerWorkload, art: dict) -> int:
    import json

    target = wl.state_root / "captures" / art["capture_id"] / "units" / "unit-0" / "evidence.json"
    return json.loads(target.read_text())["workers"][0]["pid"]


def _processes_under(root: Path) -> list[str]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
                if "coldsnap-reference-engine" in argv and str(root) in argv:
                    out.append(f"{d}: {argv}")
    return out


# CRIU killed with nothing running before: the same clean-up as the rollback case above
@pytest.mark.parametrize("what", ["container"])
def test_a_first_restore_killed_part_way_leaves_no_container_and_names_the_kill(captured, what):
    import docker

    wl, path, art, user = captured
    wl.stop()
    client = docker.from_env()
    killer = CriuKiller(wl.state_root, _captured_pid(wl, art), container=what == "container")
    killer.start()
    try:
        req = wl.request("restore", artifact=path)
        res = wl.run(req)
    finally:
        killer.done.set()
        killer.join()
    assert killer.killed == what
    assert not res.succeeded
    message = res.receipt["error"]["message"]
    assert "killed by SIGKILL" in message, message
    assert "tun" not in message, "a line CRIU writes on every run in a rank container is not the cause"
    assert client.containers.list(all=True, filters={"label": f"org.coldsnap.recipe={RECIPE}"}) == []
    assert wl.container() is None, "the canonical name is free"
    assert not _listening(wl.port)
    assert _processes_under(wl.state_root) == []
    client.images.get(_capsule_id(art))
    written = [wl.state_root / "workloads" / RECIPE, wl.state_root / "runs" / req["id"] / "units"]
    assert not_owned(written, user.uid, user.gid) == []
    leftovers = [str(p) for root in written for p in root.rglob("*")
                 if ".tmp" in p.name or p.name.endswith(".part")]
    assert leftovers == []
    ok = wl.run(wl.request("restore", artifact=path))
    assert ok.succeeded, ok.receipt["error"]
    assert wl.complete() == art["acceptance"]["reply"]
    wl.stop()
