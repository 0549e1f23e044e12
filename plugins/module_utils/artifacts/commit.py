"""Assemble artifact format 9 from a capture's evidence and commit it atomically.

Capture has ``conflict-on-existing-output`` semantics: an artifact already at the
output path is never replaced; committing the identical document again is a no-op.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import (
    exclusive_commit,
    make_private_dirs,
    temp_path_for,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import (
    read_descriptor_file,
    validate_artifact,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.drivers import (
    SNAPSHOT_DRIVERS,
    admit_driver,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import identity, request_sha256
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.versions import (
    ACTIVATION_RUNTIME_ABI,
    ARTIFACT_FORMAT,
    ARTIFACT_KIND,
)

ARTIFACT_FILE = "artifact.json"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def build_artifact(request: dict, *, capture_id: str, evidence: dict[str, dict], facts: dict[str, dict],
                   capsules: dict[str, dict], activation_digest: str) -> dict:
    """Artifact v9 for ``request`` from per-unit evidence, host facts and capsule refs (keyed by unit id)."""
    launch = request["launch"]
    driver_id = request["snapshot_driver"]["id"]
    units = launch["units"]
    platforms = []
    nvidia = None
    row = f"{driver_id}-cpu"
    for u in units:
        f = facts[u["id"]]
        gpus = []
        by_index = {g["index"]: g for g in f.get("gpus", [])}
        for ordinal in u["devices"]:
            g = by_index.get(ordinal)
            if g is None:
                raise ColdSnapError(f"unit {u['id']}: GPU {ordinal} was not found on {u['host']} at capture")
            gpu = {"model": g["model"], "compute_capability": g["compute_capability"], "nvidia_driver": g["nvidia_driver"]}
            if isinstance(g.get("memory_mib"), int):  # unified-memory GPUs (GB10) report none
                gpu["memory_mib"] = g["memory_mib"]
            gpus.append(gpu)
        if gpus:
            nvidia = f.get("nvidia_driver")
            workers = [w for w in launch["execution"]["workers"] if w["unit"] == u["id"]]
            row = admit_driver(driver_id, nvidia_driver=nvidia, gpu_workers_per_unit=len(workers)).row
        platforms.append({"unit": u["id"], "arch": f["arch"], "kernel": f["kernel"], "cpu_model": f.get("cpu_model", ""),
                          "criu_version": evidence[u["id"]]["criu_version"], "gpus": gpus})
    weights = []
    for w in launch["execution"]["workers"]:
        ev = evidence[w["unit"]]
        wev = next(x for x in ev["workers"] if x["worker"] == w["id"])
        pl = wev["payload"]
        prefix = f"workers/{w['id']}/"
        weights.append({
            "worker": w["id"], "unit": w["unit"], "rank": w["rank"], "role": "model",
            "payload": ({"owner": w["id"], "size": pl["pack"]["size"], "sha256": pl["pack"]["sha256"],
                         "path": pl["pack"]["path"]} if pl.get("pack") else None),
            "residual": {**_rel(pl["residual"], prefix)},
            "manifest": {**_rel(pl["manifest"], prefix)},
            "replay": {**_rel(pl["replay"], prefix)},
            "allocations": pl["allocations"], "model_bytes": pl["model_bytes"], "residual_bytes": pl["residual_bytes"],
        })
    serving = [e for e in evidence.values() if e.get("reply") is not None]
    reply = serving[0]["reply"] if serving else next(iter(evidence.values())).get("acceptance_reply") or ""
    val = request["validation"]
    artifact = {
        "format": ARTIFACT_FORMAT, "kind": ARTIFACT_KIND, "state": "accepted", "capture_id": capture_id,
        "created_at": _now(), "request_sha256": request_sha256(request), "identity": identity(request),
        "snapshot_driver": {"id": driver_id, "abi": SNAPSHOT_DRIVERS[driver_id].abi, "row": row,
                            "captured_nvidia_driver": nvidia},
        "launch": launch,
        "policy": {"process": request["policy"]["process"], "compatibility": request["policy"]["compatibility"],
                   "cache": request["policy"]["cache"]},
        "compatibility": {"units": platforms},
        "capsule": {"units": [{**capsules[u["id"]],
                               **({"state": evidence[u["id"]]["state"]} if evidence[u["id"]].get("state") else {})}
                              for u in units]},
        "runtime": {"kind": launch["runtime"],
                    "activation_runtime": {"abi": ACTIVATION_RUNTIME_ABI, "digest": activation_digest},
                    "criu_version": platforms[0]["criu_version"]},
        "weights": {"workers": weights, "providers": {
            "native": {"repository": request["policy"]["weights"]["native"]["repository"],
                       "revision": request["policy"]["weights"]["native"]["revision"]},
            "recovery": {"enabled": request["policy"]["weights"]["recovery"]["enabled"],
                         "source": launch["model"]["source"],
                         "model": {"id": launch["model"]["id"], "revision": launch["model"]["revision"]}}}},
        "acceptance": {"prompt": val["prompt"], "max_tokens": val["max_tokens"], "reply": reply,
                       "reply_sha256": "sha256:" + hashlib.sha256(reply.encode()).hexdigest(),
                       "logprobs": serving[0].get("logprobs") if serving else None,
                       "validated_at": _now(),
                       "evidence": {uid: {"readiness": e.get("readiness"), "host": e.get("host")}
                                    for uid, e in evidence.items()}},
        "parent": None,
    }
    return validate_artifact(artifact)


def by_unit(request: dict, evidence: list[dict], facts_by_host: dict[str, dict],
            capsules: list[dict]) -> tuple[dict, dict, dict]:
    """Key the plays' per-host results by unit id; refuse a capture with a unit missing."""
    units = request["launch"]["units"]
    for name, entries in (("evidence", evidence), ("capsules", capsules)):
        for i, e in enumerate(entries):
            if (e or name == "evidence") and (not isinstance(e, dict) or not isinstance(e.get("unit"), str)):
                raise ColdSnapError(f"{name}[{i}] names no unit",
                                    fix=f"pass the unit_capture / capsule_build results unchanged as {name}")
    for i, e in enumerate(evidence):
        lacking = [k for k in ("criu_version", "workers") if k not in e]
        if lacking or not isinstance(e["workers"], list) or not all(
                isinstance(w, dict) and "worker" in w for w in e["workers"]):
            raise ColdSnapError(f"evidence[{i}] (unit {e['unit']!r}) is not a unit's capture evidence"
                                f"{': it lacks ' + ', '.join(lacking) if lacking else ': its workers are malformed'}",
                                fix="pass the unit_capture results unchanged as evidence")
    for host, facts in facts_by_host.items():
        if not isinstance(facts, dict):
            raise ColdSnapError(f"facts[{host!r}] is a {type(facts).__name__}, not the host's facts",
                                fix="pass each host's host_facts result (its coldsnap_host facts) unchanged")
    ev = {e["unit"]: e for e in evidence}
    caps = {c["unit"]: c for c in capsules if c}
    missing = [u["id"] for u in units if u["id"] not in ev or u["id"] not in caps or u["host"] not in facts_by_host]
    if missing:
        raise ColdSnapError(f"capture results are missing for unit(s) {missing}",
                            fix="every unit host must complete unit_capture, capsule_build and host_facts")
    facts = {u["id"]: facts_by_host[u["host"]] for u in units}
    capsules_out = {u["id"]: {**caps[u["id"]], "host": u["host"]} for u in units}
    return ev, facts, capsules_out


