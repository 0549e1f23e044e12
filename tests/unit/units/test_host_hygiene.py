"""Host-side rules that keep a restore honest: who may hold a captured port, what a killed run
leaves behind, and the staged activation runtime's integrity."""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    AdmissionError,
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import ports
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import activation_stage, housekeeping

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def held_port():
    """A listener held by a child process (so its pid is not ours)."""
    proc = subprocess.Popen([sys.executable, "-c", (
        "import socket,sys,time; s=socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
        "print(s.getsockname()[1], flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    yield proc, port
    proc.kill()
    proc.wait()


def test_a_port_held_by_the_replaced_workload_is_fine_and_a_strangers_is_not(held_port):
    proc, port = held_port
    assert ports.port_holders(port) == {proc.pid}
    ports.require_ports_free([("127.0.0.1", port)], unit="u", replaced=ports.process_tree(proc.pid))
    with pytest.raises(AdmissionError) as exc:
        ports.require_ports_free([("127.0.0.1", port)], unit="u", replaced={os.getpid()})
    assert f"pid {proc.pid}" in str(exc.value) and f"127.0.0.1:{port}" in str(exc.value)


def test_process_tree_holds_the_root_and_its_descendants():
    child = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 5
        while len(ports.process_tree(child.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        tree = ports.process_tree(child.pid)
        assert child.pid in tree and len(tree) == 2
    finally:
        child.kill()
        child.wait()


def test_leftovers_of_killed_runs_are_removed_and_live_ones_kept(tmp_path):
    root = tmp_path / "state"
    extracted = root / "capsules" / "extracted"
    extracted.mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = extracted / f".{'a' * 64}.tmp-{dead.pid}"
    stale.mkdir()
    live = extracted / f".{'b' * 64}.tmp-{os.getpid()}"
    live.mkdir()
    incoming = root / "model-payloads" / "incoming"
    incoming.mkdir(parents=True)
    old, fresh = incoming / f"{'c' * 64}.pack", incoming / f"{'d' * 64}.pack"
    old.write_bytes(b"x")
    fresh.write_bytes(b"y")
    os.utime(old, (time.time() - 2 * housekeeping.INCOMING_MAX_AGE_S,) * 2)
    # a peer pull's partial bytes are kept for the next run to resume, unless abandoned for a week
    downloads = root / "model-payloads" / "downloads"
    downloads.mkdir()
    abandoned, resumable = downloads / f"{'e' * 64}.peer-partial", downloads / f"{'f' * 64}.peer-partial"
    abandoned.write_bytes(b"x")
    resumable.write_bytes(b"y")
    os.utime(resumable, (time.time() - 2 * housekeeping.INCOMING_MAX_AGE_S,) * 2)
    os.utime(abandoned, (time.time() - 2 * housekeeping.PEER_PARTIAL_MAX_AGE_S,) * 2)
    # a unit's state extracted in prepare, and the derived caches extracted with it, one level further down
    units = root / "captures" / "cap-1" / "units"
    units.mkdir(parents=True)
    (units / "unit-0").mkdir()
    half_state, half_caches = units / f".unit-0.tmp-{dead.pid}", units / f".unit-0.caches-{dead.pid}"
    half_state.mkdir()
    (half_caches / "root").mkdir(parents=True, mode=0o500)
    running = units / f".unit-1.caches-{os.getpid()}"
    running.mkdir()
    would = sorted(housekeeping.clean_stale_temps(root, check_mode=True))
    assert would == sorted([str(stale), str(old), str(abandoned), str(half_state), str(half_caches)])
    assert stale.exists()
    housekeeping.clean_stale_temps(root)
    assert not stale.exists() and not old.exists() and live.exists() and fresh.exists()
    assert not abandoned.exists() and resumable.exists()
    assert sorted(os.listdir(units)) == [running.name, "unit-0"]


def test_a_staged_runtime_with_planted_bytecode_is_refused_and_restaged(tmp_path):
    src = REPO / "runtime_image" / "activation"
    digest, path, changed = activation_stage.stage(src, tmp_path / "state")
    assert changed and not activation_stage.bytecode_in(path)
    assert oct(os.stat(tmp_path / "state").st_mode & 0o777) == "0o700"
    cache = path / "coldsnap_activation" / "__pycache__"
    cache.mkdir()
    (cache / "sequence.cpython-311.pyc").write_bytes(b"evil")
    with pytest.raises(IntegrityError, match="bytecode"):
        activation_stage.require_staged(tmp_path / "state", digest)
    again_digest, again_path, again_changed = activation_stage.stage(src, tmp_path / "state")
    assert again_changed and again_digest == digest and not activation_stage.bytecode_in(again_path)
    assert activation_stage.require_staged(tmp_path / "state", digest) == again_path


def test_the_runtime_staged_from_its_file_map_is_the_runtime_staged_from_its_directory(tmp_path):
    """What the control node reads (file_map) stages, on a host, the very tree the digest names; a map
    that differs from the digest, or names a file outside the runtime, stages nothing."""
    src = REPO / "runtime_image" / "activation"
    digest = activation_stage.tree_digest(src)
    files = activation_stage.file_map(src)
    assert "coldsnap_activation/__main__.py" in files and not any("__pycache__" in k for k in files)
    root = tmp_path / "state"

    tampered = dict(files)
    entry = tampered["coldsnap_activation/sequence.py"]
    data = bytearray(base64.b64decode(entry["content"]))
    data[100] ^= 1  # one bit of one file
    tampered["coldsnap_activation/sequence.py"] = {**entry, "content": base64.b64encode(bytes(data)).decode()}
    with pytest.raises(IntegrityError, match="expected " + digest):
        activation_stage.stage_files(tampered, root, digest)
    assert not activation_stage.staged_path(root, digest).exists()
    for bad in ("../escape.py", "/etc/cron.d/x", "coldsnap_activation/../../x.py", "coldsnap_activation/.hidden",
                "coldsnap_activation/__pycache__/sequence.cpython-311.pyc", ""):
        with pytest.raises(ColdSnapError, match="relative path"):
            activation_stage.stage_files({**files, bad: files["coldsnap_activation/__init__.py"]}, root, digest)
    with pytest.raises(ColdSnapError, match="base64"):
        activation_stage.stage_files({**files, "coldsnap_activation/__init__.py": {"content": "not base64!"}},
                                     root, digest)
    assert not activation_stage.staged_path(root, digest).exists()
    # checked in memory first: a refused map creates nothing at all
    assert not activation_stage.staged_path(root, digest).parent.exists()

    got, path, changed = activation_stage.stage_files(files, root, digest)
    assert (got, changed) == (digest, True)
    assert activation_stage.require_staged(root, digest) == path
    assert os.access(path / "coldsnap_activation" / "__main__.py", os.R_OK)
    assert activation_stage.stage_files(files, root, digest)[2] is False  # idempotent
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary left


def test_ports_free_refuses_a_live_listener_even_without_a_workload():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        with pytest.raises(AdmissionError, match="taken"):
            ports.require_ports_free([("127.0.0.1", s.getsockname()[1])], unit="u")
    finally:
        s.close()


def test_the_activation_bytecode_directory_is_private_and_never_written_through_a_link(tmp_path):
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import UnitError
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import StateLayout
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units.host_units import bytecode_dir

    layout = StateLayout(tmp_path / "state")
    made = bytecode_dir(layout)
    assert made == layout.activation_bytecode and made.is_dir()
    assert made.stat().st_mode & 0o777 == 0o700
    assert bytecode_dir(layout) == made  # a second start finds it
    made.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    made.symlink_to(elsewhere)
    with pytest.raises(UnitError) as err:
        bytecode_dir(layout)
    assert str(made) in str(err.value) and "remove" in err.value.fix
    made.unlink()
    made.write_text("not a directory")
    with pytest.raises(UnitError):
        bytecode_dir(layout)


def test_a_state_root_another_user_planted_in_a_shared_directory_is_refused(tmp_path):
    """/tmp and /var/tmp are anyone's: a state root (or a link to one) another user made there would let
    them redirect root's writes; ColdSnap refuses it, and a user's own root elsewhere is fine."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import StateLayout

    if os.geteuid() != 0:
        pytest.skip("making a directory owned by another user needs root")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o755)
    planted = shared / "coldsnap"
    planted.mkdir()
    os.chown(planted, 65534, 65534)
    with pytest.raises(ColdSnapError, match=r"belongs to uid 65534.*anyone may write to"):
        StateLayout(planted).ensure_private_root()
    link = shared / "coldsnap-link"
    link.symlink_to(victim)
    os.lchown(link, 65534, 65534)
    with pytest.raises(ColdSnapError, match="belongs to uid 65534"):
        StateLayout(link).ensure_private_root()
    assert oct(victim.stat().st_mode & 0o777) == "0o755", "nothing was chmodded through the link"
    # one level down: a directory of theirs in the shared one, holding a link to the victim or a new root
    theirs = shared / "theirs"
    theirs.mkdir()
    (theirs / "sr").symlink_to(victim)
    os.chown(theirs, 65534, 65534)
    for root in (theirs / "sr", theirs / "new" / "root"):
        with pytest.raises(ColdSnapError, match=r"theirs belongs to uid 65534.*anyone may write to"):
            StateLayout(root).ensure_private_root()
    assert not (theirs / "new").exists() and oct(victim.stat().st_mode & 0o777) == "0o755"
    mine = shared / "mine"
    assert StateLayout(mine).ensure_private_root() == mine and oct(mine.stat().st_mode & 0o777) == "0o700"
    assert StateLayout(mine / "below").ensure_private_root() == mine / "below"
    users_own = tmp_path / "home-of-a-user" / "coldsnap"  # not in a shared directory: root may work in it
    users_own.mkdir(parents=True)
    os.chown(users_own, 65534, 65534)
    assert StateLayout(users_own).ensure_private_root() == users_own


def test_an_engine_never_compiles_into_a_cache_directory_another_user_made(tmp_path):
    """TorchInductor writes the code it compiles to ``<tmp>/torchinductor_<user>`` and loads it from there:
    a directory another user made first in a shared /tmp (or a link there) would let them run code as
    root. The launcher makes it this user's own 0700 directory, or refuses naming it."""
    import pwd

    sys.path.insert(0, str(REPO / "runtime_image" / "activation"))
    from coldsnap_activation.sequence import _inductor_cache

    if os.geteuid() != 0:
        pytest.skip("making a directory owned by another user needs root")
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    env = {"TMPDIR": str(shared)}
    planted = shared / f"torchinductor_{pwd.getpwuid(0).pw_name}"
    planted.mkdir()
    os.chown(planted, 65534, 65534)
    with pytest.raises(ColdSnapError, match=r"owned by uid 65534") as err:
        _inductor_cache(env)
    assert "TORCHINDUCTOR_CACHE_DIR" in err.value.fix
    planted.rmdir()
    (tmp_path / "elsewhere").mkdir()
    planted.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ColdSnapError, match="symbolic link"):
        _inductor_cache(env)
    planted.unlink()
    made = _inductor_cache(env)
    assert made == planted and oct(made.stat().st_mode & 0o777) == "0o700" and made.stat().st_uid == 0
    assert _inductor_cache(env) == planted, "the user's own directory is used again"
    made.chmod(0o775)  # made by torch itself under a umask of 002: this user's own, closed again
    assert _inductor_cache(env) == planted and oct(made.stat().st_mode & 0o777) == "0o755"
    assert _inductor_cache({"TMPDIR": str(tmp_path / "gone")}).parent == Path("/tmp"), "tempfile's fallback"


def test_a_restore_keeps_the_evicted_engines_log_beside_its_fresh_one(tmp_path):
    """The restored tree gets an empty log (CRIU re-opens it as the capture left it); the log of the
    engine the restore replaced is kept as ``target.log.previous`` (its last lines say what it was doing),
    replacing an older one; an empty or missing log leaves no ``.previous``."""
    sys.path.insert(0, str(REPO / "runtime_image" / "activation"))
    from coldsnap_activation.sequence import PREVIOUS_LOG_SUFFIX, _fresh_log

    log = tmp_path / "target.log"
    _fresh_log(log)
    assert log.read_bytes() == b"" and not (tmp_path / f"target.log{PREVIOUS_LOG_SUFFIX}").exists()
    _fresh_log(log)
    assert sorted(os.listdir(tmp_path)) == ["target.log"]
    log.write_bytes(b"engine of generation 2 served\n")
    _fresh_log(log)
    assert log.read_bytes() == b""
    assert (tmp_path / "target.log.previous").read_bytes() == b"engine of generation 2 served\n"
    log.write_bytes(b"generation 3\n")
    _fresh_log(log)
    assert (tmp_path / "target.log.previous").read_bytes() == b"generation 3\n"


def test_a_shared_or_foreign_directory_given_as_the_state_root_is_not_made_private(tmp_path):
    """``--state-root /tmp`` (or ``/srv``, a home) by mistake, as root: ColdSnap would chmod it 0700 and close
    it to every other user. Refused; an empty directory or one holding ColdSnap's entries is made 0700."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import StateLayout

    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(ColdSnapError, match=r"anyone may write to \(mode 1777\).*directory of its own"):
        StateLayout(shared).ensure_private_root()
    assert shared.stat().st_mode & 0o7777 == 0o1777
    srv = tmp_path / "srv"
    (srv / "www").mkdir(parents=True)
    srv.chmod(0o755)
    with pytest.raises(ColdSnapError, match=r"holds other files \(www\) and none of ColdSnap's"):
        StateLayout(srv).ensure_private_root()
    assert srv.stat().st_mode & 0o777 == 0o755
    for name, entries in (("empty", []), ("older", ["runs", "notes.txt"])):
        root = tmp_path / name
        root.mkdir()
        for entry in entries:
            (root / entry).mkdir()
        root.chmod(0o755)
        StateLayout(root).ensure_private_root()
        assert root.stat().st_mode & 0o777 == 0o700, name


def test_the_directories_above_a_new_state_root_are_private_whatever_the_umask(tmp_path):
    """``mkdir(parents=True)`` gave the directories it made above the state root the umask's mode: 0777
    under umask 000, where another user could rename the root away and put a link of theirs there."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import atomic_write_bytes
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import StateLayout

    root = tmp_path / "srv" / "cs" / "state"
    old = os.umask(0)
    try:
        StateLayout(root).ensure_private_root()
        atomic_write_bytes(tmp_path / "out" / "new" / "receipt.json", b"{}\n")
    finally:
        os.umask(old)
    for d in (tmp_path / "srv", tmp_path / "srv" / "cs", root):
        assert d.stat().st_mode & 0o777 == 0o700, d
    # a file written elsewhere (a receipt) keeps its directories readable, but nobody else may write there
    for d in (tmp_path / "out", tmp_path / "out" / "new"):
        assert d.stat().st_mode & 0o777 == 0o755, d
    (tmp_path / "file-root").write_text("")
    with pytest.raises(FileExistsError):
        StateLayout(tmp_path / "file-root").ensure_private_root()


@pytest.mark.parametrize("planted", ["fifo", "link", "directory"])
def test_an_activation_log_planted_as_a_fifo_link_or_directory_is_refused_at_once(tmp_path, planted):
    """The activation's log in the run directory: a FIFO there would block the start for ever, a link would have
    root append to (and chmod) the file it names; each is refused by name, and the linked file is untouched."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import UnitError
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units import host_units

    log = tmp_path / "activation-restore-unit-0.log"
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched\n")
    victim.chmod(0o644)
    if planted == "fifo":
        os.mkfifo(log)
    elif planted == "link":
        log.symlink_to(victim)
    else:
        log.mkdir()
    with pytest.raises(UnitError, match="activation log") as err:
        host_units._open_log(log)
    assert str(log) in err.value.fix
    assert victim.read_bytes() == b"untouched\n" and victim.stat().st_mode & 0o777 == 0o644
    with host_units._open_log(tmp_path / "fresh.log") as fresh:
        fresh.write(b"ok\n")
    assert (tmp_path / "fresh.log").stat().st_mode & 0o777 == 0o600
