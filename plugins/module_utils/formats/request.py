"""Operation request, format 4: the strict, engine-neutral input of every operation.

``load_request`` decodes (strict JSON), validates the schema (unknown fields,
types, required fields, digest-pinned images, immutable revisions), checks the
cross references (units, workers, groups, services, mounts, operation needs),
and returns the normalized request with driver- and engine-owned defaults filled in.

Why one ~560-line unit: the schema, the cross rules and what identity and placement mean
are one contract (request format 4); splitting them would let a rule drift from the
fields it reads. Engine rules stay in :mod:`.engines`, capsule path policy in
:mod:`.capsule_paths`.
"""

from __future__ import annotations

import copy
import ipaddress
import re
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import FormatError, FormatIssue
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import identifiers as ids
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.canonical import canonical_sha256
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.capsule_paths import (
    cache_path_problems,
    normalize_abs,
    secrets_exposed,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.drivers import SNAPSHOT_DRIVERS
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.engines import (
    ENGINES,
    command_option,
    engine_issues,
    semantic_command,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.schema import (
    AnyJSON,
    Arr,
    Bool,
    Const,
    Field,
    Int,
    Map,
    Nullable,
    Obj,
    OneOfKind,
    Str,
    json_schema_document,
    validate_document,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.secrets import (
    UNIT_SECRET_FIX,
    holds_url_password,
    is_credential_name,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.strictjson import strict_loads
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import UNIT_SWITCHES
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.versions import (
    REQUEST_FORMAT,
    REQUEST_KIND,
)

OPERATIONS = ("capture", "restore", "warm", "publish", "publish-native", "sleep", "wake", "status",
              "native-status", "delete", "stop")
ENGINE_NAMES = ("reference", "vllm", "sglang")
RUNTIMES = ("host", "docker")
WEIGHT_MODES = ("auto", "native", "recovery", "cache-only-auto")
MATERIALIZE = ("off", "async", "required")
GROUP_KINDS = ("tensor", "pipeline", "data", "expert", "context")
NEEDS_ARTIFACT = ("restore", "warm", "publish", "publish-native", "native-status", "delete")
NEEDS_VALIDATION = ("capture", "restore", "warm", "wake")


# Free text travels in every task's arguments (ansible-runner drops an event's result above 700 kB, and
# with it the error a user needs): a request stays far below that.
MAX_PROMPT = 65536  # characters of the validation prompt
MAX_REPLY = 262144  # characters of an expected reply (up to 4096 tokens)
MAX_ARG, MAX_ARGS = 131072, 4096  # one command argument or environment value (Linux's own limit); arguments


def _no_nul(value: str) -> tuple[str, str] | None:
    """A process argument or environment value cannot hold a NUL byte (the kernel's strings end there)."""
    return ("contains a NUL byte, which no process argument or environment value can hold", "remove it") \
        if "\x00" in value else None


# An HTTP path as it goes on the request line: printable ASCII without spaces (percent-encode the rest).
HEALTH_PATH = r"/[\x21-\x7e]*"
HEALTH_PATH_FIX = "start the path with '/' and write it in printable ASCII without spaces (percent-encode the rest)"


def _abs_path_check(value: str) -> tuple[str, str] | None:
    if "\x00" in value:
        return "contains a NUL byte", "remove it"
    if normalize_abs(value) != value.rstrip("/") and value != "/":
        return f"{value!r} is not a normalized path ('.', '..' or '//' inside)", f"write it as {normalize_abs(value)!r}"
    return None


def AbsPath(description: str = "") -> Str:
    return Str(description=description, pattern=ids.ABS_PATH, pattern_fix="give an absolute path starting with '/'",
               check=_abs_path_check)


def Digest(description: str = "") -> Str:
    return Str(description=description, pattern=ids.DIGEST, pattern_fix="write it as 'sha256:<64 lower-case hex>'")


def Ident(description: str = "") -> Str:
    return Str(description=description, pattern=ids.ID,
               pattern_fix="use letters, digits, '.', '_' and '-' (start with a letter or digit, at most 128)")


MOUNT = Obj({
    "source": Field(AbsPath("host path (placement: may change between capture and restore)")),
    "target": Field(AbsPath("path inside the unit (identity: must stay the same)")),
    "read_only": Field(Bool(), required=False, default=True, description="model mounts must be read-only"),
})

UNIT = Obj({
    "id": Field(Ident("launch unit id")),
    "index": Field(Int(minimum=0, description="position of the unit, 0..n-1")),
    "host": Field(Str(pattern=ids.HOSTNAME, pattern_fix="give the inventory hostname of the unit's host",
                      description="Ansible inventory hostname that runs this unit")),
    "devices": Field(Arr(Int(minimum=0), description="GPU ordinals visible to the unit (empty: CPU)"),
                     required=False, default=[]),
    "image": Field(Str(pattern=ids.IMAGE_REF, pattern_fix=ids.IMAGE_REF_FIX,
                       description="runtime image pinned by digest (runtime docker)"), required=False),
    "environment_digest": Field(Digest("sha256 of the installed runtime tree (runtime host)"), required=False),
    "command": Field(Arr(Str(min_len=1, max_len=MAX_ARG, check=_no_nul), min_items=1, max_items=MAX_ARGS,
                         description="the engine's serve command (argv)")),
    "environment": Field(Map(Str(max_len=MAX_ARG, check=_no_nul), key_pattern=r"[A-Za-z_][A-Za-z0-9_]*",
                             key_fix="environment names use letters, digits and '_'"), required=False, default={}),
    "mounts": Field(Arr(MOUNT), required=False, default=[]),
})

MODEL_SOURCE = OneOfKind({
    "local-safetensors": Obj({
        "kind": Field(Const("local-safetensors")),
        "path": Field(AbsPath("directory holding the pinned safetensors files")),
    }),
    "huggingface": Obj({
        "kind": Field(Const("huggingface")),
        "repository": Field(Str(pattern=ids.MODEL_ID, pattern_fix="give 'org/name'"), required=False),
        "cache_dir": Field(AbsPath("Hugging Face cache on the host"), required=False),
    }),
}, description="where the recovery provider reads the pinned safetensors")

EXECUTION = Obj({
    "workers": Field(Arr(Obj({
        "id": Field(Ident("worker id")),
        "unit": Field(Ident("id of the launch unit that runs this worker")),
        "rank": Field(Int(minimum=0, description="global rank, 0..n-1")),
        "device_slot": Field(Nullable(Int(minimum=0)), description="index into the unit's devices; null on CPU"),
    }), min_items=1)),
    "groups": Field(Arr(Obj({
        "kind": Field(Str(enum=GROUP_KINDS)),
        "workers": Field(Arr(Ident(), min_items=1, description="worker ids in rank order")),
    })), required=False, default=[]),
    "services": Field(Arr(Obj({
        "id": Field(Ident("service id")),
        "unit": Field(Ident("unit that serves it")),
        "port": Field(Int(minimum=1, maximum=65535)),
        "address": Field(Str(min_len=1, max_len=255, description="interface the server binds"), required=False,
                         default="127.0.0.1"),
        "health_path": Field(Str(pattern=HEALTH_PATH, pattern_fix=HEALTH_PATH_FIX, max_len=1024),
                             required=False,
                             default="/health"),
    })), required=False, default=[]),
    "adapter": Field(Obj({
        "schema": Field(Str(min_len=1, description="engine adapter topology schema, e.g. reference-v1")),
        "digest": Field(Digest("digest of the engine adapter's topology description")),
        "payload": Field(AnyJSON(object_only=True), required=False, default={}),
    })),
})

POLICY = Obj({
    "process": Field(Obj({
        "backend": Field(Str(enum=("criu", "cuda-criu")), required=False,
                         description="cuda-criu: CUDA checkpoint then CRIU (n610; required for units with GPUs); "
                                     "criu: plain CRIU, a process holding CUDA fails the capture"),
        "kv_discard": Field(Bool(), required=False, description="true only: captures drop the KV cache"),
        "graph_policy": Field(Str(enum=("preserve", "recreate-from-plan")), required=False,
                              description="preserve: compiled/captured graphs stay in the snapshot (n610 only); "
                                          "recreate-from-plan: the engine drops them before the dump and "
                                          "re-creates them on restore (engines that implement it)"),
        "artifact_scope": Field(Str(enum=("portable", "target-local")), required=False,
                                description="portable only; target-local data is an overlay"),
    }), required=False, default={}),
    "weights": Field(Obj({
        "mode": Field(Str(enum=WEIGHT_MODES), required=False),
        "native": Field(Obj({
            "export": Field(Bool(), required=False, default=True,
                            description="write model-weights.pack at capture"),
            "materialize": Field(Str(enum=MATERIALIZE), required=False),
            "repository": Field(Nullable(Str(pattern=ids.MODEL_ID, pattern_fix="give 'org/name'")), required=False),
            "revision": Field(Nullable(Str(pattern=ids.COMMIT, pattern_fix=ids.COMMIT_FIX)), required=False),
            "staged": Field(Arr(Obj({
                "worker": Field(Ident()),
                "path": Field(AbsPath()),
                "bytes": Field(Int(minimum=0)),
                "sha256": Field(Digest()),
            })), required=False, default=[]),
        }), required=False, default={}),
        "recovery": Field(Obj({
            "enabled": Field(Bool(), required=False, default=True),
            "source": Field(Str(enum=("local-safetensors", "huggingface")), required=False),
        }), required=False, default={}),
    }), required=False, default={}),
    "cache": Field(Obj({
        "paths": Field(Arr(AbsPath()), required=False, default=[],
                       description="derived/JIT cache directories copied into the capsule"),
    }), required=False, default={}),
    "capsule": Field(Obj({
        "repository": Field(Nullable(Str(pattern=ids.REPOSITORY, pattern_fix="give 'registry:port/name' without tag")),
                            required=False, default=None),
    }), required=False, default={}),
    "compatibility": Field(Obj({
        "enforce_captured_driver_floor": Field(Bool(), required=False, default=True),
        "kernel": Field(Str(enum=("capability", "exact")), required=False, default="capability"),
    }), required=False, default={}),
    "retention": Field(Obj({
        "generations": Field(Int(minimum=1, maximum=1000), required=False, default=3),
    }), required=False, default={}),
})

REQUEST_SCHEMA = Obj({
    "format": Field(Const(REQUEST_FORMAT)),
    "kind": Field(Const(REQUEST_KIND)),
    "operation": Field(Str(enum=OPERATIONS)),
    "id": Field(Ident("operation id, unique per operation")),
    "snapshot_driver": Field(Obj({"id": Field(Str(enum=tuple(SNAPSHOT_DRIVERS)))}), required=False,
                             description="left out: the controller chooses the newest driver every placed host "
                                         "supports (capture: from host facts; other operations: the artifact's)"),
    "artifact": Field(Obj({
        "path": Field(AbsPath("committed artifact descriptor (artifact.json)")),
        "sha256": Field(Digest("expected digest of the descriptor file"), required=False),
    }), required=False),
    "output": Field(Obj({
        "artifact_dir": Field(AbsPath("directory the new descriptor is committed into")),
    }), required=False),
    "launch": Field(Obj({
        "engine": Field(Str(enum=ENGINE_NAMES)),
        "runtime": Field(Str(enum=RUNTIMES)),
        "model": Field(Obj({
            "id": Field(Str(pattern=ids.MODEL_ID, pattern_fix="give 'org/name'")),
            "revision": Field(Str(pattern=ids.COMMIT, pattern_fix=ids.COMMIT_FIX)),
            "source": Field(MODEL_SOURCE),
        })),
        "units": Field(Arr(UNIT, min_items=1)),
        "execution": Field(EXECUTION),
    })),
    "policy": Field(POLICY, required=False, default={}),
    "validation": Field(Obj({
        "health_path": Field(Str(pattern=HEALTH_PATH, pattern_fix=HEALTH_PATH_FIX, max_len=1024),
                             required=False,
                             default="/health"),
        "prompt": Field(Str(min_len=1, max_len=MAX_PROMPT)),
        "max_tokens": Field(Int(minimum=1, maximum=4096), required=False, default=16),
        "expected": Field(Nullable(Str(max_len=MAX_REPLY)), required=False, default=None,
                          description="exact reply; null at capture records the cold engine's reply"),
        "logprobs": Field(Nullable(Int(minimum=0, maximum=20)), required=False, default=None,
                          description="top log-probabilities per generated token that capture records and "
                                      "every later validation compares exactly where the numerics are the "
                                      "same (CPU model and count, GPU model and driver); 0 compares the "
                                      "reply alone; null: the engine's default"),
    }), required=False),
    "workload": Field(Obj({
        "recipe": Field(Ident("workload recipe name")),
        "served_model_name": Field(Str(min_len=1), required=False),
    })),
}, title="ColdSnap operation request (format 4)")


def request_json_schema() -> dict:
    """The JSON Schema of request format 4 (cross-reference rules are in the code, not the schema)."""
    return json_schema_document(REQUEST_SCHEMA, schema_id="https://coldsnap.invalid/schemas/request-v4.json",
                                title="ColdSnap operation request, format 4")


def load_request(text: str | bytes, *, document: str = "request", snapshot_driver: str | None = None) -> dict:
    """Decode, validate and normalize a request; raise FormatError listing every problem."""
    return validate_request(strict_loads(text, document=document), document=document,
                            snapshot_driver=snapshot_driver)


def validate_request(value: Any, *, document: str = "request", snapshot_driver: str | None = None) -> dict:
    """Validate an already-decoded request (from :func:`strict_loads`) and normalize it.

    The one request validation, used by the controller, every module and any Python
    caller: the schema (unknown fields, types, digests, revisions), the rules that span
    fields (:func:`cross_check`, including the capsule path policy) and the engine's
    rules (:func:`~.engines.engine_issues`). Every problem is reported at its JSON path.

    A request that names no snapshot driver is normalized for ``snapshot_driver`` (the
    controller's choice, see :func:`driver_candidates`); without one it is refused: the
    normalized form is explicit.
    """
    req = validate_document(REQUEST_SCHEMA, value, document=document)
    if "snapshot_driver" not in req:
        if snapshot_driver is None:
            raise FormatError([FormatIssue(
                "$.snapshot_driver", "the request names no snapshot driver and none was chosen for it",
                f"give snapshot_driver.id ({' or '.join(SNAPSHOT_DRIVERS)}), or run it through the coldsnap "
                "controller (CLI or coldsnap.api), which chooses the newest driver every placed host supports")],
                document=document)
        if snapshot_driver not in SNAPSHOT_DRIVERS:
            raise FormatError([FormatIssue("$.snapshot_driver.id", f"unknown snapshot driver {snapshot_driver!r}",
                                           f"use one of {', '.join(SNAPSHOT_DRIVERS)}")], document=document)
        req = {**req, "snapshot_driver": {"id": snapshot_driver}}
    elif snapshot_driver is not None and req["snapshot_driver"]["id"] != snapshot_driver:
        raise FormatError([FormatIssue(
            "$.snapshot_driver.id", f"the request names {req['snapshot_driver']['id']}, not {snapshot_driver}",
            f"leave snapshot_driver out to use {snapshot_driver}, or name the driver you want")], document=document)
    issues = cross_check(req)
    if issues:
        raise FormatError(issues, document=document)
    out = normalize(req)
    issues = engine_issues(out)
    if issues:
        raise FormatError(issues, document=document)
    return out


def driver_candidates(value: Any, *, document: str = "request") -> tuple[list[str], dict[str, FormatError]]:
    """For a request without ``snapshot_driver``: the drivers it is valid under, newest first, and why each
    other one is not (its FormatError). A request naming a driver has that one candidate."""
    req = validate_document(REQUEST_SCHEMA, value, document=document)
    named = req.get("snapshot_driver", {}).get("id")
    ordered = [named] if named else sorted(SNAPSHOT_DRIVERS, key=lambda d: SNAPSHOT_DRIVERS[d].min_nvidia_driver,
                                           reverse=True)
    valid: list[str] = []
    refused: dict[str, FormatError] = {}
    for driver in ordered:
        try:
            validate_request(req, document=document, snapshot_driver=None if named else driver)
        except FormatError as exc:
            refused[driver] = exc
        else:
            valid.append(driver)
    return valid, refused


# Host trees a unit never gets as a mount (units run as root; the rank container is privileged).
_HOST_TREES = {"/": "the host's whole file system", "/etc": "the host's configuration", "/proc": "the host's /proc",
               "/sys": "the host's /sys", "/dev": "the host's devices", "/boot": "the host's boot files",
               "/root": "root's home", "/var/run": "the host's runtime sockets", "/run": "the host's runtime sockets"}


def host_tree_exposed(source: str) -> str | None:
    """What of the host a mount of ``source`` exposes, when it is a system tree, lies below one or holds one
    (``/var`` holds ``/var/run``), is a container engine's socket, or holds secrets (a credential directory, a
    user's home, the container engine's data, ColdSnap's operation data: :func:`.capsule_paths.secrets_exposed`,
    the rule a cache path follows too); None for an ordinary directory."""
    path = normalize_abs(source)
    if path.endswith(("docker.sock", "containerd.sock", "podman.sock")):
        return "control of the host's container engine"
    for tree, what in _HOST_TREES.items():
        if path == tree or (tree not in ("/", "/root") and path.startswith(tree + "/")):
            return what  # /root/models/... is a model directory like any other; /root itself is not
        if tree.startswith(path.rstrip("/") + "/"):
            return f"{what} (it holds {tree})"
    return secrets_exposed(path)


# A command flag that names a credential: its last word (split at '-' and '_') is one is_credential_name
# refuses in an environment name (--api-key, --hf-token, --auth-token, --password). The engine's argv is part
# of its memory, so the value would reach the snapshot, the capsule and the registry, like an environment
# value. Only the last word counts, and never TOKENS: before it, and in the plural, the words name other things
# (--private-shm, --long-prefill-token-threshold, --max-num-batched-tokens, --return-tokens-as-token-ids).
_COUNT_WORDS = frozenset({"TOKENS"})
# UNIT_SECRET_FIX's way to pass what ColdSnap needs, after what to remove.
COMMAND_SECRET_FIX = ("remove the flag and its value from launch.units[].command: a process's arguments are part of "
                      "its memory and so of its snapshot and capsule. "
                      + (UNIT_SECRET_FIX.partition(". ")[2] or UNIT_SECRET_FIX))
URL_SECRET_FIX = ("take the password out of the URL (user@host, or no user): the engine reads credentials from "
                  "its own files, not from its command line. " + (UNIT_SECRET_FIX.partition(". ")[2] or UNIT_SECRET_FIX))


def _credential_flag(arg: str) -> str | None:
    """The flag name (without the value of ``--flag=value``) when ``arg`` is a flag that names a credential."""
    if not arg.startswith("-"):
        return None
    words = [w for w in re.split(r"[-_]", arg.split("=", 1)[0]) if w]
    if words and words[-1].upper() not in _COUNT_WORDS and is_credential_name(words[-1]):
        return arg.split("=", 1)[0]
    return None


# Where a unit's mount would hide what the unit itself needs (checked on the normalized target).
_TARGET_TREES = {"/proc": "hide the kernel's /proc", "/sys": "hide the kernel's /sys", "/dev": "hide the unit's devices",
                 "/opt/coldsnap": "hide ColdSnap's activation runtime (mounted at /opt/coldsnap/activation)"}
_TARGET_DIRS = ("/", "/etc", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/opt", "/var")


def _nested(a: str, b: str) -> bool:
    """``a`` and ``b`` are the same directory or one holds the other."""
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def _target_reserved(target: str) -> str | None:
    for tree, what in _TARGET_TREES.items():
        if target == tree or target.startswith(tree + "/"):
            return what
    if target in _TARGET_DIRS:
        return f"hide the unit's own {target} (its system files, or ColdSnap's)"
    return None


def launch_issues(launch: dict, *, op: str | None = None) -> list[FormatIssue]:
    """The rules within a ``launch`` (a request's, or the one an artifact records): unit, worker, group and
    service references, the runtime's pins, mounts, and the serve command against its services. ``op``:
    the operation that runs it (a capture starts the command, so its engine's defaults count)."""
    issues: list[FormatIssue] = []

    def add(path: str, message: str, fix: str) -> None:
        issues.append(FormatIssue(path, message, fix))

    units = launch["units"]
    source = launch["model"]["source"]
    model_root = source.get("path") or source.get("cache_dir")  # where the recovery provider reads the model
    model_path = normalize_abs(model_root) if model_root else None
    exposed = host_tree_exposed(model_root) if model_root else None
    if exposed:  # a docker unit binds it when no mount covers it
        where = "path" if source.get("path") else "cache_dir"
        add(f"$.launch.model.source.{where}", f"the model is read from {model_root!r}, which would give the unit "
            f"{exposed}", "point it at the model's own directory (e.g. /var/lib/coldsnap/models/<name>)")
    unit_by_id: dict[str, dict] = {}
    for i, unit in enumerate(units):
        p = f"$.launch.units[{i}]"
        if unit["id"] in unit_by_id:
            add(f"{p}.id", f"duplicate unit id {unit['id']!r}", "give every unit a unique id")
        unit_by_id.setdefault(unit["id"], unit)
        if unit["index"] != i:
            add(f"{p}.index", f"index is {unit['index']} but the unit is at position {i}",
                "list units in index order with indexes 0..n-1")
        if len(set(unit["devices"])) != len(unit["devices"]):
            add(f"{p}.devices", "a device ordinal appears twice", "list each GPU once")
        for name, value in sorted(unit.get("environment", {}).items()):
            if is_credential_name(name):
                add(f"{p}.environment.{name}", f"{name} looks like a credential", UNIT_SECRET_FIX)
            elif isinstance(value, str) and holds_url_password(value):
                add(f"{p}.environment.{name}", "the value is a URL with a password in it (user:password@)",
                    UNIT_SECRET_FIX)
        for j, arg in enumerate(unit["command"]):
            if isinstance(arg, str) and holds_url_password(arg):  # an operand after "--" too
                add(f"{p}.command[{j}]", "the argument is a URL with a password in it (user:password@): a "
                    "process's arguments are part of its memory, so of its snapshot and capsule", URL_SECRET_FIX)
        for j, arg in enumerate(unit["command"]):
            if arg == "--":
                break  # what follows are operands, not flags
            flag = _credential_flag(arg)
            if flag:
                add(f"{p}.command[{j}]", f"{flag} passes a credential on the serve command line (a process's "
                    "arguments are part of its memory, like its environment)", COMMAND_SECRET_FIX)
        for name, switch in UNIT_SWITCHES.items():
            value = unit.get("environment", {}).get(name)
            if value is not None and value.strip().lower() not in switch.values:
                add(f"{p}.environment.{name}", f"{value!r} {switch.problem}", switch.fix)
        if launch["runtime"] == "docker":
            if "image" not in unit:
                add(f"{p}.image", "runtime 'docker' needs a digest-pinned image", ids.IMAGE_REF_FIX)
            if "environment_digest" in unit:
                add(f"{p}.environment_digest", "runtime 'docker' pins its userspace with image, not environment_digest",
                    "remove environment_digest")
        else:
            if "environment_digest" not in unit:
                add(f"{p}.environment_digest", "runtime 'host' needs environment_digest (the installed runtime tree)",
                    "run 'coldsnap environment-digest' on the host and put its output here")
            if "image" in unit:
                add(f"{p}.image", "runtime 'host' runs no image", "remove image or set launch.runtime to 'docker'")
        targets = set()
        for j, mount in enumerate(unit["mounts"]):
            exposed = host_tree_exposed(mount["source"])
            if exposed:
                add(f"{p}.mounts[{j}].source", f"mounting {mount['source']!r} would give the unit {exposed}",
                    "mount the model's own directory (a unit's mounts hold model files, read-only)")
            target = normalize_abs(mount["target"])
            hidden = _target_reserved(target)
            if hidden:
                add(f"{p}.mounts[{j}].target", f"a mount at {mount['target']!r} would {hidden}",
                    "mount the model at a directory of its own (e.g. /models/<name>)")
            if target in targets:
                add(f"{p}.mounts[{j}].target", f"mount target {mount['target']!r} appears twice", "mount each target once")
            targets.add(target)
            if not mount.get("read_only", True) and model_path and (
                    _nested(target, model_path) or _nested(normalize_abs(mount["source"]), model_path)):
                add(f"{p}.mounts[{j}].read_only", f"mount {mount['target']!r} holds the model's files "
                    f"({model_path}) and is writable", "set read_only true (model mounts are read-only)")

    workers = launch["execution"]["workers"]
    worker_ids: set[str] = set()
    slots: set[tuple[str, int]] = set()
    ranks: dict[int, str] = {}
    for i, w in enumerate(workers):
        p = f"$.launch.execution.workers[{i}]"
        if w["id"] in worker_ids:
            add(f"{p}.id", f"duplicate worker id {w['id']!r}", "give every worker a unique id")
        worker_ids.add(w["id"])
        unit = unit_by_id.get(w["unit"])
        if unit is None:
            add(f"{p}.unit", f"worker {w['id']!r} names undeclared unit {w['unit']!r}",
                f"use one of the units in launch.units: {', '.join(unit_by_id) or '(none)'}")
        else:
            slot = w["device_slot"]
            if slot is not None:
                if slot >= len(unit["devices"]):
                    add(f"{p}.device_slot", f"slot {slot} is out of range: unit {unit['id']!r} has "
                        f"{len(unit['devices'])} device(s)", "use 0..len(devices)-1 or list the device on the unit")
                elif (unit["id"], slot) in slots:
                    add(f"{p}.device_slot", f"slot {slot} of unit {unit['id']!r} is already used by another worker",
                        "give each worker its own device slot")
                slots.add((unit["id"], slot))
            elif unit["devices"]:
                add(f"{p}.device_slot", f"unit {unit['id']!r} has GPUs but the worker has no device slot",
                    "set device_slot to the worker's index into the unit's devices")
        if w["rank"] in ranks:
            add(f"{p}.rank", f"rank {w['rank']} is also worker {ranks[w['rank']]!r}", "give each worker a unique rank")
        ranks.setdefault(w["rank"], w["id"])
    if ranks and sorted(ranks) != list(range(len(ranks))):
        add("$.launch.execution.workers", f"ranks {sorted(ranks)} are not 0..{len(ranks) - 1}",
            "number the ranks contiguously from 0")
    for uid in unit_by_id:
        if not any(w["unit"] == uid for w in workers):
            add("$.launch.execution.workers", f"unit {uid!r} runs no worker", "assign at least one worker to every unit")

    for i, g in enumerate(launch["execution"]["groups"]):
        seen: set[str] = set()
        for j, wid in enumerate(g["workers"]):
            if wid not in worker_ids:
                add(f"$.launch.execution.groups[{i}].workers[{j}]", f"unknown worker {wid!r}",
                    "list only workers declared in execution.workers")
            if wid in seen:
                add(f"$.launch.execution.groups[{i}].workers[{j}]", f"worker {wid!r} appears twice in the group",
                    "list each worker once")
            seen.add(wid)

    service_ids: set[str] = set()
    endpoints: set[tuple[str, int]] = set()
    for i, s in enumerate(launch["execution"]["services"]):
        p = f"$.launch.execution.services[{i}]"
        if s["id"] in service_ids:
            add(f"{p}.id", f"duplicate service id {s['id']!r}", "give every service a unique id")
        service_ids.add(s["id"])
        unit = unit_by_id.get(s["unit"])
        if unit is None:
            add(f"{p}.unit", f"service {s['id']!r} names undeclared unit {s['unit']!r}", "use a unit from launch.units")
            continue
        address = s.get("address", "127.0.0.1")
        if not _ip_literal(address):
            # A restore moves listeners by the addresses CRIU recorded, which are numbers: a name matches none.
            add(f"{p}.address", f"{address!r} is not an IP address", "give the interface as a number (127.0.0.1, "
                "0.0.0.0, ::1 or the host's address), never a host name")
        key = (unit["host"], s["port"])
        if key in endpoints:
            add(f"{p}.port", f"port {s['port']} is already used on host {unit['host']!r}", "give each service its own port")
        endpoints.add(key)
        engine = ENGINES.get(launch["engine"])
        if engine is not None:
            got = command_option(unit["command"], engine.port_flag) if engine.port_flag else None
            if got is not None and got != str(s["port"]):
                add(f"{p}.port", f"service {s['id']!r} is on port {s['port']} but unit {unit['id']!r}'s command sets "
                    f"{engine.port_flag} {got}", "make them agree (on restore both name the port to serve on)")
            elif got is None and op == "capture" and engine.default_port not in (None, s["port"]):
                # A capture starts the command: without the flag the engine listens on its default.
                add(f"{p}.port", f"service {s['id']!r} is on port {s['port']} but unit {unit['id']!r}'s command has "
                    f"no {engine.port_flag}, so engine {launch['engine']!r} listens on its default "
                    f"{engine.default_port}", f"add {engine.port_flag} {s['port']} to the command")
            got = command_option(unit["command"], engine.address_flag) if engine.address_flag else None
            if got and not _ip_literal(got):
                cmd, flag = unit["command"], engine.address_flag
                j = max(i for i, tok in enumerate(cmd) if tok == flag or tok.startswith(flag + "="))
                j += 0 if "=" in cmd[j] else 1
                add(f"$.launch.units[{launch['units'].index(unit)}].command[{j}]", f"{flag} {got!r} is not "
                    "an IP address", "bind to a number (0.0.0.0, 127.0.0.1, :: or the host's address), never a host "
                    "name: a restore moves the listener by the address CRIU recorded")
                continue
            binds = f"'s command binds {engine.address_flag} {got}"
            if got is None and op == "capture":
                got = engine.default_address
                binds = (f"'s command has no {engine.address_flag}, so engine {launch['engine']!r} binds its "
                         f"default {got}")
            if got not in (None, "", "0.0.0.0", "::", s.get("address", "127.0.0.1")):
                add(f"{p}.address", f"service {s['id']!r} is probed at {s.get('address', '127.0.0.1')} but unit "
                    f"{unit['id']!r}{binds}",
                    f"set address to {got!r} (or bind the command to it, or to 0.0.0.0)")

    return issues


def _ip_literal(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def cross_check(req: dict) -> list[FormatIssue]:
    """Rules that span fields: inventories, references, operation needs."""
    launch = req["launch"]
    op = req["operation"]
    units = launch["units"]
    issues = launch_issues(launch, op=op)

    def add(path: str, message: str, fix: str) -> None:
        issues.append(FormatIssue(path, message, fix))

    worker_ids = {w["id"] for w in launch["execution"]["workers"]}

    # The capsule builder's own path policy, so a path it would refuse fails here, before the capture runs.
    mount_targets = [m["target"] for u in units for m in u["mounts"]]
    for i, problem, fix in cache_path_problems(req.get("policy", {}).get("cache", {}).get("paths", []),
                                               mount_targets):
        add(f"$.policy.cache.paths[{i}]", problem, fix)

    if op in NEEDS_ARTIFACT and "artifact" not in req:
        add("$.artifact", f"operation {op!r} needs the committed artifact", "add artifact.path (the artifact.json to use)")
    if op == "capture":
        if "artifact" in req:
            add("$.artifact", "capture creates an artifact and takes none", "remove artifact; set output.artifact_dir")
        if "output" not in req:
            add("$.output", "capture needs an output directory", "add output.artifact_dir")
    if op in ("publish", "publish-native") and "output" not in req:
        add("$.output", f"{op} writes a separate descriptor", "add output.artifact_dir for the published descriptor")
    if op in NEEDS_VALIDATION and "validation" not in req:
        add("$.validation", f"operation {op!r} validates the engine's reply", "add validation.prompt")
    if op in NEEDS_VALIDATION and not launch["execution"]["services"]:
        # The validation request goes to a service: without one no unit would probe or ask anything, and a
        # capture would commit an "accepted" artifact whose acceptance reply nobody checked.
        add("$.launch.execution.services", f"operation {op!r} validates the engine's reply, but no service says "
            "where the engine serves", "add the service the validation request goes to, e.g. {\"id\": \"api\", "
            "\"unit\": \"<the unit that serves>\", \"port\": <its --port>}")
    policy = req.get("policy", {})
    if op == "publish" and not policy.get("capsule", {}).get("repository"):
        add("$.policy.capsule.repository", "publish pushes capsules but no repository is set",
            "set policy.capsule.repository, e.g. 'registry.example:5000/coldsnap/capsules'")
    native = policy.get("weights", {}).get("native", {})
    if op == "publish-native" and not native.get("repository"):
        add("$.policy.weights.native.repository", "publish-native uploads payloads but no repository is set",
            "set policy.weights.native.repository to the Hugging Face repository ('org/name')")
    weights = policy.get("weights", {})
    recovery_on = weights.get("recovery", {}).get("enabled", True)
    if weights.get("mode") == "recovery" and not recovery_on:
        add("$.policy.weights.mode", "mode 'recovery' asks for the recovery provider that "
            "policy.weights.recovery.enabled turns off", "enable recovery, or use mode 'native' or 'auto'")
    if op == "capture" and native.get("export") is False:
        if not recovery_on:
            add("$.policy.weights.native.export", "with the native export off and recovery disabled, nothing "
                "could give a restore of this capture its weights", "export the native payload, or enable recovery")
        elif weights.get("mode") == "native":
            add("$.policy.weights.mode", "mode 'native' needs the native payload that native.export false leaves "
                "out of the capture", "export it (native.export true), or use mode 'auto' or 'recovery'")
    for i, st in enumerate(native.get("staged", [])):
        if st["worker"] not in worker_ids:
            add(f"$.policy.weights.native.staged[{i}].worker", f"unknown worker {st['worker']!r}",
                "stage payloads only for declared workers")
    backend = policy.get("process", {}).get("backend")
    contract = SNAPSHOT_DRIVERS[req["snapshot_driver"]["id"]]
    if backend == "cuda-criu" and not contract.captures_cuda_state:
        add("$.policy.process.backend", f"snapshot driver {contract.id} captures no CUDA state",
            "use backend 'criu' with n580, or snapshot driver n610")
    # policy.process: a value that cannot be honoured is refused here (a normalized request carries its
    # driver's defaults: switching drivers means leaving policy.process out, or snapshot_driver altogether).
    process = policy.get("process", {})
    if process.get("graph_policy") == "preserve" and not contract.captures_cuda_state:
        add("$.policy.process.graph_policy", f"snapshot driver {contract.id} captures before CUDA exists: there "
            "are no graphs to preserve", "use 'recreate-from-plan' (n580's default), leave policy.process out, or "
            "use snapshot driver n610")
    if backend == "criu" and contract.captures_cuda_state and any(u["devices"] for u in units):
        add("$.policy.process.backend", f"units with GPUs hold a CUDA context under snapshot driver {contract.id}, "
            "which plain CRIU cannot dump", "use backend 'cuda-criu' (n610's default), or snapshot driver n580")
    if process.get("kv_discard") is False:
        add("$.policy.process.kv_discard", "keeping the KV cache in a snapshot is not implemented: a capture "
            "drains requests and releases the KV space before the dump", "set kv_discard true, or leave it out")
    if process.get("artifact_scope") == "target-local":
        add("$.policy.process.artifact_scope", "target-local captures are not implemented: every capture is "
            "portable (target-local data goes into an overlay: artifact_store state=overlay)",
            "set artifact_scope 'portable', or leave it out")
    if op == "warm" and not contract.warm_restore:
        add("$.operation", f"snapshot driver {contract.id} has no warm-restore boundary (it re-creates CUDA on restore)",
            "use operation 'restore', or capture with snapshot driver n610")
    return issues


def normalize(req: dict) -> dict:
    """Fill driver-owned and engine-owned defaults so the normalized form is explicit."""
    out = copy.deepcopy(req)
    contract = SNAPSHOT_DRIVERS[out["snapshot_driver"]["id"]]
    policy = out.setdefault("policy", {})
    for section, defaults in contract.policy_defaults.items():
        target = policy.setdefault(section, {})
        for key, value in defaults.items():
            target.setdefault(key, copy.deepcopy(value))
    weights = policy["weights"]
    weights.setdefault("native", {}).setdefault("materialize", ENGINES[out["launch"]["engine"]].default_materialize)
    weights["native"].setdefault("export", True)
    weights["native"].setdefault("repository", None)
    weights["native"].setdefault("revision", None)
    weights["native"].setdefault("staged", [])
    weights.setdefault("recovery", {}).setdefault("enabled", True)
    weights["recovery"].setdefault("source", out["launch"]["model"]["source"]["kind"])
    src = out["launch"]["model"]["source"]
    if src["kind"] == "huggingface":
        src.setdefault("repository", out["launch"]["model"]["id"])
    for section in ("cache", "capsule", "compatibility", "retention"):
        policy.setdefault(section, {})
    policy["cache"].setdefault("paths", [])
    policy["capsule"].setdefault("repository", None)
    policy["compatibility"].setdefault("enforce_captured_driver_floor", True)
    policy["compatibility"].setdefault("kernel", "capability")
    policy["retention"].setdefault("generations", 3)
    return out


def request_sha256(req: dict) -> str:
    """Digest of the normalized request (RFC 8785 canonical JSON)."""
    return canonical_sha256(req)


# Environment variables that describe where a unit runs, not what it is: collective transports
# (rebuilt fresh on every restore and handed to the engine) and device/host placement.
TRANSPORT_PREFIXES = ("NCCL_", "GLOO_", "MASTER_", "UCX_", "TP_SOCKET_IFNAME")
PLACEMENT_VARIABLES = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "HOSTNAME", "VLLM_HOST_IP", "VLLM_PORT")


def split_environment(env: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(the rest, transport env): transport variables are placement and may change."""
    rest = {k: v for k, v in env.items() if not k.startswith(TRANSPORT_PREFIXES)}
    transport = {k: v for k, v in env.items() if k.startswith(TRANSPORT_PREFIXES)}
    return rest, transport


def identity_environment(env: dict[str, str]) -> dict[str, str]:
    """The variables a restore must keep as captured (the restored process holds them in memory)."""
    rest, _transport = split_environment(env)
    return {k: v for k, v in rest.items() if k not in PLACEMENT_VARIABLES}


def identity_parts(req: dict) -> dict[str, Any]:
    """What makes a workload the same one, by request field: recipe, model, engine, runtime, the
    portable topology and the snapshot driver. Placement is left out: hosts, device UUIDs and
    ordinals (only the device count counts), mount sources, the serving port and address (the
    command's placement flags too) and transport/placement environment variables."""
    launch = req["launch"]
    engine = launch["engine"]
    parts: dict[str, Any] = {
        "$.workload.recipe": req["workload"]["recipe"],
        "$.launch.model": {"id": launch["model"]["id"], "revision": launch["model"]["revision"]},
        "$.launch.engine": engine,
        "$.launch.runtime": launch["runtime"],
        "$.snapshot_driver.id": req["snapshot_driver"]["id"],
        "$.launch.units": [u["id"] for u in launch["units"]],
    }
    for i, u in enumerate(launch["units"]):
        p = f"$.launch.units[{i}]"
        parts[f"{p}.index"] = u["index"]
        parts[f"{p}.devices"] = len(u["devices"])
        parts[f"{p}.command"] = semantic_command(engine, u["command"])
        parts[f"{p}.environment"] = identity_environment(u.get("environment", {}))
        parts[f"{p}.mounts"] = sorted(m["target"] for m in u["mounts"])
    ex = launch["execution"]
    parts["$.launch.execution.workers"] = ex["workers"]
    parts["$.launch.execution.groups"] = ex["groups"]
    parts["$.launch.execution.services"] = [{"id": s["id"], "unit": s["unit"]} for s in ex["services"]]
    parts["$.launch.execution.adapter"] = {"schema": ex["adapter"]["schema"], "digest": ex["adapter"]["digest"]}
    return parts


def identity(req: dict) -> str:
    """Identity of the artifact lineage (:func:`identity_parts`, RFC 8785 digest)."""
    return canonical_sha256(identity_parts(req))


def identity_differences(artifact: dict, req: dict) -> list[str]:
    """The request fields whose identity part differs from the capture recorded in ``artifact``
    (its launch and snapshot driver; the recipe only through the digest)."""
    if identity(req) == artifact["identity"]:
        return []
    captured = {**req, "launch": artifact["launch"], "snapshot_driver": {"id": artifact["snapshot_driver"]["id"]}}
    mine, theirs = identity_parts(req), identity_parts(captured)
    fields = [k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k)]
    return sorted(fields) or ["$.workload.recipe"]


def require_identity(artifact: dict, req: dict, *, what: str = "the captured workload") -> None:
    """Refuse a request that does not describe the workload ``artifact`` holds, naming the fields."""
    fields = identity_differences(artifact, req)
    if fields:
        raise FormatError([FormatIssue(
            f, f"identity differs: not the value of {what} (identity is recipe, model, engine, runtime, topology "
               "and snapshot driver)",
            "restore with the captured value; only placement may change (hosts, devices by UUID/ordinal, mount "
            "sources, the serving port and address, transport variables)") for f in fields],
            document="request")


def needs_coordinator(req: dict) -> bool:
    """Whether the activation needs the coordinator: its units (or workers) must agree on phases
    and exchange transport endpoints. One unit of one worker has nobody to agree with."""
    return len(req["launch"]["units"]) > 1 or len(req["launch"]["execution"]["workers"]) > 1


def unit_hosts(req: dict) -> list[str]:
    """Inventory hostnames of the launch units, in unit order, each once."""
    out: list[str] = []
    for u in req["launch"]["units"]:
        if u["host"] not in out:
            out.append(u["host"])
    return out


def units_on_host(req: dict, host: str) -> list[dict]:
    """Launch units placed on ``host`` (inventory hostname), in index order."""
    return [u for u in req["launch"]["units"] if u["host"] == host]


def workers_of_unit(req: dict, unit_id: str) -> list[dict]:
    """Workers that run inside ``unit_id``, by rank."""
    return sorted((w for w in req["launch"]["execution"]["workers"] if w["unit"] == unit_id), key=lambda w: w["rank"])
