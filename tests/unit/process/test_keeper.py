"""The unit keeper, started ahead of a restore: it waits on a pipe, restores what it is given as the
restored tree's parent (and reaps it), reports a CRIU failure, and exits on its own when the restore
does not need it or the activation that started it is gone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import criu as criu_mod

ACTIVATION = Path(__file__).resolve().parents[3] / "runtime_image" / "activation"
sys.path.insert(0, str(ACTIVATION))
from coldsnap_activation import keeper  # noqa: E402

SLEEPER = r"""
import json, os, sys, time
out = sys.argv[1]
with open(out + ".tmp", "w") as fh:
    json.dump({"pid": os.getpid()}, fh)
os.rename(out + ".tmp", out)
while True:
    time.sleep(1)
"""


@pytest.fixture(autouse=True)
def activation_path(monkeypatch):
    """The keeper runs as ``python -m coldsnap_activation keeper``: it needs what this process imports."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ACTIVATION), *[p for p in sys.path if p]]))


def gone(pid: int, timeout: float = 30) -> bool:
    """Whether ``pid`` exits (or is left a zombie for its new parent to reap) within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_only_a_restore_on_a_host_starts_keepers_one_per_worker():
    spec = SimpleNamespace(operation="restore", supervise=False, criu_binary=None, workers=[{}, {}])
    started = keeper.prestart(spec)
    try:
        assert len(started) == 2 and all(k.proc.poll() is None for k in started)
    finally:
        for k in started:
            k.cancel()
    assert [k.proc.returncode for k in started] == [0, 0], "told nothing to restore, they exit cleanly"
    for other in (SimpleNamespace(operation="restore", supervise=True, criu_binary=None, workers=[{}]),
                  SimpleNamespace(operation="capture", supervise=False, criu_binary=None, workers=[{}]),
                  SimpleNamespace(operation="sleep", supervise=False, criu_binary=None, workers=[{}])):
        assert keeper.prestart(other) == [], other


def test_a_keeper_exits_when_the_activation_that_started_it_dies(tmp_path):
    out = tmp_path / "keeper.pid"
    parent = subprocess.run([sys.executable, "-c", (
        f"import sys; sys.path.insert(0, {str(ACTIVATION)!r})\n"
        "from coldsnap_activation import keeper\n"
        f"k = keeper.Prestarted(None); open({str(out)!r}, 'w').write(str(k.proc.pid))\n"
        "import os; os._exit(3)\n")], check=False, timeout=60)
    assert parent.returncode == 3
    pid = int(out.read_text())
    assert gone(pid), "a keeper whose activation died must not wait for ever"


@pytest.mark.criu
def test_a_failed_restore_is_reported_and_the_keeper_exits(tmp_path):
    k = keeper.Prestarted(None)
    (tmp_path / "images").mkdir()
    res = k.go(tmp_path / "images", work_dir=tmp_path / "work", leave_stopped=False, log_path=tmp_path / "keeper.log",
               timeout=120)
    assert res["ok"] is False and "restore" in res["error"].lower(), res
    assert k.proc.wait(timeout=30) == 1
    k.cancel()  # told its restore already: nothing more to do, and no error
    assert not (tmp_path / "images" / "restore.log").exists(), "CRIU's log never goes into the image directory"


@pytest.mark.criu
def test_the_started_keeper_restores_the_tree_parents_it_and_reaps_it(tmp_path, reap, spawn_ready):
    criu = criu_mod.find_criu()
    proc, info = spawn_ready(SLEEPER, "sleeper")
    criu_mod.dump(criu, info["pid"], tmp_path / "images")
    proc.wait(timeout=30)  # CRIU's dump ends the process
    k = keeper.Prestarted(None)
    reap(k.proc)
    log = tmp_path / "keeper.log"
    res = k.go(tmp_path / "images", work_dir=tmp_path / "work", leave_stopped=False, log_path=log, timeout=120)
    assert res["ok"] is True, res
    assert res["pid"] == info["pid"] and res["keeper"] == k.proc.pid
    reap(res["pid"])
    status = dict(line.split(":\t", 1) for line in Path(f"/proc/{res['pid']}/status").read_text().splitlines()
                  if ":\t" in line)
    assert int(status["PPid"]) == k.proc.pid, "the restored tree is the keeper's child"
    assert os.readlink(f"/proc/{k.proc.pid}/fd/0") == "/dev/null", "the keeper holds no end of the pipe"
    assert json.loads((tmp_path / "work" / "keeper-result.json").read_text()) == res
    assert oct((tmp_path / "work" / "keeper-result.json").stat().st_mode & 0o777) == "0o600"
    assert log.exists() and oct(log.stat().st_mode & 0o777) == "0o600"
    os.kill(res["pid"], 9)
    assert k.proc.wait(timeout=30) == 0, "the keeper reaps the tree, then ends"
    assert gone(res["pid"], timeout=5)


PARENT_OF_A_CHILD = r"""
import json, os, subprocess, sys, time
out = sys.argv[1]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(out + ".tmp", "w") as fh:
    json.dump({"pid": os.getpid(), "child": child.pid}, fh)
