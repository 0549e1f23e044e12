"""The ansible-runner driver: run one operation's playbook through the ansible-runner Python API
and write its receipt.

As ansible-runner itself does, a configuration object (:class:`RunConfig`: what to run,
checked and laid out in the private data directory) and a run object
(:class:`PlaybookRun`: handlers, cancellation, receipt) instead of one function whose
state lives in closures.

Private data directory (one per operation id, reused when the same operation
is replayed; each run gets its own artifact directory)::

    <state_root>/runs/<operation_id>/          0700
        .lock                                   one run of an operation at a time
        env/extravars                           0600  public extra vars (YAML flow, request strings !unsafe)
        env/envvars                             0600  non-secret environment we set
        env/settings                            0600  runner settings
        inventory/hosts.json                    0600  only when we wrote the inventory
        project -> <collection dir>             cwd of ansible-playbook
        secrets/                                0700  secret extra vars, only while a run starts
        artifacts/<ident>/                      ansible-runner's artifacts (+ ours below)
            command                             rewritten with the environment redacted
            job_events/*.json                   events, scrubbed of known secret values
            stdout                              scrubbed stdout, written from the events
            timing.ndjson                       the timing stream
            receipt.json
        receipt.json                            the latest run's receipt

Secret extra vars never enter ``env/``: they go to a 0600 file under
``secrets/`` passed as ``-e @file``; the file is deleted as soon as
ansible-playbook has loaded its variables (its first event) and again when the
run ends, whatever happens.

Why one ~630-line unit: configuration, run and receipt of one ansible-runner run share the
secret-handling and redaction rules described here; events, progress, inventory, timing and
redaction themselves are separate modules of :mod:`coldsnap.runner`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import secrets as pysecrets
import shlex
import shutil
import stat
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import (
    atomic_write_bytes,
    file_lock,
    lock_held,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.progress import DEFAULT_LEASE_S
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import (  # noqa: F401  # pylint: disable=W0611
    StateLayout,
    default_state_root,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import eviction
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import OPERATIONS, unit_hosts
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.timing import SpanRecorder

from coldsnap.receipts import build_receipt, write_receipt
from coldsnap.runner import rollback as rollback_mod
from coldsnap.runner.contract import (
    EXTRAVAR_KEEP_HANDOVER,
    EXTRAVAR_LIVE_PROGRESS,
    EXTRAVAR_REQUEST,
    EXTRAVAR_RUN_ID,
    check_prepare_only,
    collection_dir,
    operation_extravars,
    playbook_for,
    resolve_playbook,
    with_contract_extravars,
)
from coldsnap.runner.events import EventCollector
from coldsnap.runner.inventory import check_unit_hosts, inventory_from_request
from coldsnap.runner.proctree import find_child, playbooks_in, terminate_tree
from coldsnap.runner.progress import ProgressReporter
from coldsnap.runner.redaction import Redactor, is_secret_name, redact_env
from coldsnap.runner.timing_stream import TimingStream, TimingTarget

EventHandler = Callable[[dict], Any]
StatusHandler = Callable[..., Any]  # (data: dict, runner_config=...)
OPERATION_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
# How often the runner loop wakes to poll the cancel callback (seconds).
CANCEL_POLL_S = 0.25
RUNNER_SETTINGS = {"pexpect_timeout": CANCEL_POLL_S, "suppress_output_file": True}


@dataclass(frozen=True)
class OperationResult:
    """What :func:`run_playbook` did (the receipt is the durable record)."""

    operation_id: str
    operation: str
    succeeded: bool
    cancelled: bool
    receipt: dict
    receipt_path: Path
    run_dir: Path
    artifact_dir: Path
    runner_status: str
    rc: int | None

    @property
    def state(self) -> str:
        """``succeeded`` or ``failed`` (as in the receipt)."""
        return self.receipt["state"]

    @property
    def exit_code(self) -> int:
        """CLI exit status: 0 succeeded, 1 failed, 130 cancelled."""
        if self.cancelled:
            return 130
        return 0 if self.succeeded else 1


def _private_dir(path: Path) -> Path:
    """Create ``path`` 0700 (and make an existing one 0700), never through a symbolic link: one planted at
    ``runs/`` of a state root a user owns would have root chmod and write wherever it points. Its parent
    exists (the state root, checked by ``ensure_private_root``, or a directory this function made)."""
    path.mkdir(exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ColdSnapError(f"{path} is a symbolic link or not a directory ({exc.strerror}): ColdSnap never "
                            "writes through one", fix=f"remove {path}; the directories below the state root are "
                                                      "ColdSnap's own and it makes them itself") from None
    try:
        os.fchmod(fd, 0o700)  # also when it existed with a wider mode
    finally:
        os.close(fd)
    return path


def _write_private_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode(), mode=0o600)


def _write_extravars(path: Path, public_vars: Mapping[str, Any]) -> None:
    """``env/extravars`` (ansible-playbook reads it as ``-e @file``): YAML in JSON's flow style, where every
    string of the request that holds a ``{`` is tagged ``!unsafe``. Ansible trusts extra vars as templates, so
    a request string such as ``{{ lookup('pipe', ...) }}`` (a prompt, an environment value) would otherwise
    run on the controller when a task reads it; tagged, it stays the text it is. Only those strings: Ansible
    resolves a ``!unsafe`` scalar's type from its text as if it were unquoted (``"8"`` would become 8,
    ``"off"`` false), which no text with a brace in it is mistaken for; Jinja needs a brace."""
    body = ", ".join(f"{_yaml_quoted(str(k))}: {_yaml_flow(v, unsafe=k == EXTRAVAR_REQUEST)}"
                     for k, v in sorted(public_vars.items()))
    atomic_write_bytes(path, ("{" + body + "}\n").encode("ascii"), mode=0o600)


def _yaml_flow(value: Any, *, unsafe: bool) -> str:
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_yaml_quoted(str(k))}: {_yaml_flow(v, unsafe=unsafe)}"
                               for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_yaml_flow(v, unsafe=unsafe) for v in value) + "]"
    if isinstance(value, str):
        return ("!unsafe " if unsafe and "{" in value else "") + _yaml_quoted(value)
    return json.dumps(value)  # numbers, booleans, null: the same in YAML


def _yaml_quoted(text: str) -> str:
    """A YAML double-quoted scalar in ASCII: every character outside printable ASCII escaped (YAML refuses
    some raw ones; its escapes take a whole code point, so no surrogate pairs)."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 0x20 <= code < 0x7F:
            out.append(ch)
        else:
            out.append(f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return '"' + "".join(out) + '"'


def _collection_paths(extra: str | None) -> str:
    from coldsnap._collection import collection_root

    parts = [str(collection_root())]
    for p in (extra or "").split(os.pathsep):
        if p and p not in parts:
            parts.append(p)
    return os.pathsep.join(parts)


def _base_envvars() -> dict[str, str]:
    """Non-secret environment every run gets (recorded in ``env/envvars``)."""
    env = {
        "ANSIBLE_COLLECTIONS_PATH": _collection_paths(os.environ.get("ANSIBLE_COLLECTIONS_PATH")),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
        "ANSIBLE_LOCALHOST_WARNING": "False",
        "ANSIBLE_INVENTORY_UNPARSED_WARNING": "False",
        # Task arguments never go into the job events (a token passed as a module option is masked in
        # the module's result, not in the arguments Ansible would display).
        "ANSIBLE_DISPLAY_ARGS_TO_STDOUT": "False",
        # ansible-playbook waits for every task's result in sleeps of this many seconds: each task,
        # even a skipped one, costs at least one. Its default (1 ms) is a busy loop that competes with
        # the units being restored on small hosts; 50 ms cost a restore's ~40 tasks about 2 s. 5 ms
        # is neither (about 200 wake-ups a second while a long step runs).
        "ANSIBLE_INTERNAL_POLL_INTERVAL": os.environ.get("ANSIBLE_INTERNAL_POLL_INTERVAL", "0.005"),
    }
    # ansible-playbook of the controller's own environment, even when it is not activated.
    bin_dir = Path(sys.executable).parent
    if (bin_dir / "ansible-playbook").exists():
        env["PATH"] = os.pathsep.join([str(bin_dir), os.environ.get("PATH", os.defpath)])
    return env


def _new_ident() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S.%fZ") + "-" + pysecrets.token_hex(3)


def require_operation(request: Mapping[str, Any], operation: str) -> None:
    """A request runs only under its own operation (checked before any host is contacted)."""
    other = request.get("operation")
    if other != operation:
        raise ColdSnapError(
            f"request {request.get('id')} is for operation {other!r}, not {operation!r} (its field operation)",
            fix=f"run 'coldsnap {other}' (coldsnap.api.{str(other).replace('-', '_')}), "
                f"or set the request's operation to {operation!r}")


def _generated_operation_id(operation: str) -> str:
    return f"{operation}-{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}-{pysecrets.token_hex(4)}"


class _Secrets:
    """The run's secret extra vars file: created 0600, deleted at first event and at the end."""

    def __init__(self, directory: Path, values: Mapping[str, Any]) -> None:
        self.path: Path | None = None
        _private_dir(directory)
        for stale in directory.glob("extravars-*.json"):  # left by a run that crashed
            stale.unlink(missing_ok=True)
        if not values:
            return
        self.path = directory / f"extravars-{pysecrets.token_hex(8)}.json"
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(dict(values), fh)

    @property
    def cmdline(self) -> str | None:
        return f"-e @{shlex.quote(str(self.path))}" if self.path else None

    def delete(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)


@dataclass(frozen=True)
class RunConfig:
    """One operation's run, checked before anything runs: what, where, with which variables."""

    operation: str
    operation_id: str
    request: Mapping[str, Any] | None
    playbook_path: Path
    public_vars: Mapping[str, Any]
    secret_vars: Mapping[str, Any]
    inventory: Mapping[str, Any] | str | Path | None
    state_root: Path
    prepare_only: bool
    caller_env: Mapping[str, str]
    redactor: Redactor
    verbosity: int = 0
    keep_artifacts: int = 10
    notes: Mapping[str, Any] | None = None  # the controller's own findings, added to the receipt's result

    @classmethod
    def build(cls, *, operation: str, request: Mapping[str, Any] | None, playbook: str | Path | None,
              extravars: Mapping[str, Any], inventory: Mapping[str, Any] | str | Path | None, state_root: Path,
              prepare_only: bool = False, envvars: Mapping[str, str] | None = None,
              secret_extravars: Mapping[str, Any] | None = None, verbosity: int = 0,
              keep_artifacts: int = 10, notes: Mapping[str, Any] | None = None) -> RunConfig:
        """Check the inputs a user can get wrong (ColdSnapError with the fix) and split the variables.

        The contract vars (:func:`operation_extravars`) are set here from ``request``, ``prepare_only``
        and ``state_root``: ``extravars`` may repeat them, never contradict them."""
        if operation not in OPERATIONS:
            raise ColdSnapError(f"unknown operation {operation!r}", fix=f"use one of {', '.join(OPERATIONS)}")
        check_prepare_only(operation, prepare_only)
        if request is not None:
            require_operation(request, operation)
        operation_id = str(request["id"]) if request is not None else _generated_operation_id(operation)
        if not OPERATION_ID_RE.match(operation_id):
            raise ColdSnapError(f"operation id {operation_id!r} cannot name a run directory",
                                fix="use letters, digits, '.', '_' and '-'")
        if inventory is None and request is None:
            raise ColdSnapError("no inventory and no request to build one from", fix="pass an inventory")
        if inventory is not None and not isinstance(inventory, Mapping):
            inventory = Path(inventory).expanduser()
            if not inventory.exists():
                raise ColdSnapError(f"inventory {inventory} does not exist", fix="give an inventory file or directory")
        playbook_path = playbook_for(operation) if playbook is None else resolve_playbook(playbook)
        if inventory is not None and request is not None:
            check_unit_hosts(request, inventory)
        if playbook is None and request is not None:
            require_artifact_file(operation, request)
        extravars = with_contract_extravars(extravars, operation_extravars(
            request, prepare_only=prepare_only, state_root=state_root))
        public_vars = {k: v for k, v in extravars.items() if not is_secret_name(str(k))}
        secret_vars = {k: v for k, v in extravars.items() if is_secret_name(str(k))}
        for key, value in (secret_extravars or {}).items():
            if key in public_vars:
                raise ColdSnapError(f"extra var {key!r} is given both as public and as secret",
                                    fix="pass it once, as a secret")
            secret_vars[key] = value
        caller_env = {str(k): str(v) for k, v in (envvars or {}).items()}
        redactor = Redactor()
        redactor.add_secret_named(dict(os.environ))  # ansible-runner hands the whole environment on
        redactor.add_secret_named(caller_env)
        redactor.add(secret_vars)
        if isinstance(inventory, Mapping):
            redactor.add_secret_named(inventory)
        return cls(operation=operation, operation_id=operation_id, request=request, playbook_path=playbook_path,
                   public_vars=public_vars, secret_vars=secret_vars, inventory=inventory,
                   state_root=Path(state_root), prepare_only=prepare_only, caller_env=caller_env,
                   redactor=redactor, verbosity=verbosity, keep_artifacts=keep_artifacts, notes=notes)

    @property
    def run_dir(self) -> Path:
        return StateLayout(self.state_root).run(self.operation_id)

    def write_private_data_dir(self) -> tuple[str, dict[str, str]]:
        """Write env/, inventory/ and project; return (inventory path, secret env for the runner kwarg)."""
        return _prepare_run_dir(self.run_dir, public_vars=self.public_vars, caller_env=self.caller_env,
                                inventory=self.inventory, request=self.request)


# The operations whose playbooks read the request's artifact.json on the controller (delete takes a
# missing one as "nothing stored under it").
READS_ARTIFACT = ("restore", "warm", "sleep", "wake", "status", "stop", "native-status", "publish", "publish-native")
# Those that cannot go on without its content (status, stop and sleep act on what runs).
PARSES_ARTIFACT = ("restore", "warm", "wake", "native-status", "publish", "publish-native")


def require_artifact_file(operation: str, request: Mapping[str, Any]) -> None:
    """The artifact a request names is on this controller, or a clear error before the playbook runs."""
    path = (request.get("artifact") or {}).get("path")
    if operation not in READS_ARTIFACT or not path:
        return
    try:
        st = os.stat(path)
        if stat.S_ISREG(st.st_mode):
            with open(path, "rb") as f:
                if operation not in PARSES_ARTIFACT:
                    return
                try:
                    doc = json.loads(f.read())
                except ValueError as exc:  # the playbook's from_json would fail naming neither file nor fix
                    doc = exc
            if isinstance(doc, dict):
                return
            raise ColdSnapError(
                f"$.artifact.path: {path} is not an artifact descriptor (a JSON object): "
                f"{doc if isinstance(doc, ValueError) else 'it holds a JSON ' + type(doc).__name__}; "
                "it was damaged (truncated?) or is another file",
                fix="point artifact.path at a committed artifact.json (restore another generation) or capture "
                    "again")
        what = "is not a file"
    except FileNotFoundError:
        what = "does not exist on this controller"
    except PermissionError:
        raise ColdSnapError(f"$.artifact.path: {path} is not readable by this user",
                            fix="run as the user who captured it (or root), or copy the artifact directory where "
                                "you may read it") from None
    except OSError as exc:
        what = f"cannot be read ({exc.strerror or exc})"
    raise ColdSnapError(f"$.artifact.path: {path} {what}",
                        fix="capture first (coldsnap capture commits it under output.artifact_dir), or point "
                            "artifact.path at a committed artifact.json")


def run_playbook(*, operation: str, request: Mapping[str, Any] | None, playbook: str | Path | None,
                 extravars: Mapping[str, Any], inventory: Mapping[str, Any] | str | Path | None,
                 state_root: Path, prepare_only: bool = False, timing_sink: TimingTarget = None,
                 progress: bool | None = None, cancel_event: threading.Event | None = None,
                 envvars: Mapping[str, str] | None = None, secret_extravars: Mapping[str, Any] | None = None,
                 verbosity: int = 0, keep_artifacts: int = 10,
                 progress_stream: IO[str] | None = None, event_handler: EventHandler | None = None,
                 status_handler: StatusHandler | None = None,
                 notes: Mapping[str, Any] | None = None, rollback: bool = True) -> OperationResult:
    """Run ``playbook`` for ``operation`` and write receipt format 2 (also when it fails or is cancelled).

    ``playbook``: FQCN (``coldsnap.fleet.capture``), an absolute path or a path
    relative to the collection (``playbooks/capture.yml``); None: the collection's
    playbook of ``operation``. ``extravars`` need not hold the contract vars
    (:func:`operation_extravars`): they are set from ``request``, ``prepare_only`` and
    ``state_root``, and a different value for one of them is refused. ``inventory``: a
    path or an inventory dict; None builds one from the request's placement.
    ``extravars`` top-level keys with secret-looking names, and every key of
    ``secret_extravars``, travel through the secret channel (see module doc).
    ``envvars`` are added to the run's environment; secret-named ones are never
    written to ``env/envvars`` and are redacted everywhere they would be stored.
    ``progress``: None = only when stderr is a terminal. ``timing_sink``: see
    :mod:`coldsnap.runner.timing_stream`. ``event_handler(event)`` and
    ``status_handler(data, runner_config=...)`` are ansible-runner's callbacks, called after
    the controller's own with what the artifacts store (known secrets redacted); their
    return value is ignored and an exception they raise becomes a receipt warning
    (``result.controller_warnings``), never a failed run. Errors a user can fix before
    anything runs (unknown playbook, busy operation, a unit host missing from the
    inventory) raise ColdSnapError. ``notes``: the controller's findings before the run (e.g.
    ``snapshot_driver_selection``), added to the receipt's ``result``. ``rollback`` (restore and warm): a
    failure after the evict step restores the workload that ran before (:mod:`coldsnap.runner.rollback`).
    """
    try:
        import ansible_runner
    except ImportError:
        raise ColdSnapError("the controller needs ansible-runner, which is not installed",
                            fix="pip install ansible-runner (it is a dependency of the coldsnap package)") from None
    stream = progress_stream if progress_stream is not None else sys.stderr
    watched = progress if progress is not None else bool(getattr(stream, "isatty", lambda: False)())
    # the run's id: the hosts' claims on the workload tell this run from another run of the same request
    extravars = {EXTRAVAR_LIVE_PROGRESS: bool(watched), EXTRAVAR_RUN_ID: pysecrets.token_hex(16), **dict(extravars)}
    restoring = operation in eviction.RESTORE_OPERATIONS
    if restoring and rollback_mod.keeps_handover(Path(state_root), request, enabled=rollback):
        # a hand-over its activation never took stays for the rollback (rollback.py), no rival between
        extravars.setdefault(EXTRAVAR_KEEP_HANDOVER, True)
    config = RunConfig.build(operation=operation, request=request, playbook=playbook, extravars=extravars,
                             inventory=inventory, state_root=state_root, prepare_only=prepare_only, envvars=envvars,
                             secret_extravars=secret_extravars, verbosity=verbosity, keep_artifacts=keep_artifacts,
                             notes=notes)

    def play(cfg: RunConfig) -> OperationResult:
        return PlaybookRun(cfg, ansible_runner=ansible_runner, timing_sink=timing_sink, progress=progress,
                           cancel_event=cancel_event, progress_stream=progress_stream,
                           event_handler=event_handler, status_handler=status_handler).run()

    with _run_lock(config):
        with _workload_lock(config):
            result = play(config)
            if config.operation in eviction.RESTORE_OPERATIONS:
                # a success is remembered; a failure after eviction brings back what ran (rollback.py)
                def run_rollback(cfg: RunConfig) -> OperationResult:
                    with _run_lock(cfg):
                        return play(cfg)

                def say(line: str) -> None:
                    if watched:
                        print(f"coldsnap: {line}", file=stream, flush=True)

                result = rollback_mod.after_restore(
                    config, result, enabled=rollback, build=RunConfig.build, run=run_rollback, say=say,
                    cancelled=lambda: cancel_event is not None and cancel_event.is_set(),
                    release=release_runner(ansible_runner, progress_stream))
            elif config.operation == "stop" and result.succeeded:
                rollback_mod.forget(config.state_root, ((config.request or {}).get("workload") or {}).get("recipe"))
            return result


def release_runner(ansible_runner: Any, progress_stream: IO[str] | None = None) -> Callable[[RunConfig], OperationResult]:
    """What runs the release of a restore's unused hand-over (rollback.give_back): under its own run lock,
    after a cancel too (no cancel event: it only gives back what the cancelled run left, one short task a
    host), without live progress or the caller's timing sink."""
    def run(cfg: RunConfig) -> OperationResult:
        with _run_lock(cfg):
            return PlaybookRun(cfg, ansible_runner=ansible_runner, progress=False,
                               progress_stream=progress_stream).run()
    return run


@contextlib.contextmanager
def _run_lock(config: RunConfig):
    """The run directory of ``config``'s operation, created, locked for the run (one run per id) and checked
    for an orphaned playbook of an earlier run with this id."""
    try:
        StateLayout(config.state_root).ensure_private_root()
        run_dir = _private_dir(_private_dir(config.state_root / "runs") / config.operation_id)
    except OSError as exc:  # read-only, full, not ours: nothing ran yet
        raise ColdSnapError(f"state root {config.state_root} cannot be written ({exc.strerror or exc}"
                            f"{': ' + str(exc.filename) if exc.filename else ''})",
                            fix="pass --state-root a writable directory of this user's (or set COLDSNAP_STATE_ROOT)") \
            from None
    try:
        lock = file_lock(run_dir / ".lock", timeout=0)
        lock.__enter__()
    except TimeoutError:
        raise ColdSnapError(f"operation {config.operation_id} is already running (lock {run_dir / '.lock'})",
                            fix="wait for it to finish, or give this request a new id") from None
    try:
        _require_no_orphan(run_dir, config.operation_id)
        _drop_stale_partial_events(config.state_root / "runs", run_dir)
        yield run_dir
    finally:
        lock.__exit__(None, None, None)


# Operations that only read: they may run beside anything.
READ_ONLY_OPERATIONS = ("status", "native-status")


@contextlib.contextmanager
def _workload_lock(config: RunConfig):
    """One operation at a time per workload (recipe): two restores of one workload with different ids
    must not both evict it. Read-only operations and runs without a request take no lock."""
    recipe = ((config.request or {}).get("workload") or {}).get("recipe")
    if not recipe or config.operation in READ_ONLY_OPERATIONS:
        yield
        return
    path = StateLayout(config.state_root).workload_lock(recipe)
    _private_dir(path.parent)
    lock = file_lock(path, timeout=0)
    try:
        fd = lock.__enter__()
    except TimeoutError:
        holder = ""
        with contextlib.suppress(OSError):
            holder = path.read_text().strip()
        raise ColdSnapError(f"another operation of workload {recipe!r} is running ({holder or 'see ' + str(path)})",
                            fix="wait for it to finish; operations on one workload run one at a time") from None
    try:
        # The lock dies with its controller, its playbook does not: a controller killed with -9 leaves
        # ansible-playbook evicting or restoring this workload. The last holder's run must be over.
        last = os.pread(fd, 4096, 0).decode(errors="replace").split()
        if len(last) >= 2 and last[1] != config.operation_id and OPERATION_ID_RE.match(last[1]):
            _require_no_orphan(config.state_root / "runs" / last[1], last[1], workload=recipe)
        os.ftruncate(fd, 0)
        os.write(fd, f"{config.operation} {config.operation_id} pid {os.getpid()}\n".encode())
        yield
    finally:
        lock.__exit__(None, None, None)


def _require_no_orphan(run_dir: Path, operation_id: str, *, workload: str | None = None) -> None:
    """Refuse to start while the playbook of run ``run_dir`` still runs without its controller (killed with
    -9: its locks went with it, its ansible-playbook did not)."""
    pids = playbooks_in(run_dir / "project")
    if pids:
        of = f" of workload {workload!r}" if workload else ""
        raise ColdSnapError(
            f"operation {operation_id}{of} is still running: its controller ended, its playbook goes on "
            f"(pid {', '.join(map(str, pids[:8]))})",
            fix=f"wait for it to end (`coldsnap runs show {operation_id}`), or stop it (kill {pids[0]}), then run "
                "again")


def _prepare_run_dir(run_dir: Path, *, public_vars: Mapping[str, Any], caller_env: Mapping[str, str],
                     inventory: Mapping[str, Any] | str | Path | None,
                     request: Mapping[str, Any] | None) -> tuple[str, dict[str, str]]:
    """Write env/, inventory/ and project; return (inventory path, secret env for the runner kwarg)."""
    env_dir = _private_dir(run_dir / "env")
    for stale in ("cmdline", "passwords", "ssh_key"):  # we never use them; a stale one would change the run
        (env_dir / stale).unlink(missing_ok=True)
    _write_extravars(env_dir / "extravars", public_vars)
    _write_private_json(env_dir / "settings", RUNNER_SETTINGS)
    public_env = _base_envvars()
    if not shutil.which("ansible-playbook", path=public_env.get("PATH", os.environ.get("PATH"))):
        raise ColdSnapError("ansible-playbook is not on PATH",
                            fix="install ansible-core in the controller's environment (or activate it)")
    secret_env: dict[str, str] = {}
    for k, v in caller_env.items():
        (secret_env if is_secret_name(k) else public_env)[k] = v
    _write_private_json(env_dir / "envvars", public_env)

    inv_dir = _private_dir(run_dir / "inventory")
    for old in inv_dir.iterdir():
        if old.is_file() or old.is_symlink():
            old.unlink()
    if inventory is None or isinstance(inventory, Mapping):
        inv = dict(inventory) if inventory is not None else inventory_from_request(request or {})
        inv_path = inv_dir / "hosts.json"
        _write_private_json(inv_path, inv)
        inventory_arg = str(inv_path)
    else:
        inventory_arg = str(Path(inventory).resolve())

    project = run_dir / "project"
    target = collection_dir()
    if project.is_symlink() and Path(os.readlink(project)) != target:
        project.unlink()
    if not project.exists():
        project.symlink_to(target, target_is_directory=True)
    return inventory_arg, secret_env


class PlaybookRun:
    """One run of a :class:`RunConfig`: ansible-runner's handlers, cancellation and the receipt."""

    def __init__(self, config: RunConfig, *, ansible_runner: Any, timing_sink: TimingTarget = None,
                 progress: bool | None = None, cancel_event: threading.Event | None = None,
                 progress_stream: IO[str] | None = None, event_handler: EventHandler | None = None,
                 status_handler: StatusHandler | None = None) -> None:
        self.config = config
        self.user_event_handler = event_handler
        self.user_status_handler = status_handler
        self.user_handler_errors: list[str] = []
        self.collector: EventCollector | None = None
        self.ansible_runner = ansible_runner
        self.cancel_event = cancel_event
        self.run_dir = config.run_dir
        self.ident = _new_ident()
        self.artifact_dir = _private_dir(_private_dir(self.run_dir / "artifacts") / self.ident)
        stream = progress_stream if progress_stream is not None else sys.stderr
        if progress is None:
            progress = bool(getattr(stream, "isatty", lambda: False)())
        self.reporter = ProgressReporter(progress, stream=stream)
        self.timing = TimingStream(timing_sink, mirror=self.artifact_dir / "timing.ndjson")
        self.recorder = SpanRecorder("controller", sink=self.timing)
        self.cancelled_at: float | None = None
        self.terminated = 0
        self.starting: dict[str, Any] = {}
        self.runner_status = "unstarted"

    # ------------------------------------------------------------- handlers
    def _stop_tree(self) -> None:
        """Before ansible-runner kills ansible-playbook's group: its workers live in sessions of their
        own and would survive (see proctree)."""
        self.cancelled_at = time.monotonic()
        pid = find_child(str(self.run_dir))
        self.terminated = terminate_tree(pid) if pid else 0

    def cancel_callback(self) -> bool:
        if self.cancel_event is not None and self.cancel_event.is_set():
            if self.cancelled_at is None:
                self.reporter.note("cancel requested: stopping ansible-playbook and the tasks it runs")
                self._stop_tree()
            return True
        return False

    def _call_user(self, handler: Callable[..., Any] | None, *args: Any, **kwargs: Any) -> None:
        if handler is None:
            return
        try:
            handler(*args, **kwargs)
        except Exception as exc:  # the caller's bug must not break the run or lose its receipt
            name = getattr(handler, "__qualname__", type(handler).__name__)
            self.user_handler_errors.append(self.config.redactor.text(f"{name}: {type(exc).__name__}: {exc}"))

    def event_handler(self, event: dict) -> bool:
        assert self.collector is not None
        self.collector(event)  # scrubs the event in place first
        self._call_user(self.user_event_handler, event)
        return True

    def status_handler(self, data: dict, runner_config: Any = None) -> None:
        self._own_status(data)
        if self.user_status_handler is not None:
            shown = {**data, **self.starting} if data.get("status") == "starting" else data
            self._call_user(self.user_status_handler, shown, runner_config=runner_config)

    def _own_status(self, data: dict) -> None:
        status = str(data.get("status"))
        self.runner_status = status
        redactor = self.config.redactor
        if status == "starting":
            # The payload holds the whole environment: keep only a redacted copy.
            self.starting.update({"command": redactor.scrub(list(data.get("command") or [])),
                                  "cwd": data.get("cwd"),
                                  "env": redactor.scrub(redact_env(dict(data.get("env") or {})))})
        elif status == "running" and self.starting:
            # ansible-runner wrote the full environment to artifacts/<ident>/command just before
            # this status; replace it before ansible-playbook is even spawned.
            _write_private_json(self.artifact_dir / "command", self.starting)

    # ------------------------------------------------------------------ run
    def run(self) -> OperationResult:
        cfg, reporter, recorder = self.config, self.reporter, self.recorder
        run_dir, artifact_dir, redactor = self.run_dir, self.artifact_dir, cfg.redactor
        inventory_arg, secret_env = cfg.write_private_data_dir()
        started_at = dt.datetime.now(dt.UTC)
        t0 = time.monotonic()
        op_span = recorder.start_span(f"coldsnap.{cfg.operation}", operation=cfg.operation,
                                      operation_id=cfg.operation_id, prepare_only=cfg.prepare_only,
                                      playbook=cfg.playbook_path.name)
        reporter.header(f"coldsnap {cfg.operation}{' --prepare-only' if cfg.prepare_only else ''} "
                        f"{cfg.operation_id}: {cfg.playbook_path.name} (run dir {run_dir})")
        # Until this run ends, its receipt says it is running: a controller killed mid-run never
        # leaves the previous run's outcome standing in for this one.
        write_receipt(run_dir / "receipt.json", build_receipt(
            operation_id=cfg.operation_id, operation=cfg.operation, prepare_only=cfg.prepare_only, succeeded=False,
            request=cfg.request, started_at=started_at, completed_at=None, duration_seconds=0.0, timing={},
            result={"runner": {"ident": self.ident, "pid": os.getpid(), "status": "running"}}, error=None,
            running=True), mode=0o600)
        secrets_file = _Secrets(run_dir / "secrets", cfg.secret_vars)
        stdout_log = open(artifact_dir / "stdout", "w", encoding="utf-8")
        os.chmod(artifact_dir / "stdout", 0o600)
        collector = self.collector = EventCollector(
            recorder, parent_span_id=op_span["span_id"], redactor=redactor, progress=reporter,
            stdout_log=stdout_log, on_playbook_start=secrets_file.delete)
        controller_error: str | None = None
        rc: int | None = None
        interrupted = False
        try:
            r = self.ansible_runner.run(
                private_data_dir=str(run_dir), ident=self.ident, playbook=str(cfg.playbook_path),
                inventory=inventory_arg, cmdline=secrets_file.cmdline, envvars=secret_env or None,
                settings=dict(RUNNER_SETTINGS), suppress_env_files=True, quiet=True, fact_cache_type="memory",
                rotate_artifacts=cfg.keep_artifacts, verbosity=cfg.verbosity or None, event_handler=self.event_handler,
                status_handler=self.status_handler, cancel_callback=self.cancel_callback)
            rc = r.rc
            self.runner_status = r.status
        except KeyboardInterrupt:
            # An API caller without a cancel_event got SIGINT: stop the tree, write the receipt, re-raise below.
            interrupted = True
            self._stop_tree()
        except Exception as exc:  # the runner itself broke: still write a failed receipt
            controller_error = redactor.text(f"{type(exc).__name__}: {exc}")
        finally:
            secrets_file.delete()
            stdout_log.close()
            _scrub_partial_events(artifact_dir / "job_events", redactor)
            if self.starting:
                # Belt and braces: the command artifact must hold the redacted environment only.
                with contextlib.suppress(OSError):
                    _write_private_json(artifact_dir / "command", self.starting)

        cancelled = self.cancelled_at is not None or self.runner_status == "canceled"
        in_flight = collector.close_open_tasks("cancelled" if cancelled else "incomplete")
        succeeded = (controller_error is None and not cancelled and self.runner_status == "successful"
                     and rc == 0)
        error = None if succeeded else _error(
            collector, cancelled=cancelled, in_flight=in_flight, controller_error=controller_error,
            runner_status=self.runner_status, rc=rc)
        recorder.end_span(op_span, status="ok" if succeeded else ("cancelled" if cancelled else "failed"),
                          runner_status=self.runner_status, rc=rc)
        completed_at = dt.datetime.now(dt.UTC)
        duration = time.monotonic() - t0
        envelope = recorder.finish(cfg.operation_id)  # the stream's last event
        self.timing.close()

        result = _result(collector, playbook_path=cfg.playbook_path, ident=self.ident,
                         runner_status=self.runner_status, rc=rc, cancelled=cancelled, in_flight=in_flight,
                         warnings=self.timing.problems + self.user_handler_errors)
        if cfg.operation in eviction.RESTORE_OPERATIONS:  # what became of the workload that ran before
            result["eviction"] = eviction_record(
                collector.evictions, succeeded=succeeded, in_flight=in_flight,
                detached=not cancelled or _activation_in_background(cfg.public_vars, cfg.request))
            if error is not None:
                error["message"] = with_eviction(error["message"], result["eviction"])
        if cancelled:
            result["runner"]["terminated_processes"] = self.terminated
        result.update(cfg.notes or {})
        receipt = build_receipt(operation_id=cfg.operation_id, operation=cfg.operation, prepare_only=cfg.prepare_only,
                                succeeded=succeeded, request=cfg.request, started_at=started_at,
                                completed_at=completed_at, duration_seconds=duration, timing=envelope,
                                result=redactor.scrub(result), error=redactor.scrub(error))
        write_receipt(artifact_dir / "receipt.json", receipt, mode=0o600)
        receipt_path = write_receipt(run_dir / "receipt.json", receipt, mode=0o600)
        reporter.header(f"coldsnap {cfg.operation} {cfg.operation_id}: {receipt['state']}"
                        f"{' (cancelled)' if cancelled else ''} in {duration:.1f}s")
        if interrupted:
            raise KeyboardInterrupt
        return OperationResult(operation_id=cfg.operation_id, operation=cfg.operation, succeeded=succeeded,
                               cancelled=cancelled, receipt=receipt, receipt_path=receipt_path, run_dir=run_dir,
                               artifact_dir=artifact_dir, runner_status=self.runner_status, rc=rc)


def _drop_stale_partial_events(runs: Path, this_run: Path) -> None:
    """Delete the ``*-partial.json`` event files of runs no controller holds (this one's, before it starts,
    included). The display callback writes each event there before the controller scrubs it; a controller
    killed with -9 never scrubs them, and a later one does not know that run's secrets: unprocessed, they
    only ever hold what the scrubbed events already say."""
    with contextlib.suppress(OSError):
        for run in runs.iterdir():
            if run != this_run and lock_held(run / ".lock"):
                continue  # running: its controller scrubs its own
            for ident in (run / "artifacts").glob("*"):
                if (ident / "rc").exists():
                    continue  # ansible-runner finished it and its controller scrubbed it: no event listing
                for partial in ident.glob("job_events/*-partial.json"):
                    with contextlib.suppress(OSError):
                        partial.unlink()


def _scrub_partial_events(job_events: Path, redactor: Redactor) -> None:
    """Scrub event files the display callback left unprocessed (a killed run leaves ``*-partial.json``)."""
    if not redactor or not job_events.is_dir():
        return
    for partial in job_events.glob("*-partial.json"):
        try:
            text = partial.read_text(encoding="utf-8", errors="replace")
            try:
                cleaned = json.dumps(redactor.scrub(json.loads(text)))
            except ValueError:
                cleaned = redactor.text(text)
            atomic_write_bytes(partial, cleaned.encode(), mode=0o600)
        except OSError:
            partial.unlink(missing_ok=True)  # cannot clean it: do not keep it


def _playbook_label(path: Path) -> str:
    try:
        return str(path.relative_to(collection_dir()))
    except ValueError:
        return str(path)


def _result(collector: EventCollector, *, playbook_path: Path, ident: str, runner_status: str, rc: int | None,
            cancelled: bool, in_flight: list[dict], warnings: list[str]) -> dict:
    from coldsnap.runner.contract import STATS_RESULT_KEY

    result: dict[str, Any] = {
        "playbook": _playbook_label(playbook_path),
        "runner": {"ident": ident, "status": runner_status, "rc": rc, "cancelled": cancelled},
        "tasks": collector.sorted_tasks(),
        "stats": collector.stats,
        "unreachable_hosts": list(collector.unreachable_hosts),
        "failed_hosts": collector.failed_hosts(),
        "custom_stats": collector.custom_stats,
        "operation": collector.custom_stats.get(STATS_RESULT_KEY),
    }
    if in_flight:
        result["in_flight"] = in_flight
    problems = collector.timing_problems + warnings + collector.handler_errors
    if problems:
        result["controller_warnings"] = problems[:50]
    return result


def _may_evict(play: str | None) -> bool:
    """A play of a restore that may evict (the collection's plays say so in their names; one that says
    "nothing is evicted" does not)."""
    name = (play or "").lower()
    return "evict" in name and "nothing is evicted" not in name


# The steps of a restore's evict-and-activate play that bring back what its evict step stopped (the step
# itself, its async launch, and the wait for that job).
_ACTIVATION_ACTIONS = ("unit_restore", "job_wait")


def _live_progress(value: Any) -> bool:
    """Whether the long steps ran as async jobs (``coldsnap_live_progress``, as Ansible's ``bool`` reads it)."""
    return value is True or str(value).strip().lower() in ("1", "true", "yes", "on", "y", "t")


def _activation_in_background(public_vars: Mapping[str, Any], request: Mapping[str, Any] | None) -> bool:
    """Whether a restore's activation ran as an async job: with live progress, and always for units on more
    than one host (the role coldsnap_restore runs theirs in the background whatever the forks)."""
    if _live_progress(public_vars.get(EXTRAVAR_LIVE_PROGRESS)):
        return True
    return bool(request) and "launch" in request and len(unit_hosts(request)) > 1


def eviction_record(evictions: Mapping[str, Any], *, succeeded: bool, in_flight: list[dict],
                    detached: bool) -> dict:
    """``result.eviction`` of a restore's run; ``in_flight``: the tasks it was cut off in. Cut off while a
    host activated what its evict step stopped, with that activation out of the controller's reach
    (``detached``: an async job, which outlives ansible-playbook until it ends or nobody has waited for it
    for its lease; or the step of a playbook killed from outside, whose module runs on), the workload there
    is not known to be gone: the activation may still bring it back. That is ``unknown`` (the hosts in
    ``activation_cut_off``), never ``evicted``, and no rollback races the activation."""
    record = eviction.receipt_record(evictions, succeeded=succeeded,
                                     interrupted=any(_may_evict(t.get("play")) for t in in_flight))
    activating = {t.get("host") for t in in_flight if detached and _may_evict(t.get("play"))
                  and str(t.get("action") or "").rsplit(".", 1)[-1] in _ACTIVATION_ACTIONS}
    hosts = sorted({u["host"] for u in record["units"] if not u["restored"] and u["host"] in activating})
    if record["previous_workload"] == eviction.EVICTED and hosts:
        record = {**record, "previous_workload": eviction.UNKNOWN, "activation_cut_off": hosts}
    return record


def with_eviction(message: str, record: Mapping[str, Any]) -> str:
    """A restore's error message saying, once, what became of the workload that ran before (``record``:
    ``result.eviction``): evicted and not running (naming it, and how to serve again), untouched, or not
    known."""
    state = record.get("previous_workload")
    if state == eviction.EVICTED:
        return eviction.after_eviction(message, [u for u in record.get("units") or [] if not u.get("restored")])
    if state == eviction.UNTOUCHED:
        return eviction.before_eviction(message)
    if state == eviction.UNKNOWN and record.get("activation_cut_off"):
        hosts = list(record["activation_cut_off"])
        stopped = eviction.describe([u for u in record.get("units") or [] if u.get("host") in hosts])
        return (f"restore cut off after eviction: it evicted the workload that ran before ({stopped}) and was "
                f"stopped while it activated the restored units on {', '.join(hosts)}; that activation goes on "
                f"without the controller until it ends (as a background job nobody waits for, it stops itself "
                f"within {DEFAULT_LEASE_S:.0f} s) and may bring them back, so what runs there is not known: `coldsnap "
                "status` shows it; if the workload does not serve once the activation has ended (until then a "
                f"restore is refused, naming it), restore again (the same request). The cause: {message}")
    if state == eviction.UNKNOWN and "coldsnap status" not in message:
        return (f"{message} (the restore may have evicted the workload that ran before: `coldsnap status` shows "
                "what runs)")
    return message


def _error(collector: EventCollector, *, cancelled: bool, in_flight: list[dict], controller_error: str | None,
           runner_status: str, rc: int | None) -> dict:
    if controller_error is not None:
        return {"message": f"the controller could not run the playbook: {controller_error}",
                "host": None, "task": None, "phase": "controller"}
    if cancelled:
        current = in_flight[0] if in_flight else None
        if current is None and collector.last_started is not None:
            last = collector.last_started
            current = {"host": last.host, "task": last.task, "play": last.play}
        hosts = sorted({t["host"] for t in in_flight})
        where = (f" while task {current['task']!r} was running on {', '.join(hosts) or current['host']}"
                 if current else " before any task started")
        return {"message": f"operation cancelled{where}; ansible-playbook was stopped",
                "host": current["host"] if current else None, "task": current["task"] if current else None,
                "phase": current.get("play") if current else None}
    failure = collector.fatal_failure()
    if failure is not None:
        if failure["status"] == "unreachable":
            hosts = collector.unreachable_hosts or [failure["host"]]
            message = (f"host{'s' if len(hosts) > 1 else ''} {', '.join(hosts)} unreachable "
                       f"(task {failure['task']!r}): {failure['msg'] or 'no message'}")
        else:
            message = f"task {failure['task']!r} failed on {failure['host']}: {failure['msg'] or 'no message'}"
        return {"message": message, "host": failure["host"], "task": failure["task"], "phase": failure["play"]}
    tail = [line for line in collector.verbose_tail if line.strip()]
    errors = [line for line in tail if "ERROR" in line or "error" in line.lower()]
    detail = " / ".join((errors or tail)[-6:]) or "no task failed and no error output was seen"
    ended = (f"ended with status {runner_status} (rc {rc})" if rc is not None
             else f"ended with status {runner_status} and no exit status (killed by a signal)")
    if in_flight:
        # Killed from outside (kill -9, the OOM killer) mid-task: the task it was in is what the user must
        # check (a restore's prepare evicts nothing, its activation may have).
        current = in_flight[0]
        hosts = ", ".join(sorted({t["host"] for t in in_flight}))
        return {"message": f"ansible-playbook {ended} while task {current['task']!r} was running on {hosts}: "
                           f"that task did not finish; see the run's receipt and `coldsnap status` for what runs "
                           f"now, then run the operation again{f' ({detail})' if tail else ''}"[:4000],
                "host": current["host"], "task": current["task"], "phase": current.get("play")}
    return {"message": f"ansible-playbook {ended}: {detail}"[:4000],
            "host": None, "task": None, "phase": "playbook"}