def _rel(ref: dict, prefix: str) -> dict:
    path = ref["path"]
    name = os.path.basename(path)
    return {"path": prefix + name, "size": ref["size"], "sha256": ref["sha256"]}


def _same_except_times(a: dict, b: dict) -> bool:
    def strip(d: dict) -> dict:
        return {**d, "created_at": "", "acceptance": {**d["acceptance"], "validated_at": ""}}

    try:
        return strip(a) == strip(b)
    except (KeyError, TypeError):  # not a descriptor
        return False


def read_committed(final: Path) -> dict | None:
    """The JSON object already committed at ``final``, or None when what is there is not one: a symbolic
    link (never read through: it could lead to any file root may read), a FIFO or device (never waited
    on), an unreadable or malformed file."""
    try:
        doc = json.loads(read_descriptor_file(final, follow_links=False))
    except (ColdSnapError, OSError, ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def commit_artifact(artifact_dir: Path, artifact: dict, *, check_mode: bool = False) -> tuple[Path, bool]:
    """Commit ``artifact`` as <artifact_dir>/artifact.json; (path, changed). Never replaces another one.

    Check mode writes nothing and answers as the commit would: changed when nothing is there yet,
    unchanged for the same descriptor, the same error for another one.
    """
    artifact_dir = Path(artifact_dir)
    final = artifact_dir / ARTIFACT_FILE
    if os.path.lexists(final):
        existing = read_committed(final)
        if existing is not None and _same_except_times(existing, artifact):
            return final, False
        held = (f"artifact {existing.get('capture_id')!r}" if existing is not None
                else "something that is not a committed descriptor (a link, a pipe or another file)")
        raise ColdSnapError(
            f"{final} already holds {held}; capture never replaces an artifact",
            fix="choose a new output.artifact_dir (capture semantics: conflict-on-existing-output)")
    if not check_mode:
        write_exclusive(final, artifact)
    return final, True


def write_exclusive(final: Path, doc: dict) -> None:
    """Write ``doc`` as JSON under ``final`` only when nothing is there yet.

    The bytes go to a temporary name first (fsync), then an exclusive link makes them
    visible: a crash leaves either nothing or the complete descriptor, and a descriptor
    that appeared meanwhile is never replaced.
    """
    final = Path(final)
    make_private_dirs(final.parent)  # 0700 whatever the umask: another user must not swap the descriptor
    tmp = temp_path_for(final)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # the launch and its placement: private
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write((json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())
            fh.flush()
            os.fsync(fh.fileno())
        exclusive_commit(tmp, final)
    except FileExistsError:
        raise ColdSnapError(f"{final} appeared while committing", fix="choose a new output.artifact_dir") from None
    finally:
        if tmp.exists():
            tmp.unlink()


def load_committed(path: Path) -> dict:
    """Read and validate a committed artifact descriptor."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import (
        load_artifact,
        read_descriptor_file,
    )

    try:
        return load_artifact(read_descriptor_file(path), document=str(path))
    except FileNotFoundError:
        raise ColdSnapError(f"artifact {path} does not exist", fix="give the artifact.json a capture committed") from None