os.rename(out + ".tmp", out)
while True:
    time.sleep(1)
"""


def _dump_a_parent_and_its_child(tmp_path, spawn_ready):
    """CRIU dumps a parent and its child to ``tmp_path/images`` and both end; returns (criu, their info)."""
    import ctypes

    criu = criu_mod.find_criu()
    proc, info = spawn_ready(PARENT_OF_A_CHILD, "parent")
    keeper.become_subreaper()  # the dumped child comes here to be reaped (its pid must be free to restore)
    try:
        criu_mod.dump(criu, info["pid"], tmp_path / "images")
        proc.wait(timeout=30)
        os.waitpid(info["child"], 0)
    finally:
        ctypes.CDLL(None).prctl(keeper.PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    return criu, info


@pytest.mark.criu
def test_the_restored_trees_processes_end_with_its_root(tmp_path, reap, spawn_ready):
    """A multi-process engine (vLLM: API server, engine core, worker) whose root is killed: its children,
    re-parented to the keeper, are ended too (they would hold the captured pids, and no control file names
    them), and the keeper exits."""
    _criu, info = _dump_a_parent_and_its_child(tmp_path, spawn_ready)
    k = keeper.Prestarted(None)
    reap(k.proc)
    res = k.go(tmp_path / "images", work_dir=tmp_path / "work", leave_stopped=False,
               log_path=tmp_path / "keeper.log", timeout=120)
    assert res["ok"] is True, res
    reap(info["child"])
    reap(res["pid"])
    assert not gone(info["child"], timeout=0.5), "CRIU restored the child with its parent"
    os.kill(res["pid"], 9)
    assert k.proc.wait(timeout=30) == 0, "the keeper ends the rest of the tree, reaps it, then ends"
    assert gone(info["child"], timeout=5) and gone(res["pid"], timeout=5)
    assert json.loads(keeper.exit_record(tmp_path / "work").read_text())["pid"] == res["pid"]


@pytest.mark.criu
def test_a_criu_killed_part_way_leaves_no_half_restored_tree(tmp_path, reap, spawn_ready):
    """CRIU killed with -9 (the OOM killer) once it has recreated the tree's root: what it restored so far
    (orphans of the keeper) is ended before the failure is reported; it kept the captured pids, so the
    rollback or the next restore of the capture was refused, and a half-restored engine stayed."""
    criu, info = _dump_a_parent_and_its_child(tmp_path, spawn_ready)
    killed = tmp_path / "killed"
    wrapper = tmp_path / "criu"
    # This shell becomes CRIU: the loop in the background kills it once the tree's root is back.
    wrapper.write_text(f"#!/bin/sh\n[ \"$1\" = restore ] || exec {criu.binary} \"$@\"\n"
                       f"(while [ ! -e /proc/{info['pid']} ]; do sleep 0.001; done; kill -9 $$; "
                       f"echo yes > {killed}) &\nexec {criu.binary} \"$@\"\n")
    wrapper.chmod(0o755)
    k = keeper.Prestarted(str(wrapper))
    reap(k.proc)
    res = k.go(tmp_path / "images", work_dir=tmp_path / "work", leave_stopped=False,
               log_path=tmp_path / "keeper.log", timeout=120)
    assert k.proc.wait(timeout=30) == 1
    assert res["ok"] is False and killed.exists(), res
    left = [pid for pid in (info["pid"], info["child"]) if not gone(pid, timeout=5)]
    for pid in left:  # still there (not reused): the half-restored tree
        os.kill(pid, 9)
    assert not left, "the half-restored tree keeps the captured pids"
    assert "CRIU was killed by SIGKILL" in res["error"], "the error says what ended CRIU"


def test_a_keeper_given_half_a_line_restores_nothing(tmp_path):
    k = keeper.Prestarted(None)
    k.proc.stdin.write(json.dumps({"images": str(tmp_path), "result": str(tmp_path / "r.json")})[:20].encode())
    k.proc.stdin.close()
    assert k.proc.wait(timeout=30) == 0
    assert not (tmp_path / "r.json").exists()


def test_a_keeper_that_ended_before_its_restore_is_reported(tmp_path):
    k = keeper.Prestarted(None)
    k.proc.kill()
    k.proc.wait(timeout=30)
    res = k.go(tmp_path / "images", work_dir=tmp_path / "work", leave_stopped=False, log_path=tmp_path / "keeper.log",
               timeout=30)
    assert res["ok"] is False and "exited with status -9" in res["error"], res


def test_a_log_planted_as_a_link_is_refused_by_name(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("untouched\n")
    log = tmp_path / "keeper.log"
    log.symlink_to(target)
    k = keeper.Prestarted(None)
    res = k.go(tmp_path / "images", work_dir=tmp_path / "work", leave_stopped=False, log_path=log, timeout=30)
    assert res["ok"] is False and str(log) in res["error"], res
    assert target.read_text() == "untouched\n"
    assert k.proc.wait(timeout=30) == 1


def test_a_keeper_past_its_time_limit_is_stopped_with_its_criu(tmp_path):
    """A restore that does not report in time leaves nothing behind that could still restore the tree
    after the error: the keeper and the CRIU it runs are stopped together."""
    pidfile = tmp_path / "criu.pid"
    slow = tmp_path / "criu"
    slow.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && {{ echo 'Version: 4.1.1'; exit 0; }}\n"
                    f"echo $$ > {pidfile}\nexec sleep 300\n")
    slow.chmod(0o755)
    k = keeper.Prestarted(str(slow))
    (tmp_path / "images").mkdir()
    t0 = time.monotonic()
    res = k.go(tmp_path / "images", work_dir=tmp_path / "work", leave_stopped=True, log_path=tmp_path / "keeper.log",
               timeout=3)
    assert res["ok"] is False and res.get("timed_out") and "was stopped" in res["error"], res
    assert time.monotonic() - t0 < 30
    assert k.proc.poll() is not None
    assert pidfile.exists() and gone(int(pidfile.read_text())), "the keeper's CRIU was stopped too"


GROWS_A_THREAD = """
import sys, threading, time
print("ready", flush=True)
sys.stdin.readline()
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
print("grown", flush=True)
time.sleep(600)
"""


@pytest.mark.criu
def test_the_dumped_tree_names_a_thread_started_after_the_tree_was_looked_at(tmp_path, reap):
    """The ids a restore needs free come from what CRIU dumped, not only from a look before the dump."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.process import criu_images, ports

    proc = subprocess.Popen([sys.executable, "-c", GROWS_A_THREAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    reap(proc)
    assert proc.stdout.readline().strip() == "ready"
    looked = ports.tree_tids(proc.pid)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "grown"
    now = ports.tree_tids(proc.pid)
    assert set(now) > set(looked)
    criu_mod.dump(criu_mod.find_criu(), proc.pid, tmp_path / "images", leave_running=True)
    assert criu_images.tree_ids(tmp_path / "images") == now


def test_criu_lines_of_every_run_in_a_rank_container_are_not_taken_for_the_cause(tmp_path):
    """The opening lines CRIU 4 writes on every restore in a rank container (no /dev/net/tun there; no
    CAP_SYS_RESOURCE): a CRIU killed part way is reported by how it ended, not as a tun failure."""
    log = tmp_path / "restore.log"
    log.write_text("Error (criu/tun.c:85): tun: Unable to create tun: No such file or directory\n"
                   "Warn  (criu/kerndat.c:1285): Can't keep kdat cache on non-tempfs\n"
                   "Error (criu/util.c:1533): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted\n"
                   "(00.012345) Error (criu/files-reg.c:2123): Can't open file x on restore: No such file\n")
    assert criu_mod.log_errors(log) == ["(00.012345) Error (criu/files-reg.c:2123): Can't open file x on restore: "
                                        "No such file"]
