"""Runtime ``docker`` end to end with a real dockerd and CRIU: the reference engine is captured inside a
rank container and restored in a fresh container from its capsule image, through the real controller.

The controller runs as root here (CI does), so the invoking user is simulated: a throw-away
unprivileged user is created with useradd and passed as ``coldsnap_owner``; every state path the
(root) rank containers wrote must end up owned by it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import load_artifact
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.receipt import validate_receipt
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import containers as docker_unit
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.docker_runtime import PID_FLOOR
from docker_workload import DockerWorkload, not_owned, throwaway_user
from netports import another_free_port

pytestmark = [pytest.mark.docker, pytest.mark.criu, pytest.mark.slow]

RECIPE = "dockerunits"


class Captured:
    def __init__(self, wl: DockerWorkload, receipt: dict, user: throwaway_user) -> None:
        self.wl = wl
        self.receipt = receipt
        self.user = user
        self.path = Path(receipt["result"]["operation"]["artifact"])
        self.artifact = load_artifact(self.path.read_bytes())
        self.capture_id = self.artifact["capture_id"]

    @property
    def accepted(self) -> str:
        return self.artifact["acceptance"]["reply"]

    def state(self, *parts: str) -> Path:
        return self.wl.state_root.joinpath(*parts)


@pytest.fixture(scope="module")
def captured(module_tmp, runtime_image, tiny_model, recipes) -> Iterator[Captured]:
    recipes.append(RECIPE)
    with throwaway_user() as user:
        wl = DockerWorkload(module_tmp("docker-state"), tiny_model, runtime_image["runtime_image"],
                            RECIPE, owner=(user.uid, user.gid))
        res = wl.run(wl.request("capture"))
        assert res.succeeded, res.receipt["error"]
        validate_receipt(res.receipt)
        yield Captured(wl, res.receipt, user)
        wl.stop()


def restore(cap: Captured, *, prepare_only: bool = False, mutate=None):
    req = cap.wl.request("restore", artifact=cap.path, mutate=mutate)
    return req, cap.wl.run(req, prepare_only=prepare_only)


def test_capture_runs_in_a_rank_container_and_leaves_a_docker_capsule(captured, runtime_image):
    import docker

    art = captured.artifact
    assert art["runtime"]["kind"] == "docker"
    (cap,) = art["capsule"]["units"]
    assert cap["layout"] == "docker"
    client = docker.from_env()
    image = client.images.get(cap["image_id"])
    assert image.labels["org.coldsnap.kind"] == "capsule"
    assert image.labels["org.coldsnap.capsule.base"] == runtime_image["image_id"], "capsule = runtime image + state"
    target = image.labels["org.coldsnap.capsule.state-target"]
    assert target == str(captured.state("captures", captured.capture_id, "units", "unit-0"))
    # The capture container exited after the dump and is gone; nothing of this workload runs.
    assert client.containers.list(all=True, filters={"label": f"org.coldsnap.recipe={RECIPE}"}) == []
    evidence = json.loads((Path(target) / "evidence.json").read_text())
    assert evidence["workers"][0]["pid"] > PID_FLOOR, "the captured engine's ids lie above the restore's own"
    assert evidence["reply"] == art["acceptance"]["reply"] and len(art["acceptance"]["reply"]) == 16
    # Every state path the root rank container wrote belongs to the invoking (unprivileged) user.
    written = [captured.state("captures", captured.capture_id), captured.state("workloads", RECIPE),
               captured.state("model-payloads"), captured.state("runs", captured.receipt["operation_id"], "units")]
    assert all(p.exists() for p in written)
    assert not_owned(written, captured.user.uid, captured.user.gid) == []
    payload = art["weights"]["workers"][0]["payload"]
    assert captured.state(payload["path"]).stat().st_uid == captured.user.uid


def test_restore_starts_a_fresh_canonical_container_from_the_capsule(captured):
    import docker

    req, res = restore(captured)
    assert res.succeeded, res.receipt["error"]
    validate_receipt(res.receipt)
    unit = res.receipt["result"]["operation"]["units"][0]
    assert unit["reply"] == captured.accepted
    assert captured.wl.complete() == captured.accepted, "the restored engine serves the same greedy reply"

    client = docker.from_env()
    name = docker_unit.canonical_container_name(RECIPE, "unit-0")
    c = client.containers.get(name)
    assert c.status == "running"
    assert c.image.id == captured.artifact["capsule"]["units"][0]["image_id"]
    log_path = captured.state("workloads", RECIPE, "unit-0", "target.log")
    labels = c.labels
    assert labels["org.coldsnap.unit"] == "unit-0" and labels["org.coldsnap.recipe"] == RECIPE
    assert labels["org.coldsnap.capture-id"] == captured.capture_id
    assert labels["org.coldsnap.operation-id"] == req["id"] and labels["org.coldsnap.role"] == "rank"
    assert labels["org.coldsnap.log-path"] == str(log_path)
    marker = json.loads(log_path.read_text().splitlines()[0])
    assert marker["coldsnap"] == "restore-boundary" and marker["operation_id"] == req["id"]

    # Only the rank container is privileged: exactly the host's rank policy, nothing else running.
    policy = docker_unit.privilege_policy(client)
    host = c.attrs["HostConfig"]
    assert host["NetworkMode"] == "host"
    if policy["privileged"]:
        assert host["Privileged"] is True
    else:
        assert host["Privileged"] is False and host["CapAdd"] == ["ALL"]
        assert sorted(host["CapDrop"] or []) == sorted(policy["cap_drop"])
    others = [x.name for x in client.containers.list(filters={"label": f"org.coldsnap.recipe={RECIPE}"})]
    assert others == [name]

    # Mounts: model and activation runtime read-only, the unit state comes from the image (not bound).
    mounts = {m["Destination"]: m for m in c.attrs["Mounts"]}
    model_dir = str(captured.wl.model_dir)
    assert mounts[model_dir]["RW"] is False
    assert mounts[docker_unit.ACTIVATION_TARGET]["RW"] is False
    assert mounts[str(captured.state("workloads", RECIPE, "unit-0"))]["RW"] is True
    assert str(captured.state("captures", captured.capture_id, "units", "unit-0")) not in mounts
    code, out = docker_unit.exec_in(c, ["sh", "-c", f"touch {model_dir}/written-by-unit"])
    assert code != 0 and "Read-only file system" in out

    # PID 1 is the rank controller; the restored engine kept its captured pid in the fresh namespace.
    code, out = docker_unit.exec_in(c, ["sh", "-c", "cat /proc/1/cmdline | tr '\\0' ' '"])
    assert "coldsnap_activation restore" in out
    captured_pid = json.loads(captured.state("captures", captured.capture_id, "units", "unit-0",
                                             "evidence.json").read_text())["workers"][0]["pid"]
    assert unit["workers"][0]["pid"] == captured_pid

    written = [captured.state("workloads", RECIPE), captured.state("model-payloads"),
               captured.state("runs", req["id"], "units")]
    assert not_owned(written, captured.user.uid, captured.user.gid) == []


def test_prepare_only_keeps_the_container_and_restore_replaces_it(captured):
    import docker

    client = docker.from_env()
    name = docker_unit.canonical_container_name(RECIPE, "unit-0")
    try:
        before = client.containers.get(name).id
    except docker.errors.NotFound:
        _req, res = restore(captured)
        assert res.succeeded, res.receipt["error"]
        before = client.containers.get(name).id
    _req, res = restore(captured, prepare_only=True)
    assert res.succeeded, res.receipt["error"]
    assert res.receipt["replay_semantics"] == "safe-repeat"
    prepared = res.receipt["result"]["operation"]["prepared"][0]["units"][0]
    assert prepared["container"] == name and prepared["admission"]["criu"], "the capsule's own CRIU was checked"
    after = client.containers.get(name)
    assert after.id == before and after.status == "running", "prepare-only must not touch the running unit"

    _req, res = restore(captured)
    assert res.succeeded, res.receipt["error"]
    assert res.receipt["replay_semantics"] == "reconcile-replace"
    new = client.containers.get(name)
    assert new.id != before and new.status == "running"
    with pytest.raises(docker.errors.NotFound):
        client.containers.get(before)
    assert captured.wl.complete() == captured.accepted


def test_warm_restore_and_lifecycle_run_inside_the_unit_container(captured):
    def run(operation: str) -> dict:
        req = captured.wl.request(operation, artifact=captured.path)
        res = captured.wl.run(req)
        assert res.succeeded, res.receipt["error"]
        return res.receipt["result"]["operation"]

    warm = run("warm")
    assert warm["units"][0]["warm"] is True and warm["units"][0]["reply"] is None
    container = captured.wl.container()
    assert container is not None and container.status == "running", "the warm unit's container keeps running"
    assert run("status")["units"][0]["state"] == "warm"
    woken = run("wake")["units"][0]
    assert woken["reply"] == captured.accepted and woken["changed"] is True
    assert run("sleep")["units"][0]["state"] == "sleeping"
    assert run("wake")["units"][0]["state"] == "ready"
    assert captured.wl.complete() == captured.accepted
    assert captured.wl.container().id == container.id, "lifecycle operations never replace the container"
    controls = list(captured.state("workloads", RECIPE, "unit-0").glob("control-*.json"))
    assert controls, "the running engine's control file"
    stopped = run("stop")
    assert stopped["units"][0]["state"] == "stopped" and captured.wl.container() is None
    assert not any(f.exists() for f in controls), "no control file of an engine that is gone is left"
    assert run("status")["units"][0]["state"] == "stopped"


def _root_owned(root: Path) -> set[str]:
    """Every entry below ``root`` (links themselves) that belongs to root (uid or gid 0)."""
    out = set()
    for p in root.rglob("*"):
        st = p.lstat()
        if st.st_uid == 0 or st.st_gid == 0:
            out.add(str(p))
    return out


def test_lifecycle_hands_what_the_unit_container_wrote_back_to_the_invoking_user(captured):
    """sleep and wake run the activation runtime inside the unit container as root (status only reads):
    every state path they wrote belongs to the invoking user afterwards, also when the step failed."""
    def wrong_reply(req: dict) -> None:
        req["validation"]["expected"] = "not what the engine answers"

    def run(operation: str, *, mutate=None, ok: bool = True) -> dict:
        req = captured.wl.request(operation, artifact=captured.path, mutate=mutate)
        res = captured.wl.run(req)
        assert res.succeeded is ok, res.receipt["error"]
        return res.receipt

    _req, res = restore(captured)
    assert res.succeeded, res.receipt["error"]
    before = _root_owned(captured.wl.state_root)
    uid, gid = captured.user.uid, captured.user.gid
    written = [captured.state("workloads", RECIPE), captured.state("model-payloads")]
    try:
        steps = [("status", None, True), ("sleep", None, True), ("status", None, True), ("wake", None, True),
                 ("sleep", None, True), ("wake", wrong_reply, False)]
        for operation, mutate, ok in steps:
            receipt = run(operation, mutate=mutate, ok=ok)
            assert not_owned(written, uid, gid) == [], f"after {operation}"
            if not ok:
                assert "differs" in receipt["error"]["message"], receipt["error"]
        evidence = list(captured.state("workloads", RECIPE, "unit-0", ".coldsnap").glob("evidence-*.json"))
        assert evidence, "the unit container's evidence is kept in the workload directory"
        # Nothing else the operations wrote under the state root belongs to root, but the controller's own
        # run records (the controller runs as root here).
        runs = str(captured.state("runs")) + "/"
        assert sorted(p for p in _root_owned(captured.wl.state_root) - before if not p.startswith(runs)) == []
    finally:
        captured.wl.stop()


def test_a_failed_restore_leaves_no_container_and_still_hands_state_back(captured):
    import docker

    def wrong_reply(req: dict) -> None:
        req["validation"]["expected"] = "not what the engine answers"

    req, res = restore(captured, mutate=wrong_reply)
    assert not res.succeeded
    assert "validation reply differs" in res.receipt["error"]["message"]
    client = docker.from_env()
    with pytest.raises(docker.errors.NotFound):
        client.containers.get(docker_unit.canonical_container_name(RECIPE, "unit-0"))
    log = captured.state("runs", req["id"], "units", "activation-restore-unit-0.log")
    assert log.exists(), "the failed rank container's output is kept in the run directory"
    written = [captured.state("workloads", RECIPE), captured.state("runs", req["id"], "units")]
    assert not_owned(written, captured.user.uid, captured.user.gid) == []


def test_restore_onto_another_port_moves_the_listeners_inside_the_unit_container(captured):
    """Placement with runtime docker: the rank container (host networking) restores the capture onto
    another serving port; every listener of the unit moves by one shift."""
    new_port = another_free_port(captured.wl.port)

    def on_port(req: dict) -> None:
        req["launch"]["execution"]["services"][0]["port"] = new_port
        cmd = req["launch"]["units"][0]["command"]
        cmd[cmd.index("--port") + 1] = str(new_port)

    _req, res = restore(captured, mutate=on_port)
    assert res.succeeded, res.receipt["error"]
    unit = res.receipt["result"]["operation"]["units"][0]
    assert unit["served"] == {"address": "127.0.0.1", "port": new_port}
    shift = new_port - captured.wl.port
    assert unit["listeners_moved"] and all(m["to"][1] - m["from"][1] == shift for m in unit["listeners_moved"])
    assert captured.wl.complete(port=new_port) == captured.accepted


def free_canonical_name(client) -> str:
    """This workload's canonical unit container name, with whatever container held it removed."""
    import docker

    name = docker_unit.canonical_container_name(RECIPE, "unit-0")
    try:
        client.containers.get(name).remove(force=True)
    except docker.errors.NotFound:
        pass
    return name


