"""Builders for lifecycle unit tests: consistent (request, artifact) pairs on disk, no engine needed."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import validate_artifact
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import identity, validate_request

import coldsnap  # noqa: F401  # pylint: disable=unused-import

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def hexof(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def make_request(*, recipe: str = "chat", driver: str = "n610", operation: str = "capture", op_id: str = "op-1",
                 hosts: tuple[str, ...] = ("localhost",), retention: int | None = None,
                 artifact: Path | None = None, gpus: bool = False) -> dict:
    """A valid, normalized request for the reference engine with one unit per host."""
    base = json.loads((FIXTURES / "requests" / "capture-reference.json").read_text())
    base["id"] = op_id
    base["operation"] = operation
    base["snapshot_driver"]["id"] = driver
    base["workload"]["recipe"] = recipe
    base["policy"]["process"] = {"backend": "cuda-criu" if gpus and driver == "n610" else "criu", "kv_discard": True}
    unit0 = base["launch"]["units"][0]
    units, workers = [], []
    for i, host in enumerate(hosts):
        u = copy.deepcopy(unit0)
        u.update(id=f"unit-{i}", index=i, host=host, devices=[0] if gpus else [])
        u["command"] = [*u["command"][:-1], str(8000 + i)]
        units.append(u)
        workers.append({"id": f"worker-{i}", "unit": f"unit-{i}", "rank": i, "device_slot": 0 if gpus else None})
    base["launch"]["units"] = units
    base["launch"]["execution"]["workers"] = workers
    base["launch"]["execution"]["groups"] = [{"kind": "tensor", "workers": [w["id"] for w in workers]}]
    if operation != "capture":
        base.pop("output", None)
        base["artifact"] = {"path": str(artifact or "/nonexistent/artifact.json")}
    if retention is not None:
        base["policy"]["retention"] = {"generations": retention}
    return validate_request(base)


def make_artifact(req: dict, *, capture_id: str, payload: str | None = "model", capsule: str | None = None,
                  state_root: Path | None = None, published: bool = False,
                  pack: tuple[str, int] | None = None) -> dict:
    """An artifact v9 of ``req``: ``payload`` names the (fake) pack content, per worker the same digest;
    ``pack`` gives a real (sha256, size) instead."""
    art = json.loads((FIXTURES / "artifacts" / "reference-tiny-n610.json").read_text())
    art["identity"] = identity(req)
    art["capture_id"] = capture_id
    art["launch"] = req["launch"]
    art["snapshot_driver"]["id"] = req["snapshot_driver"]["id"]
    art["snapshot_driver"]["row"] = f"{req['snapshot_driver']['id']}-cpu"
    art["runtime"]["kind"] = req["launch"]["runtime"]
    art["weights"]["providers"]["recovery"]["model"] = {k: req["launch"]["model"][k] for k in ("id", "revision")}
    plat0 = art["compatibility"]["units"][0]
    gpu = [{"model": "NVIDIA H200", "compute_capability": "9.0", "nvidia_driver": "580.159.04", "memory_mib": 143771}]
    art["compatibility"]["units"] = [{**plat0, "unit": u["id"], "gpus": gpu if u["devices"] else []}
                                     for u in req["launch"]["units"]]
    caps = []
    for u in req["launch"]["units"]:
        cap_hex = hexof(f"{capsule or capture_id}/{u['id']}")
        loc = (Path(state_root) if state_root else Path("/var/lib/coldsnap")) / "capsules" / "oci" / "sha256" / cap_hex
        caps.append({"unit": u["id"], "host": u["host"], "layout": "oci-layout", "image_id": f"sha256:{cap_hex}",
                     "location": str(loc), "bytes": 100, "repository_digest": None})
    art["capsule"] = {"units": caps}
    w0 = art["weights"]["workers"][0]
    workers = []
    for w in req["launch"]["execution"]["workers"]:
        entry = copy.deepcopy(w0)
        entry.update(worker=w["id"], unit=w["unit"], rank=w["rank"])
        if payload is None:
            entry["payload"] = None
        else:
            ph, size = (pack[0].split(":", 1)[1], pack[1]) if pack else (hexof(payload), 4096)
            entry["payload"] = {"owner": w["id"], "size": size, "sha256": f"sha256:{ph}",
                                "path": f"model-payloads/sha256/{ph}.pack"}
        workers.append(entry)
    art["weights"]["workers"] = workers
    if published:
        art["weights"]["providers"]["native"] = {"repository": "org/payloads", "revision": "a" * 40}
    return validate_artifact(art)


def host_facts(*, driver: str | None = "580.159.04", model: str = "NVIDIA H200", uuid: str = "GPU-1") -> dict:
    """coldsnap_host facts of a one-GPU host (what coldsnap.fleet.host_facts returns)."""
    return {"arch": "x86_64", "kernel": "6.18.44", "nvidia_driver": driver,
            "gpus": [{"index": 0, "model": model, "compute_capability": "9.0", "memory_mib": 143771,
                      "uuid": uuid, "nvidia_driver": driver}],
            "criu": {"installed": True, "version": "4.1.1", "check": True}}


def write_artifact(directory: Path, art: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "artifact.json"
    path.write_text(json.dumps(art, indent=2, sort_keys=True) + "\n")
    return path


def put_pack(state_root: Path, content: bytes) -> tuple[str, int]:
    """Write a pack into the node cache with the canonical cache writer (it records it); (sha256, size)."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.writer import PackWriter

    data = content + bytes(-len(content) % 4096)
    with PackWriter(NodeCache(state_root)) as w:
        w.write(data)
        res = w.commit()
    return res.pack.sha256, res.pack.size
