"""Identity vs placement (the seeds' restore contract): hosts, device UUIDs and ordinals, mount
sources, the serving port and address and transport variables may change between capture and
restore; anything else that makes the workload itself is refused with the request field named."""

from __future__ import annotations

import copy
import json

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import FormatError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import (
    identity,
    identity_differences,
    require_identity,
    validate_request,
)


@pytest.fixture
def captured(example_request_text) -> dict:
    return validate_request(json.loads(example_request_text))


def artifact_of(req: dict) -> dict:
    """What restore compares against: the capture's identity, launch and snapshot driver."""
    return {"identity": identity(req), "launch": copy.deepcopy(req["launch"]),
            "snapshot_driver": {"id": req["snapshot_driver"]["id"]}}


def moved(req: dict, change) -> dict:
    out = copy.deepcopy(req)
    change(out)
    return validate_request(out)


def serve_on(port: int, address: str | None = None):
    def change(req: dict) -> None:
        svc = req["launch"]["execution"]["services"][0]
        svc["port"] = port
        cmd = req["launch"]["units"][0]["command"]
        cmd[cmd.index("--port") + 1] = str(port)
        if address is not None:
            svc["address"] = address
            req["launch"]["units"][0]["command"] += ["--host", address]
    return change


PLACEMENT = {
    "serving port": serve_on(9123),
    "serving address": serve_on(8000, "0.0.0.0"),
    "host": lambda r: r["launch"]["units"][0].__setitem__("host", "gpu-node-7"),
    "mount source": lambda r: r["launch"]["units"][0]["mounts"][0].__setitem__("source", "/srv/models/tiny"),
    "transport variable": lambda r: r["launch"]["units"][0]["environment"].__setitem__("NCCL_SOCKET_IFNAME", "eth1"),
    "device ordinal": lambda r: r["launch"]["units"][0]["environment"].__setitem__("CUDA_VISIBLE_DEVICES", "3"),
}


@pytest.mark.parametrize("what", sorted(PLACEMENT))
def test_placement_changes_keep_identity(captured, what):
    restore = moved(captured, PLACEMENT[what])
    assert identity(restore) == identity(captured)
    require_identity(artifact_of(captured), restore)  # no exception


IDENTITY = {
    "$.launch.units[0].command": lambda r: r["launch"]["units"][0]["command"].extend(["--seed", "7"]),
    "$.launch.units[0].environment": lambda r: r["launch"]["units"][0]["environment"].__setitem__(
        "OMP_NUM_THREADS", "8"),
    "$.launch.model": lambda r: r["launch"]["model"].__setitem__("revision", "0" * 40),
    "$.launch.units[0].mounts": lambda r: r["launch"]["units"][0]["mounts"][0].__setitem__("target", "/models/x"),
    "$.snapshot_driver.id": lambda r: r.__setitem__("snapshot_driver", {"id": "n580"}),
}


@pytest.mark.parametrize("field", sorted(IDENTITY))
def test_identity_changes_are_refused_naming_the_field(captured, field):
    def change(r: dict) -> None:
        IDENTITY[field](r)
        if field == "$.snapshot_driver.id":
            r["policy"]["process"]["backend"] = "criu"

    restore = moved(captured, change)
    assert identity(restore) != identity(captured)
    assert field in identity_differences(artifact_of(captured), restore)
    with pytest.raises(FormatError) as exc:
        require_identity(artifact_of(captured), restore)
    assert field in [i.path for i in exc.value.issues]
    assert "identity differs" in str(exc.value) and "placement" in str(exc.value)


def test_a_recipe_change_is_named_though_the_artifact_does_not_record_it(captured):
    restore = moved(captured, lambda r: r["workload"].__setitem__("recipe", "another-recipe"))
    assert identity_differences(artifact_of(captured), restore) == ["$.workload.recipe"]


@pytest.mark.parametrize("flag", ["--port", "--host"])
def test_the_serve_commands_placement_flags_must_agree_with_the_service(captured, flag):
    req = copy.deepcopy(captured)
    value = "8001" if flag == "--port" else "10.1.2.3"
    req["launch"]["units"][0]["command"] += [flag, value]
    with pytest.raises(FormatError) as exc:
        validate_request(req)
    field = "$.launch.execution.services[0]." + ("port" if flag == "--port" else "address")
    assert field in [i.path for i in exc.value.issues], str(exc.value)


def test_a_capture_command_without_a_port_serves_on_the_engines_default(captured):
    """A capture starts the command: without --port the engine listens on its default, which the
    service must then name (a restore moves the captured listener wherever the service says)."""
    req = copy.deepcopy(captured)
    cmd = req["launch"]["units"][0]["command"]
    i = cmd.index("--port")
    del cmd[i:i + 2]
    req["launch"]["execution"]["services"][0]["port"] = 9123
    with pytest.raises(FormatError) as exc:
        validate_request(req)
    issue = next(i for i in exc.value.issues if i.path == "$.launch.execution.services[0].port")
    assert "listens on its default 8000" in issue.message and issue.fix == "add --port 9123 to the command"
    req["launch"]["execution"]["services"][0]["port"] = 8000
    validate_request(req)
    restore = copy.deepcopy(req)
    restore["operation"] = "restore"
    restore["artifact"] = {"path": "/var/lib/coldsnap/artifacts/x/artifact.json"}
    restore["launch"]["execution"]["services"][0]["port"] = 9123
    assert validate_request(restore)["launch"]["execution"]["services"][0]["port"] == 9123


def test_a_capture_command_without_a_host_binds_the_engines_default(captured):
    req = copy.deepcopy(captured)
    req["launch"]["execution"]["services"][0]["address"] = "10.1.2.3"
    with pytest.raises(FormatError) as exc:
        validate_request(req)
    issue = next(i for i in exc.value.issues if i.path == "$.launch.execution.services[0].address")
    assert "has no --host, so engine 'reference' binds its default 127.0.0.1" in issue.message
    req["launch"]["units"][0]["command"] += ["--host", "0.0.0.0"]
    validate_request(req)