def test_prepare_refuses_a_foreign_container_under_the_canonical_name(captured, runtime_image):
    import docker

    client = docker.from_env()
    name = free_canonical_name(client)
    foreign = client.containers.create(runtime_image["image_id"], ["sleep", "600"], name=name,
                                       labels={"org.coldsnap.recipe": RECIPE})
    try:
        _req, res = restore(captured)
        assert not res.succeeded
        assert "is not a ColdSnap unit container" in res.receipt["error"]["message"]
        assert client.containers.get(name).id == foreign.id, "a container ColdSnap does not own is left alone"
    finally:
        foreign.remove(force=True)


def test_a_container_run_by_hand_from_the_capsule_image_is_not_coldsnaps(captured):
    """Its labels include the capsule image's recipe and unit: it is still refused, and left alone."""
    import docker

    client = docker.from_env()
    name = free_canonical_name(client)
    capsule = captured.artifact["capsule"]["units"][0]["image_id"]
    by_hand = client.containers.create(capsule, ["sleep", "600"], name=name, entrypoint=[], network_mode="none")
    try:
        assert by_hand.labels.get("org.coldsnap.recipe") == RECIPE, "the premise: the image's labels show through"
        _req, res = restore(captured)
        assert not res.succeeded
        assert "was not started by ColdSnap" in res.receipt["error"]["message"], res.receipt["error"]
        assert client.containers.get(name).id == by_hand.id, "a container ColdSnap did not start is left alone"
    finally:
        by_hand.remove(force=True)


