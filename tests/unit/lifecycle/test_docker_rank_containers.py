"""Runtime docker's rank containers when something goes wrong around them: one removed by hand while it
runs fails its unit by name (never an anonymous failure), a create that lost the canonical name to another
container removes nothing of that one, and a unit image missing from the local store is refused before
anything starts, check mode included, naming the request's field."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError, UnitError
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import containers as docker_unit
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import docker_runtime
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.capture import capture_units
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.specs import build_specs
from lifecycle_helpers import make_request

docker = pytest.importorskip("docker")
IMAGE = "coldsnap-runtime@sha256:" + "a" * 64


def docker_request(op: str) -> dict:
    req = make_request(operation=op, op_id=f"op-{op}")
    req["launch"]["runtime"] = "docker"
    for u in req["launch"]["units"]:
        u.pop("environment_digest", None)
        u["image"] = IMAGE
    return req


class RemovedByHand:
    """A rank container removed (``docker rm -f``) right after it started."""

    name = docker_unit.canonical_container_name("chat", "unit-0")
    status = "running"
    attrs: dict = {}

    def _gone(self, *_a, **_k):
        raise docker.errors.NotFound(f"No such container: {self.name}")

    reload = wait = logs = stop = remove = _gone


@pytest.fixture
def rank_runtime(tmp_path, monkeypatch):
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setattr(docker_runtime, "capsule_image",
                        lambda _art, _uid, client=None: (SimpleNamespace(id="sha256:" + "b" * 64),
                                                         str(state / "captures" / "cap" / "unit-0")))
    monkeypatch.setattr(docker_runtime, "_unit_mounts", lambda *_a, **_k: [])
    monkeypatch.setattr(docker_runtime.docker_unit, "run_unit_container", lambda **_k: RemovedByHand())

    def absent(ref: str):
        raise docker.errors.NotFound(ref)

    no_containers = SimpleNamespace(containers=SimpleNamespace(get=absent))

    def make(op: str):
        req = docker_request(op)
        specs = build_specs(req, host="localhost", operation=op, capture_id="cap", state_root=state,
                            unit_dirs={"unit-0": state / "captures" / "cap" / "unit-0"} if op == "restore" else None)
        rt = docker_runtime.DockerRuntime(req, host="localhost", state_root=state,
                                          activation_digest="sha256:" + "c" * 64, client=no_containers)
        return rt, specs
    return make


def test_a_rank_container_removed_while_it_restores_fails_its_unit_by_name(rank_runtime) -> None:
    rt, specs = rank_runtime("restore")
    with pytest.raises(UnitError) as err:
        rt.restore({"capture_id": "cap"}, specs, timeout=5)
    assert "unit None" not in str(err.value)
    assert "unit unit-0: its rank container 'coldsnap-chat-unit-0' was removed while it ran" in str(err.value)


def test_a_rank_container_removed_while_it_captures_fails_its_unit_by_name(rank_runtime) -> None:
    rt, specs = rank_runtime("capture")
    with pytest.raises(UnitError) as err:
        rt.capture(specs, timeout=5)
    assert "unit None" not in str(err.value)
    assert "unit unit-0: its rank container" in str(err.value) and "was removed while it ran" in str(err.value)


class _Named:
    def __init__(self, name: str, labels: dict) -> None:
        self.name, self.labels, self.removed = name, labels, False
        self.image = SimpleNamespace(labels={})

    def remove(self, **_k) -> None:
        self.removed = True


def test_a_create_that_lost_the_name_removes_nothing_of_the_container_that_took_it(tmp_path, monkeypatch) -> None:
    """Two workloads whose canonical names collide (recipe a-b unit c, recipe a unit b-c), restored at once:
    the other one's container takes the name between the check and the create; it keeps running."""
    name = docker_unit.canonical_container_name("a-b", "c")
    theirs = _Named(name, docker_unit.unit_labels(capture_id="x", unit="b-c", operation_id="op", recipe="a"))
    lookups = []

    def get(ref: str):
        lookups.append(ref)
        if len(lookups) == 1:  # the name check: free
            raise docker.errors.NotFound(ref)
        return theirs

    def create(*_a, **_k):
        raise docker.errors.APIError("Conflict", explanation=f'The container name "/{name}" is already in use')

    client = SimpleNamespace(containers=SimpleNamespace(get=get))
    monkeypatch.setattr(docker_unit.dockerapi, "resolve_image", lambda *_a, **_k: SimpleNamespace(id="sha256:" + "d" * 64))
    monkeypatch.setattr(docker_unit, "create_container", create)
    with pytest.raises(UnitError, match="did not start"):
        docker_unit.run_unit_container(image="sha256:" + "d" * 64, name=name, command=["true"], mounts=[],
                                       environment={}, privileged_rank=False, client=client, replace=True,
                                       labels=docker_unit.unit_labels(capture_id="y", unit="c", operation_id="op2",
                                                                      recipe="a-b"))
    assert not theirs.removed, "the other workload's container was removed"


