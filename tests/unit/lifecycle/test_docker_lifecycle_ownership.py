"""Runtime docker's lifecycle steps (status, sleep, wake) run the activation runtime inside the unit
container as root: what they wrote under the state root is given to the invoking user (the ``owner``
of :func:`lifecycle_units` and of the module unit_lifecycle), also when the step failed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError, UnitError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import new_evidence
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import containers as docker_unit
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import docker_units, lifecycle
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.lifecycle import lifecycle_units
from lifecycle_helpers import make_request
from module_runner import HAVE_ANSIBLE, run_module

OWNER = (4242, 4343)  # nobody's ids: in-process chown as root takes any numeric pair

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="hands files over in-process, which needs root")


def docker_request(op: str) -> dict:
    req = make_request(operation=op, op_id=f"op-{op}")
    req["launch"]["runtime"] = "docker"
    for u in req["launch"]["units"]:
        u.pop("environment_digest", None)
        u["image"] = "coldsnap-runtime:test"
    return req


class FakeContainer:
    """A running rank container whose ``exec_run`` writes what the activation runtime (root) would."""

    def __init__(self, req: dict, *, fail: bool = False) -> None:
        unit = req["launch"]["units"][0]["id"]
        self.name = docker_unit.canonical_container_name(req["workload"]["recipe"], unit)
        self.labels = docker_unit.unit_labels(capture_id="cap", unit=unit, operation_id="op-restore",
                                              recipe=req["workload"]["recipe"])
        self.image = SimpleNamespace(labels={})
        self.status = "running"
        self.fail = fail
        self.execs: list[dict] = []

    def reload(self) -> None:
        pass

    def exec_run(self, argv: list[str], **kwargs) -> tuple[int, bytes]:
        self.execs.append({"argv": argv, **kwargs})
        assert kwargs.get("user") == "0", "the activation runtime runs as root inside the unit container"
        spec = json.loads(Path(argv[argv.index("--spec") + 1]).read_text())
        # A file of the engine's own next to its control file, and the evidence, both written as root.
        Path(spec["workload_dir"], "written-in-the-container").write_text("x")
        if self.fail:
            return 1, b"the activation runtime failed"
        state = {"sleep": "sleeping", "wake": "ready"}.get(argv[3], "ready")
        ev = new_evidence(operation=argv[3], operation_id=spec["operation_id"], capture_id=spec["capture_id"],
                          unit=spec["unit"]["id"], host=spec["host"], ok=True, changed=argv[3] != "status",
                          state=state, workers=[{"worker": "worker-0", "pid": 42, "state": state}],
                          timing={"spans": [], "marks": []})
        Path(argv[argv.index("--evidence") + 1]).write_text(json.dumps(ev))
        return 0, b""


@pytest.fixture
def docker(monkeypatch):
    """The docker client the runtime gets: one fake container per canonical name."""
    containers: dict[str, FakeContainer] = {}

    def get(name: str) -> FakeContainer:
        if name not in containers:
            raise docker_units.dockerapi.docker_module().errors.NotFound(name)
        return containers[name]

    client = SimpleNamespace(containers=SimpleNamespace(get=get))
    monkeypatch.setattr(docker_units.dockerapi, "docker_client", lambda *_a, **_k: client)

    def start(req: dict, **kwargs) -> FakeContainer:
        c = FakeContainer(req, **kwargs)
        containers[c.name] = c
        return c
    return start


def not_owned(root: Path, uid: int, gid: int) -> list[str]:
    return [f"{p} ({p.lstat().st_uid}:{p.lstat().st_gid})" for p in [root, *root.rglob("*")]
            if (p.lstat().st_uid, p.lstat().st_gid) != (uid, gid)]


def run_step(req: dict, action: str, state_root: Path, **kwargs) -> dict:
    return lifecycle_units(req, None, host="localhost", action=action, state_root=state_root,
                           activation_digest="sha256:" + "ab" * 32, python=None, check_mode=False, **kwargs)


def workload_dir(state_root: Path, req: dict) -> Path:
    wdir = state_root / "workloads" / req["workload"]["recipe"] / "unit-0"
    wdir.mkdir(parents=True)
    for p in (wdir.parent.parent, wdir.parent, wdir):  # as a restore left them
        os.chown(p, *OWNER)
    return wdir


@needs_root
def test_what_the_unit_container_wrote_is_given_to_the_owner(state_root, docker) -> None:
    req = docker_request("sleep")
    wdir = workload_dir(state_root, req)
    container = docker(req)
    out = run_step(req, "sleep", state_root, owner=f"{OWNER[0]}:{OWNER[1]}")
    assert [u["state"] for u in out["units"]] == ["sleeping"]
    assert container.execs, "the step ran inside the unit container"
    assert list((wdir / ".coldsnap").glob("evidence-*.json"))
    assert not_owned(state_root / "workloads", *OWNER) == []


def _free_pid() -> int:
    """A pid no process of this host has (the engine's pid in its container's own namespace)."""
    return next(p for p in range(4_000_000, 3_000_000, -1) if not Path(f"/proc/{p}").exists())


@pytest.fixture
def engine_api():
    """A worker's control API on the host's network, answering ``state`` and the pid it has in its container."""
    import http.server
    import threading

    pid = _free_pid()
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization", ""))
            body = json.dumps({"ok": True, "pid": pid, "state": "ready"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_a) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield SimpleNamespace(port=srv.server_address[1], pid=pid, seen=seen)
    srv.shutdown()
    srv.server_close()


def _tree(root: Path) -> dict[str, tuple]:
    return {str(p.relative_to(root)): (p.lstat().st_uid, p.lstat().st_gid, p.lstat().st_mtime_ns)
            for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize(("action", "check_mode"), [("status", False), ("sleep", True), ("wake", True)])
def test_status_and_check_mode_write_nothing_and_run_nothing_in_the_container(
        state_root, docker, engine_api, action, check_mode) -> None:
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import engine_control as ec

    req = docker_request(action)
    wdir = state_root / "workloads" / req["workload"]["recipe"] / "unit-0"
    wdir.mkdir(parents=True)
    worker = req["launch"]["execution"]["workers"][0]["id"]
    (wdir / ec.CONTROL_FILE_NAME.format(worker=worker)).write_text(
        json.dumps({"port": engine_api.port, "token": "t" * 64, "pid": engine_api.pid}))
    payload = state_root / "model-payloads" / "sha256" / "x.pack"
    payload.parent.mkdir(parents=True)
    payload.write_bytes(b"p")
    container = docker(req)
    before = _tree(state_root)
    out = lifecycle_units(req, None, host="localhost", action=action, state_root=state_root,
                          activation_digest="sha256:" + "ab" * 32, python=None, check_mode=check_mode,
                          owner=f"{OWNER[0]}:{OWNER[1]}")
    assert container.execs == [], "status and check mode run nothing inside the unit container"
    assert _tree(state_root) == before, "status and check mode write (and chown) nothing"
    assert [(u["unit"], u["state"]) for u in out["units"]] == [("unit-0", "ready")]
    assert out["units"][0]["workers"] == [{"worker": worker, "pid": engine_api.pid, "state": "ready"}]
    assert out["changed"] is (action == "sleep")
    assert engine_api.seen == ["Bearer " + "t" * 64]


def test_status_of_a_running_container_whose_engine_does_not_answer_fails(state_root, docker) -> None:
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import engine_control as ec

    req = docker_request("status")
    wdir = state_root / "workloads" / req["workload"]["recipe"] / "unit-0"
    wdir.mkdir(parents=True)
    worker = req["launch"]["execution"]["workers"][0]["id"]
    (wdir / ec.CONTROL_FILE_NAME.format(worker=worker)).write_text(
        json.dumps({"port": 1, "token": "t" * 64, "pid": _free_pid()}))
    container = docker(req)
    with pytest.raises(UnitError, match="is not running"):
        run_step(req, "status", state_root)
    assert container.execs == []


@needs_root
def test_a_failed_step_still_gives_its_files_to_the_owner(state_root, docker) -> None:
    req = docker_request("sleep")
    wdir = workload_dir(state_root, req)
    docker(req, fail=True)
    with pytest.raises(UnitError, match="the activation runtime failed"):
        run_step(req, "sleep", state_root, owner={"uid": OWNER[0], "gid": OWNER[1]})
    assert (wdir / "written-in-the-container").exists()
    assert not_owned(state_root / "workloads", *OWNER) == []


@needs_root
def test_without_an_owner_the_files_stay_as_written(state_root, docker) -> None:
    req = docker_request("sleep")
    wdir = workload_dir(state_root, req)
    docker(req)
    run_step(req, "sleep", state_root)
    assert (wdir / "written-in-the-container").stat().st_uid == os.geteuid()


@pytest.mark.parametrize("runtime", ["docker", "host"])
def test_a_malformed_owner_is_refused_before_anything_runs(state_root, monkeypatch, runtime) -> None:
    req = docker_request("sleep")
    req["launch"]["runtime"] = runtime
    monkeypatch.setitem(lifecycle.RUNNING_UNITS, runtime, None)  # never reached
    with pytest.raises(ColdSnapError, match="not a uid/gid pair"):
        run_step(req, "sleep", state_root, owner="alice")


@pytest.mark.skipif(not HAVE_ANSIBLE, reason="ansible-core is not installed in this environment")
def test_the_module_takes_the_owner_and_refuses_a_malformed_one(state_root) -> None:
    base = {"host": "localhost", "state_root": str(state_root), "activation_digest": "sha256:" + "ab" * 32,
            "state": "status", "request": make_request(operation="status", op_id="op-status")}
    res = run_module("unit_lifecycle", {**base, "owner": "1000:1000"})
    assert not res.get("failed"), res
    assert [(u["unit"], u["state"]) for u in res["units"]] == [("unit-0", "stopped")]
    res = run_module("unit_lifecycle", {**base, "owner": "alice"})
    assert res.get("failed") and "not a uid/gid pair" in res["msg"], res
