"""Snapshot artifact, format 9: the committed descriptor of one capture.

It separates portable identity (launch topology, commands, mount targets, model
revision, per-unit platform inventory) from placement, names one capsule per
unit and one optional model payload per worker, and carries the acceptance
evidence every restore must reproduce.
"""

from __future__ import annotations

import errno
import hashlib
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    FormatError,
    FormatIssue,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import (
    NotRegularFile,
    read_regular_file,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import identifiers as ids
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.capsule_labels import CAPSULE_LAYOUTS
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.drivers import (
    SNAPSHOT_DRIVERS,
    contract_rows,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.receipt import Timestamp
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import (
    REQUEST_SCHEMA,
    AbsPath,
    Digest,
    Ident,
    launch_issues,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.schema import (
    AnyJSON,
    Arr,
    Bool,
    Const,
    Field,
    Int,
    Nullable,
    Obj,
    Str,
    json_schema_document,
    validate_document,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.strictjson import strict_loads
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.versions import (
    ARTIFACT_FORMAT,
    ARTIFACT_KIND,
)

PAYLOAD_PATH = r"model-payloads/sha256/[0-9a-f]{64}\.pack"
_REL_PART = r"(?!\.\.?(?:/|$))[A-Za-z0-9._-]+"  # a name, never '.' or '..'
REL_PATH = _REL_PART + r"(?:/" + _REL_PART + r")*"


def RelPath(description: str = "") -> Str:
    return Str(description=description, pattern=REL_PATH,
               pattern_fix="give a relative path without '..' (letters, digits, '.', '_', '-')")


FILE_REF = Obj({
    "path": Field(RelPath("path inside the unit's capsule state")),
    "size": Field(Int(minimum=0)),
    "sha256": Field(Digest()),
})

GPU = Obj({
    "model": Field(Str(min_len=1)),
    "compute_capability": Field(Str(pattern=r"[0-9]+\.[0-9]+", pattern_fix="write it as 'major.minor'")),
    "nvidia_driver": Field(Str(min_len=1)),
    "memory_mib": Field(Int(minimum=0), required=False),
})

PLATFORM = Obj({
    "unit": Field(Ident()),
    "arch": Field(Str(min_len=1)),
    "kernel": Field(Str(min_len=1, description="captured kernel release (provenance)")),
    "cpu_model": Field(Str(), required=False, default=""),
    "criu_version": Field(Str(min_len=1)),
    "gpus": Field(Arr(GPU), required=False, default=[]),
})

CAPSULE = Obj({
    "unit": Field(Ident()),
    "host": Field(Str(pattern=ids.HOSTNAME, pattern_fix="inventory hostname"), description="capture host"),
    "layout": Field(Str(enum=CAPSULE_LAYOUTS)),
    "image_id": Field(Digest("local image id (docker) or manifest digest (OCI layout)")),
    "location": Field(Str(min_len=1, description="local image name or OCI layout directory")),
    "bytes": Field(Int(minimum=0)),
    "repository_digest": Field(Nullable(Str(pattern=ids.IMAGE_REF, pattern_fix=ids.IMAGE_REF_FIX)), required=False,
                               default=None),
    "state": Field(Obj({
        "sha256": Field(Digest("of the unit's state-digests.json (size and SHA-256 of every captured file)")),
        "size": Field(Int(minimum=0)),
        "files": Field(Int(minimum=0)),
        "bytes": Field(Int(minimum=0)),
        "evidence_sha256": Field(Digest("of the unit's evidence.json")),
    }), required=False, description="the captured state, sealed at capture and verified before any eviction"),
})

WORKER_WEIGHTS = Obj({
    "worker": Field(Ident()),
    "unit": Field(Ident()),
    "rank": Field(Int(minimum=0)),
    "role": Field(Str(enum=("model",))),
    "payload": Field(Nullable(Obj({
        "owner": Field(Ident("worker that owns (writes, stages) this payload")),
        "size": Field(Int(minimum=0)),
        "sha256": Field(Digest()),
        "path": Field(Str(pattern=PAYLOAD_PATH, pattern_fix="model-payloads/sha256/<digest>.pack")),
    })), description="native model payload; null when export was off"),
    "residual": Field(FILE_REF),
    "manifest": Field(FILE_REF),
    "replay": Field(FILE_REF),
    "allocations": Field(Int(minimum=0)),
    "model_bytes": Field(Int(minimum=0)),
    "residual_bytes": Field(Int(minimum=0)),
})

ARTIFACT_SCHEMA = Obj({
    "format": Field(Const(ARTIFACT_FORMAT)),
    "kind": Field(Const(ARTIFACT_KIND)),
    "state": Field(Str(enum=("accepted", "published"))),
    "capture_id": Field(Ident()),
    "created_at": Field(Timestamp()),
    "request_sha256": Field(Digest()),
    "identity": Field(Digest("recipe + model + engine + topology + snapshot driver")),
    "snapshot_driver": Field(Obj({
        "id": Field(Str(enum=("n580", "n610"))),
        "abi": Field(Int(minimum=1)),
        "row": Field(Str(min_len=1, description="contract row that admitted the capture host")),
        "captured_nvidia_driver": Field(Nullable(Str()), description="the captured driver floor"),
    })),
    "launch": Field(REQUEST_SCHEMA.fields["launch"].schema),
    "policy": Field(Obj({
        "process": Field(AnyJSON(object_only=True)),
        "compatibility": Field(Obj({
            "enforce_captured_driver_floor": Field(Bool()),
            "kernel": Field(Str(enum=("capability", "exact"))),
        })),
        "cache": Field(Obj({"paths": Field(Arr(AbsPath()))})),
    })),
    "compatibility": Field(Obj({"units": Field(Arr(PLATFORM, min_items=1))})),
    "capsule": Field(Obj({"units": Field(Arr(CAPSULE, min_items=1))})),
    "runtime": Field(Obj({
        "kind": Field(Str(enum=("host", "docker"))),
        "activation_runtime": Field(Obj({"abi": Field(Int(minimum=1)), "digest": Field(Digest())})),
        "criu_version": Field(Str(min_len=1)),
    })),
    "weights": Field(Obj({
        "workers": Field(Arr(WORKER_WEIGHTS, min_items=1)),
        "providers": Field(Obj({
            "native": Field(Obj({
                "repository": Field(Nullable(Str())),
                "revision": Field(Nullable(Str(pattern=ids.COMMIT, pattern_fix=ids.COMMIT_FIX))),
            })),
            "recovery": Field(Obj({
                "enabled": Field(Bool()),
                "source": Field(AnyJSON(object_only=True)),
                "model": Field(Obj({"id": Field(Str(min_len=1)),
                                    "revision": Field(Str(pattern=ids.COMMIT, pattern_fix=ids.COMMIT_FIX))})),
            })),
        })),
    })),
    "acceptance": Field(Obj({
        "prompt": Field(Str()),
        "max_tokens": Field(Int(minimum=1)),
        "reply": Field(Str()),
        "reply_sha256": Field(Digest()),
        "logprobs": Field(Nullable(Obj({
            "top": Field(Int(minimum=0, maximum=20)),
            "sha256": Field(Digest("digest of the validation reply's per-token log-probabilities")),
            "numerics": Field(Digest("fingerprint of the hardware that computed them")),
        })), required=False, default=None),
        "validated_at": Field(Timestamp()),
        "evidence": Field(AnyJSON(object_only=True), required=False, default={}),
    })),
    "parent": Field(Nullable(Digest("descriptor this one was published from")), required=False, default=None),
}, title="ColdSnap snapshot artifact (format 9)")


def artifact_json_schema() -> dict:
    """The JSON Schema of artifact format 9."""
    return json_schema_document(ARTIFACT_SCHEMA, schema_id="https://coldsnap.invalid/schemas/artifact-v9.json",
                                title="ColdSnap snapshot artifact, format 9")


MAX_DESCRIPTOR_BYTES = 64 << 20  # far above any descriptor (they are kilobytes), far below what hurts


def read_descriptor_file(path: Path | str, *, what: str = "artifact", follow_links: bool = True) -> bytes:
    """The bytes of a descriptor file: a regular file (links followed: ``current``; with
    ``follow_links=False`` a link is refused) of at most MAX_DESCRIPTOR_BYTES. A directory, a FIFO, a
    device (``/dev/zero``) or a giant is one clear ColdSnapError, never a hang or an unbounded read; a
    missing file is FileNotFoundError."""
    fix = "give the path of an artifact.json a capture committed"
    try:
        data = read_regular_file(path, MAX_DESCRIPTOR_BYTES, follow_links=follow_links)
    except FileNotFoundError:
        raise
    except NotRegularFile as exc:
        raise ColdSnapError(f"{what} {path} is {exc.args[0]}", fix=fix) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_links:
            raise ColdSnapError(f"{what} {path} is a symbolic link",
                                fix=f"{fix} (ColdSnap never reads one through a link there)") from None
        raise ColdSnapError(f"{what} {path} cannot be read: {exc.strerror or exc}", fix=fix) from None
    if data is None:
        raise ColdSnapError(f"{what} {path} is larger than {MAX_DESCRIPTOR_BYTES >> 20} MiB: no descriptor is",
                            fix=fix)
    return data


def load_artifact(text: str | bytes, *, document: str = "artifact") -> dict:
    """Decode and validate an artifact descriptor."""
    return validate_artifact(strict_loads(text, document=document), document=document)


def _consistency(art: dict) -> list[FormatIssue]:
    """Fields that state the same fact twice must agree."""
    issues: list[FormatIssue] = []
    acc = art["acceptance"]
    want = "sha256:" + hashlib.sha256(acc["reply"].encode()).hexdigest()
    if acc["reply_sha256"] != want:
        issues.append(FormatIssue("$.acceptance.reply_sha256", f"is not the digest of acceptance.reply ({want})",
                                  "recapture: the acceptance evidence does not hold together"))
    if art["runtime"]["kind"] != art["launch"]["runtime"]:
        issues.append(FormatIssue("$.runtime.kind", f"{art['runtime']['kind']!r} but launch.runtime is "
                                  f"{art['launch']['runtime']!r}", "record the runtime the capture ran"))
    recorded, model = art["weights"]["providers"]["recovery"]["model"], art["launch"]["model"]
    for key in ("id", "revision"):
        if recorded[key] != model[key]:
            issues.append(FormatIssue(f"$.weights.providers.recovery.model.{key}",
                                      f"{recorded[key]!r} but launch.model.{key} is {model[key]!r}",
                                      "the recovery provider replays the launch's model: record the same"))
    driver = art["snapshot_driver"]
    contract = SNAPSHOT_DRIVERS[driver["id"]]
    if driver["abi"] != contract.abi:
        issues.append(FormatIssue("$.snapshot_driver.abi", f"{driver['abi']} is not snapshot driver "
                                  f"{driver['id']}'s ABI {contract.abi}", "recapture with this ColdSnap"))
    if driver["row"] not in contract_rows(driver["id"]):
        issues.append(FormatIssue("$.snapshot_driver.row", f"{driver['row']!r} is not a contract row of snapshot "
                                  f"driver {driver['id']}", f"use one of {', '.join(contract_rows(driver['id']))}"))
    if art["state"] == "published" and art["parent"] is None:
        issues.append(FormatIssue("$.parent", "a published descriptor names the descriptor it was published from",
                                  "give the parent's digest (publish sets it)"))
    return issues


def validate_artifact(value: Any, *, document: str = "artifact") -> dict:
    """Validate a decoded artifact and its internal references."""
    art = validate_document(ARTIFACT_SCHEMA, value, document=document)
    issues: list[FormatIssue] = launch_issues(art["launch"])
    issues += _consistency(art)
    unit_ids = [u["id"] for u in art["launch"]["units"]]
    for section, key in (("compatibility", "units"), ("capsule", "units")):
        listed = [e["unit"] for e in art[section][key]]
        if sorted(listed) != sorted(unit_ids):
            issues.append(FormatIssue(f"$.{section}.{key}", f"lists units {listed}, launch has {unit_ids}",
                                      "record exactly one entry per launch unit"))
    worker_ids = sorted(w["id"] for w in art["launch"]["execution"]["workers"])
    listed = sorted(w["worker"] for w in art["weights"]["workers"])
    if listed != worker_ids:
        issues.append(FormatIssue("$.weights.workers", f"lists workers {listed}, launch has {worker_ids}",
                                  "record exactly one weights entry per worker"))
    launch_workers = {w["id"]: w for w in art["launch"]["execution"]["workers"]}
    for i, w in enumerate(art["weights"]["workers"]):
        declared = launch_workers.get(w["worker"])
        for key in ("unit", "rank"):
            if declared is not None and w[key] != declared[key]:
                issues.append(FormatIssue(f"$.weights.workers[{i}].{key}",
                                          f"worker {w['worker']!r} has {key} {declared[key]!r} in launch, not {w[key]!r}",
                                          f"record the launch worker's {key}"))
        if w["payload"] is not None and w["payload"]["owner"] not in launch_workers:
            issues.append(FormatIssue(f"$.weights.workers[{i}].payload.owner",
                                      f"owner {w['payload']['owner']!r} is not a launch worker",
                                      "name the worker that wrote the payload"))
        p = w["payload"]
        if p is not None and p["path"] != f"model-payloads/sha256/{p['sha256'].split(':', 1)[1]}.pack":
            issues.append(FormatIssue(f"$.weights.workers[{i}].payload.path",
                                      f"path {p['path']!r} does not match digest {p['sha256']}",
                                      "the payload path is derived from its digest: model-payloads/sha256/<hex>.pack"))
    if issues:
        raise FormatError(issues, document=document)
    return art