def test_a_unit_image_missing_here_is_refused_before_anything_starts_in_check_mode_too(tmp_path,
                                                                                       monkeypatch) -> None:
    def absent(ref: str):
        raise docker.errors.ImageNotFound(ref)

    client = SimpleNamespace(images=SimpleNamespace(get=absent))
    monkeypatch.setattr(docker_runtime.DockerRuntime, "client", property(lambda self: client))
    started = []
    monkeypatch.setattr(docker_runtime.docker_unit, "run_unit_container", lambda **k: started.append(k))
    req = docker_request("capture")
    state = tmp_path / "state"
    state.mkdir()
    for check_mode in (True, False):
        with pytest.raises(ColdSnapError) as err:
            capture_units(req, host="localhost", capture_id="cap-1", state_root=state,
                          activation_digest="sha256:" + "c" * 64, coordinator_endpoint=None, python=None,
                          check_mode=check_mode)
        assert "launch.units[0].image (unit unit-0)" in err.value.problem
        assert "not present in the local Docker image store" in err.value.problem
        assert err.value.fix and "pull it by digest" in err.value.fix
    assert started == []


def test_an_activate_step_never_replaces_a_running_unit_container(rank_runtime, monkeypatch) -> None:
    """The activate phase run without its evict step (by hand): the running container keeps serving; only
    the evict step ends it (and records it, so a failed restore can roll back to it)."""
    rt, specs = rank_runtime("restore")
    name = docker_unit.canonical_container_name("chat", "unit-0")
    serving = _Named(name, docker_unit.unit_labels(capture_id="old", unit="unit-0", operation_id="op-old",
                                                   recipe="chat", role="rank"))
    serving.status = "running"
    rt._client = SimpleNamespace(containers=SimpleNamespace(get=lambda ref: serving))
    started = []
    monkeypatch.setattr(docker_runtime.docker_unit, "run_unit_container", lambda **k: started.append(k))
    with pytest.raises(UnitError) as err:
        rt.restore({"capture_id": "cap"}, specs, timeout=5)
    assert f"its container {name!r} is running" in err.value.problem and "phase=evict" in err.value.fix
    assert started == [] and not serving.removed


def test_a_rank_container_killed_before_it_reported_names_the_signal(tmp_path) -> None:
    """``docker kill`` (or the OOM killer) of a rank container whose controller wrote nothing: the unit's
    error says what ended it, not a bare exit status followed by an empty output."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units.docker_units import container_evidence

    missing = tmp_path / "evidence.json"
    killed = container_evidence(missing, "unit-0", "", 137)
    assert killed["ok"] is False
    assert "rank container was killed by SIGKILL (exit 137: docker kill" in killed["error"], killed
    assert "it wrote no output" in killed["error"] and "its output" not in killed["error"]
    oom = container_evidence(missing, "unit-0", "", 137, oom_killed=True)
    assert "killed by the OOM killer" in oom["error"], oom
    exited = container_evidence(missing, "unit-0", "Traceback: boom\n", 1)
    assert "rank container exited 1 without evidence; its output:\nTraceback: boom" in exited["error"], exited