def test_another_workloads_unit_container_under_a_colliding_name_is_never_touched(captured, runtime_image):
    """Recipe "dockerunits-unit" with unit "0" has this workload's canonical container name: its
    container is refused at prepare (nothing evicted) and by the lifecycle (nothing exec'd in it)."""
    import docker

    client = docker.from_env()
    name = docker_unit.canonical_container_name(RECIPE, "unit-0")
    assert name == docker_unit.canonical_container_name(f"{RECIPE}-unit", "0")
    try:
        client.containers.get(name).remove(force=True)
    except docker.errors.NotFound:
        pass
    labels = docker_unit.unit_labels(capture_id="other", unit="0", operation_id="other", recipe=f"{RECIPE}-unit")
    other = client.containers.run(runtime_image["image_id"], ["sleep", "600"], name=name, labels=labels, detach=True)
    try:
        _req, res = restore(captured)
        assert not res.succeeded
        assert f"belongs to recipe '{RECIPE}-unit' unit '0'" in res.receipt["error"]["message"], res.receipt["error"]
        status = captured.wl.run(captured.wl.request("status", artifact=captured.path))
        assert not status.succeeded and "belongs to recipe" in status.receipt["error"]["message"]
        other.reload()
        assert other.status == "running" and client.containers.get(name).id == other.id
    finally:
        other.remove(force=True)


