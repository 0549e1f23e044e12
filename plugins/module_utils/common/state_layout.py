"""The one place that knows the layout of ColdSnap's state root on a host.

::

    <state root>/                          0700, owned by the user ColdSnap runs as
        model-payloads/sha256/<hex>.pack   node cache (+ .coldsnap-validation.json records)
        model-payloads/incoming/           payloads arriving from another host
        activation-runtime/sha256/<hex>/   staged activation runtimes (content-addressed)
        activation-runtime/incoming/       the runtime's files as copied, before staging
        activation-runtime/bytecode/       its compiled modules (PYTHONPYCACHEPREFIX; sources untouched)
        captures/<capture id>/units/<unit>/   a unit's captured state
        capsules/oci/                      OCI-layout capsules (runtime host)
        capsules/extracted/<hex>/          capsule state extracted for a restore
        workloads/<recipe>/<unit>/         the running workload: target.log, control files
        runs/<operation id>/               ansible-runner private data dir, unit specs, receipt
        artifacts/                         committed descriptors (the artifact store)
        locks/                             per-workload and per-artifact operation locks, hosts' workload claims
        serving/<recipe>.json              the controller's record of the restore a workload runs from (rollback)

Modules, the controller, the activation runtime and (through the
``coldsnap.fleet`` filters) the playbooks all derive paths here.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import (
    make_private_dirs,
    planted_by_another,
)

DEFAULT_STATE_ROOT = "/var/lib/coldsnap"
STATE_ROOT_ENV = "COLDSNAP_STATE_ROOT"
# The argument spec entry every module that touches the state root declares.
STATE_ROOT_ARG = {"type": "path", "default": DEFAULT_STATE_ROOT}

PAYLOADS = "model-payloads"
ACTIVATION_RUNTIME = "activation-runtime"
CAPTURES = "captures"
CAPSULES = "capsules"
WORKLOADS = "workloads"
RUNS = "runs"
ARTIFACTS = "artifacts"
LOCKS = "locks"
# What a state root holds at its top (a directory with none of these is not one).
STATE_ROOT_ENTRIES = frozenset({PAYLOADS, ACTIVATION_RUNTIME, CAPTURES, CAPSULES, WORKLOADS, RUNS, ARTIFACTS, LOCKS,
                                "serving", "models", "downloads", "quarantine"})


def state_root_from_env() -> Path | None:
    """``$COLDSNAP_STATE_ROOT`` (``~`` expanded), None when it is unset.

    Set but empty is refused: an exported shell variable that was never given a value must not mean the
    default state root, which holds production state (as an empty ``--state-root`` is refused)."""
    env = os.environ.get(STATE_ROOT_ENV)
    if env is None:
        return None
    if not env.strip():
        raise ColdSnapError(f"{STATE_ROOT_ENV} is set but empty",
                            fix=f"set it to the state directory, or unset it ('unset {STATE_ROOT_ENV}') for "
                                f"{user_state_root()}")
    return Path(env).expanduser()


def default_state_root() -> Path:
    """``$COLDSNAP_STATE_ROOT``, else ``/var/lib/coldsnap`` for root, else ``$XDG_STATE_HOME/coldsnap``
    (``~/.local/state/coldsnap``). An empty ``$COLDSNAP_STATE_ROOT`` is refused (ColdSnapError)."""
    env = state_root_from_env()
    if env is not None:
        return env
    return user_state_root()


def user_state_root() -> Path:
    """The state root without ``$COLDSNAP_STATE_ROOT``: ``/var/lib/coldsnap`` for root, else
    ``$XDG_STATE_HOME/coldsnap`` (``~/.local/state/coldsnap``)."""
    if os.geteuid() == 0:
        return Path(DEFAULT_STATE_ROOT)
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "state"
    return base / "coldsnap"


@dataclass(frozen=True)
class StateLayout:
    """Paths below one state root."""

    root: Path

    def __init__(self, root: Path | str) -> None:
        if not str(root).strip() or not os.path.isabs(root):
            # Path("") is ".": an unset variable in module_defaults would make the module's working directory
            # (the remote user's home over SSH) the state root, and a relative path would be taken from there.
            raise ColdSnapError(f"state_root {str(root)!r} is not an absolute path",
                                fix=f"give state_root (or --state-root) an absolute path such as "
                                    f"{DEFAULT_STATE_ROOT}, the same on every host of a workload")
        object.__setattr__(self, "root", Path(root))

    # ------------------------------------------------------------ payloads
    @property
    def payloads(self) -> Path:
        return self.root / PAYLOADS

    @property
    def payload_objects(self) -> Path:
        return self.payloads / "sha256"

    @property
    def payload_incoming(self) -> Path:
        return self.payloads / "incoming"

    # ------------------------------------------------------ runtime staging
    @property
    def activation_runtimes(self) -> Path:
        return self.root / ACTIVATION_RUNTIME / "sha256"

    def activation_runtime(self, hex_digest: str) -> Path:
        return self.activation_runtimes / hex_digest

    @property
    def activation_bytecode(self) -> Path:
        """Compiled modules of the activation runtime and the collection code it imports (Python's
        ``PYTHONPYCACHEPREFIX``): written by the first start, read by every later one, so a restore
        does not compile ~100 modules before it can begin; the staged sources stay as staged."""
        return self.root / ACTIVATION_RUNTIME / "bytecode"

    @property
    def activation_incoming(self) -> Path:
        """Where the activation runtime's files land before they are staged by digest."""
        return self.root / ACTIVATION_RUNTIME / "incoming"

    # ------------------------------------------------------------ captures
    @property
    def captures(self) -> Path:
        return self.root / CAPTURES

    def capture(self, capture_id: str) -> Path:
        return self.captures / capture_id

    def capture_unit(self, capture_id: str, unit_id: str) -> Path:
        return self.capture(capture_id) / "units" / unit_id

    # ------------------------------------------------------------ capsules
    @property
    def capsules_oci(self) -> Path:
        return self.root / CAPSULES / "oci"

    @property
    def capsules_extracted(self) -> Path:
        return self.root / CAPSULES / "extracted"

    def extracted_capsule(self, image_id: str) -> Path:
        """Where a capsule's state is extracted: keyed by the capsule's image digest."""
        return self.capsules_extracted / image_id.split(":", 1)[-1]

    # ----------------------------------------------------------- workloads
    @property
    def workloads(self) -> Path:
        return self.root / WORKLOADS

    def workload(self, recipe: str, unit_id: str) -> Path:
        return self.workloads / recipe / unit_id

    # ---------------------------------------------------------------- runs
    @property
    def runs(self) -> Path:
        return self.root / RUNS

    def run(self, operation_id: str) -> Path:
        return self.runs / operation_id

    def unit_runs(self, operation_id: str) -> Path:
        """Spec, evidence and log files of an operation's units (bound into rank containers)."""
        return self.run(operation_id) / "units"

    # ----------------------------------------------------------- artifacts
    @property
    def artifacts(self) -> Path:
        return self.root / ARTIFACTS

    @property
    def locks(self) -> Path:
        return self.root / LOCKS

    def workload_lock(self, recipe: str) -> Path:
        """The lock every operation on workload ``recipe`` holds (one at a time per state root)."""
        return self.locks / f"workload-{recipe}.lock"

    def serving(self, recipe: str) -> Path:
        """The controller's record of the last successful restore of workload ``recipe`` (what a failed
        restore rolls back to)."""
        return self.root / "serving" / f"{recipe}.json"

    def host_claim(self, recipe: str, machine: str) -> Path:
        """The claim a step that changes workload ``recipe`` on this machine holds (``units/claim.py``): one
        operation at a time per machine (``machine``: its identity), whichever controller started it."""
        name = machine if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", machine) else \
            "m-" + hashlib.sha256(machine.encode()).hexdigest()[:32]
        return self.locks / f"host-workload-{recipe}@{name}.claim"

    # ---------------------------------------------------------- privacy
    def ensure_private_root(self) -> Path:
        """Create the state root 0700 (and make an existing one 0700): everything below is private
        to the user ColdSnap runs as (CRIU images, capsules and descriptors hold process memory)."""
        self.refuse_planted()  # before anything is created in another user's directory
        # Every directory it creates above the root is 0700 too: mkdir(parents=True) gives those the umask's
        # mode (0777 under umask 000), and another user could then swap the root for a link of theirs.
        make_private_dirs(self.root)
        self.root.mkdir(exist_ok=True, mode=0o700)  # a file under the root's name: FileExistsError, as before
        self.refuse_planted()
        st = os.stat(self.root)
        if st.st_mode & 0o077 and st.st_uid == os.geteuid():
            self._refuse_foreign_directory(st.st_mode)
            os.chmod(self.root, 0o700)
        return self.root

    def _refuse_foreign_directory(self, mode: int) -> None:
        """A directory open to others that is not a state root (``/tmp``, ``/srv``, a home directory given by
        mistake) is not made private for them: ColdSnapError. Empty, or holding ColdSnap's own entries, it is."""
        shown = f"{stat.S_IMODE(mode):04o}"
        if mode & (stat.S_ISVTX | stat.S_IWOTH):
            raise ColdSnapError(f"state root {self.root} is a directory anyone may write to (mode {shown}), shared "
                                "with other users: ColdSnap would make it private (0700) and close it to them",
                                fix="give --state-root (or state_root) a directory of its own, e.g. a new "
                                    f"{self.root / 'coldsnap'}")
        entries = os.listdir(self.root)
        if entries and not set(entries) & STATE_ROOT_ENTRIES:
            listed = ", ".join(sorted(entries)[:5]) + (" ..." if len(entries) > 5 else "")
            raise ColdSnapError(f"state root {self.root} holds other files ({listed}) and none of ColdSnap's, and "
                                f"others may read it (mode {shown}): ColdSnap would make it private (0700)",
                                fix="give --state-root (or state_root) a directory of its own (a new one is made "
                                    "0700), or make this one 0700 yourself if it is meant to be one")

    def refuse_planted(self) -> None:
        """A component of the state root's path (a link or a directory, of the path as given or as resolved,
        the root itself or any directory above it) that another user made in a directory anyone may write
        to (``/tmp``, ``/var/tmp``) is theirs to redirect: ColdSnap would write and chmod through their
        links and trust their files. Refused; a root owned by another user elsewhere (a user's own state
        root that root works in for them) is fine."""
        planted = planted_by_another(self.root)
        if planted is not None:
            cur, parent, uid = planted
            raise ColdSnapError(
                f"state root {self.root}: {cur} belongs to uid {uid}, not to this user (uid {os.geteuid()}), "
                f"and lies in {parent}, which anyone may write to: another user could redirect ColdSnap's "
                "files through it",
                fix="use a state root this user owns outside world-writable directories (the default), or "
                    "remove that one")

    def path(self, name: str, *parts: str) -> Path:
        """A named location (``payloads``, ``payload_objects``, ``captures``, ``workloads`` ...) with
        optional parts below it; used by the playbooks through the ``state_path`` filter."""
        base = getattr(self, name, None)
        if not isinstance(base, Path) or name.startswith("_"):
            raise ValueError(f"unknown state location {name!r}")
        for part in parts:
            if not part or part.startswith("/") or ".." in part.split("/"):
                raise ValueError(f"{part!r} is not a name below the state location {name!r} (no '..', no absolute "
                                 "path)")
        return base.joinpath(*parts) if parts else base