def test_a_unit_container_holds_both_ranks_of_a_tensor_parallel_unit(tmp_path, runtime_image, tiny_model, recipes):
    """Two gloo ranks in one unit: one container, both engines dumped and restored in it, both ended with it."""
    recipe = "dockerunits-tp2"
    recipes.append(recipe)
    wl = DockerWorkload(tmp_path / "state", tiny_model, runtime_image["runtime_image"], recipe, tp=2)

    def one_unit(req: dict) -> None:
        req["launch"]["units"] = req["launch"]["units"][:1]
        for w in req["launch"]["execution"]["workers"]:
            w["unit"] = "unit-0"

    try:
        cap = wl.run(wl.request("capture", mutate=one_unit))
        assert cap.succeeded, cap.receipt["error"]
        path = Path(cap.receipt["result"]["operation"]["artifact"])
        art = load_artifact(path.read_bytes())
        assert [c["unit"] for c in art["capsule"]["units"]] == ["unit-0"]
        assert {w["unit"] for w in art["weights"]["workers"]} == {"unit-0"} and len(art["weights"]["workers"]) == 2
        res = wl.run(wl.request("restore", artifact=path, mutate=one_unit))
        assert res.succeeded, res.receipt["error"]
        [unit] = res.receipt["result"]["operation"]["units"]
        assert unit["reply"] == art["acceptance"]["reply"]
        assert sorted(w["worker"] for w in unit["workers"]) == ["worker-0", "worker-1"]
        assert wl.complete() == art["acceptance"]["reply"]
        top = wl.container().top()
        engines = [p for p in top["Processes"] if "coldsnap-reference-engine" in " ".join(p)]
        assert len(engines) == 2, top
        status = wl.run(wl.request("status", artifact=path, mutate=one_unit))
        assert status.succeeded, status.receipt["error"]
        assert [w["state"] for w in status.receipt["result"]["operation"]["units"][0]["workers"]] == ["ready"] * 2
    finally:
        wl.stop()


def test_an_n580_template_is_captured_and_restored_inside_unit_containers(tmp_path, runtime_image, tiny_model,
                                                                          recipes):
    """Snapshot driver n580 under runtime docker: the rank container dumps the engine as a template and the
    restored container builds it from the hydration; the reply is the captured one."""
    recipe = "dockerunits-n580"
    recipes.append(recipe)
    wl = DockerWorkload(tmp_path / "state", tiny_model, runtime_image["runtime_image"], recipe)

    def n580(req: dict) -> None:
        req["snapshot_driver"]["id"] = "n580"
        req["policy"]["process"].update(backend="criu", graph_policy="recreate-from-plan")

    try:
        cap = wl.run(wl.request("capture", mutate=n580))
        assert cap.succeeded, cap.receipt["error"]
        path = Path(cap.receipt["result"]["operation"]["artifact"])
        art = load_artifact(path.read_bytes())
        assert art["snapshot_driver"]["id"] == "n580"
        res = wl.run(wl.request("restore", artifact=path, mutate=n580))
        assert res.succeeded, res.receipt["error"]
        assert res.receipt["result"]["operation"]["units"][0]["reply"] == art["acceptance"]["reply"]
        assert wl.complete() == art["acceptance"]["reply"]
        marker = json.loads((wl.state_root / "workloads" / recipe / "unit-0" / "target.log").read_text().splitlines()[0])
        assert marker["coldsnap"] == "restore-boundary" and marker["template"] is True
    finally:
        wl.stop()
