"""FAULTS.md 18-23 on CPU: a restore or capture that cannot proceed fails fast and clearly,
evicts nothing it should not, commits nothing, and leaves no half-restored process."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from snapshot_workload import Workload

pytestmark = [pytest.mark.criu, pytest.mark.slow]


def tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f.relative_to(path).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def captured(state_root, tiny_model, env_digest):
    wl = Workload(state_root, tiny_model, env_digest, tp=1, name="faults")
    res = wl.run(wl.request("capture"))
    assert res.succeeded, res.receipt["error"]
    artifact = Path(res.receipt["result"]["operation"]["artifact"])
    art = json.loads(artifact.read_text())
    yield wl, artifact, art
    wl.stop()


def engines_after(wl: Workload, seconds: float) -> list[int]:
    """The workload's engines still running once ``seconds`` passed (or none are left)."""
    deadline = time.monotonic() + seconds
    while wl.engines() and time.monotonic() < deadline:
        time.sleep(0.1)
    return wl.engines()


def capsule_dir(art: dict) -> Path:
    return Path(art["capsule"]["units"][0]["location"])


def captured_worker(state_root: Path, art: dict) -> dict:
    ev = json.loads((state_root / "captures" / art["capture_id"] / "units" / "unit-0" / "evidence.json").read_text())
    return ev["workers"][0]


def restore_captured(captured, state_root: Path):
    """Restore the module's capture where a test needs it to succeed. CRIU gives the restored engine its
    captured pid, and a process of the other test lane (a container's shim) may hold that pid for a while:
    the refusal would be right (fault 18), so wait (up to a minute) for the pid to be free first."""
    wl, artifact, art = captured
    pid = captured_worker(state_root, art)["pid"]
    deadline = time.monotonic() + 60
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    try:
        holder = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        holder = None  # free (or freed just now)
    if holder is not None:
        pytest.fail(f"the captured pid {pid} is held by another process for over a minute ({holder!r}): "
                    "raise kernel.pid_max (scripts/test-lanes.sh does, as root)")
    return wl.run(wl.request("restore", artifact=artifact))


def failed(res, *, phase_word: str) -> dict:
    assert not res.succeeded
    err = res.receipt["error"]
    assert res.receipt["state"] == "failed"
    assert phase_word in err["phase"], err
    return err


def test_fault18_port_taken_fails_in_prepare(captured, state_root):
    wl, artifact, art = captured
    before = tree_digest(capsule_dir(art))
    port = next(p for _a, p in captured_worker(state_root, art)["listeners"] if p == wl.port)
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", port))
    squatter.listen()
    try:
        err = failed(wl.run(wl.request("restore", artifact=artifact)), phase_word="prepare")
        assert f"127.0.0.1:{port}" in err["message"] and "taken" in err["message"]
        assert "python" in err["message"] or "pid" in err["message"]
        assert "restore onto another port" in err["message"], "the error says what to do"
    finally:
        squatter.close()
    assert tree_digest(capsule_dir(art)) == before, "the capsule must stay intact"
    assert not wl.engines()


def _spawn_with_pid(pid: int) -> subprocess.Popen:
    """Start a sleeper that gets exactly ``pid`` (root: steer the kernel's next pid)."""
    for _i in range(50):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        p = subprocess.Popen(["sleep", "120"])
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    pytest.fail(f"could not obtain pid {pid} for the test")


def test_fault18_pid_taken_fails_in_prepare(captured, state_root):
    wl, artifact, art = captured
    before = tree_digest(capsule_dir(art))
    pid = captured_worker(state_root, art)["pid"]
    assert not Path(f"/proc/{pid}").exists()
    squatter = _spawn_with_pid(pid)
    try:
        err = failed(wl.run(wl.request("restore", artifact=artifact)), phase_word="prepare")
        assert f"captured pid {pid} is in use" in err["message"]
        assert "sleep" in err["message"]
        assert "stop that process, or use the docker runtime" in err["message"], "the error says what to do"
    finally:
        squatter.kill()
        squatter.wait()
    assert not wl.engines()
    assert tree_digest(capsule_dir(art)) == before, "the capsule must stay intact"


def test_fault19_other_architecture_refused_before_eviction(captured, state_root, tmp_path):
    wl, _artifact, art = captured
    other = dict(art)
    other["compatibility"] = {"units": [{**art["compatibility"]["units"][0], "arch": "aarch64"}]}
    path = tmp_path / "artifact-aarch64.json"
    path.write_text(json.dumps(other))
    # A workload is running: the failed prepare must leave it alone.
    ok = restore_captured(captured, state_root)
    assert ok.succeeded, ok.receipt["error"]
    running = wl.engines()
    err = failed(wl.run(wl.request("restore", artifact=path)), phase_word="prepare")
    assert "aarch64" in err["message"] and "architecture" in err["message"]
    assert wl.engines() == running, "admission failure must not evict the running workload"
    # ... and says so, in the message and the receipt, never that it was evicted.
    assert "nothing was evicted" in err["message"] and "was evicted and is not running" not in err["message"], err
    refused = wl.run(wl.request("restore", artifact=path)).receipt["result"]["eviction"]
    assert refused["previous_workload"] == "untouched" and refused["evicted"] is False, refused
    wl.stop()


def test_fault23_engine_dies_during_capture(state_root, tiny_model, env_digest, tmp_path):
    wl = Workload(state_root, tiny_model, env_digest, tp=1, name="dies")

    def broken(req):
        req["launch"]["units"][0]["command"] = ["coldsnap-reference-engine", "--model", str(tmp_path / "missing"),
                                                "--port", str(wl.port)]

    req = wl.request("capture", mutate=broken)
    res = wl.run(req)
    err = failed(res, phase_word="capture")
    assert "exited during start-up" in err["message"] or "exited" in err["message"]
    assert "last engine log lines" in err["message"]
    assert "missing" in err["message"], "the engine's own error must reach the user"
    assert not (Path(req["output"]["artifact_dir"]) / "artifact.json").exists(), "nothing may be committed"
    assert not wl.engines()


def test_a_capture_retried_after_a_failed_dump_seals_only_its_own_images(
        state_root, tiny_model, env_digest, tmp_path):
    """A dump that fails half-way leaves images in the unit's directory; the same capture run again must not
    seal them into its capsule (and the images it writes are the owner's alone)."""
    wl = Workload(state_root, tiny_model, env_digest, tp=1, name="redump")
    real = shutil.which("criu") or "/usr/local/sbin/criu"
    wrapper = tmp_path / "criu-whose-dump-fails-late"
    wrapper.write_text(f'#!/bin/sh\nif [ "$1" = dump ]; then\n  {real} "$@"; prev=""\n'
                       '  for a in "$@"; do [ "$prev" = "-D" ] && dir="$a"; prev="$a"; done\n'
                       '  echo left-by-the-failed-dump > "$dir/pages-999.img"; exit 1\nfi\n'
                       f'exec {real} "$@"\n')
    wrapper.chmod(0o755)
    req = wl.request("capture")
    res = wl.run(req, envvars={"COLDSNAP_CRIU": str(wrapper)})
    failed(res, phase_word="capture")
    unit_dir = state_root / "captures" / req["id"] / "units" / "unit-0"
    assert list(unit_dir.rglob("pages-999.img")), "the failed attempt left its images (as a real failed dump does)"
    res = wl.run(req)
    assert res.succeeded, res.receipt["error"]
    assert not list(unit_dir.rglob("pages-999.img"))
    sealed = json.loads((unit_dir / "state-digests.json").read_text())
    assert sealed["files"] and not [name for name in sealed["files"] if "pages-999" in name]
    images = [f for f in unit_dir.rglob("*.img") if f.is_file()]
    assert images and all(f.stat().st_mode & 0o077 == 0 for f in images), \
        sorted((f.name, oct(f.stat().st_mode & 0o777)) for f in images)[:5]
    wl.stop()


def test_corrupt_residual_fails_closed_and_leaves_no_process(captured, state_root):
    wl, artifact, art = captured
    blob = state_root / "captures" / art["capture_id"] / "units" / "unit-0" / "workers" / "worker-0" / "weights.blob"
    original = blob.read_bytes()
    try:
        data = bytearray(original)
        data[len(data) // 2] ^= 0xFF
        blob.write_bytes(bytes(data))
        res = wl.run(wl.request("restore", artifact=artifact))
        # Checked before anything is evicted (the captured state is sealed at capture).
        err = failed(res, phase_word="prepare")
        assert "residual" in err["message"] or "weights.blob" in err["message"] or "sha256" in err["message"].lower()
        assert not engines_after(wl, 20), "a restore that failed after CRIU must not leave the process behind"
    finally:
        blob.write_bytes(original)


def _flip_low_bits_of_one_extent(model_dir: Path) -> tuple[Path, bytes]:
    """Flip the lowest bit of every value in the first 4 KiB extent of the model's largest tensor
    (the file keeps its size and header); returns (file, original bytes)."""
    best = None
    for f in sorted(model_dir.glob("*.safetensors")):
        raw = f.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        for name, t in header.items():
            if name == "__metadata__":
                continue
            begin, end = t["data_offsets"]
            if best is None or end - begin > best[2] - best[1]:
                best = (f, 8 + n + begin, 8 + n + end, {"F32": 4, "BF16": 2, "F16": 2}[t["dtype"]])
    f, begin, _end, size = best
    original = f.read_bytes()
    data = bytearray(original)
    for i in range(begin, begin + 4096, size):
        data[i] ^= 1  # little-endian: the first byte holds the lowest mantissa bits
    f.write_bytes(bytes(data))
    return f, original


def test_recovery_weights_with_one_wrong_extent_are_refused_before_serving(captured, tiny_model):
    """The recovery source passes prepare's checks (file sizes, safetensors headers) with one 4 KiB
    extent of a weight subtly wrong (random weights would still reply the accepted text): the
    extent's digest recorded at capture refuses it during hydration, and the restore names the
    pinned revision. (Where no digest can see a wrong weight — a value changed in memory — the
    acceptance's log-probabilities do: tests/unit/engines/test_reference_openai.py.)"""
    wl, artifact, art = captured
    assert art["acceptance"]["logprobs"]["top"] == 5

    def recovery(req):
        req["policy"]["weights"]["mode"] = "recovery"

    f, original = _flip_low_bits_of_one_extent(tiny_model[0])
    try:
        res = wl.run(wl.request("restore", artifact=artifact, mutate=recovery))
        err = failed(res, phase_word="activate")
        assert "hashes to" in err["message"] or "pinned revision" in err["message"], err
        assert not engines_after(wl, 20), "a restore refused during hydration must not leave the process behind"
    finally:
        f.write_bytes(original)
    res = wl.run(wl.request("restore", artifact=artifact, mutate=recovery))
    try:
        assert res.succeeded, res.receipt["error"]
        assert res.receipt["result"]["operation"]["units"][0]["logprobs_check"] == "identical"
    finally:
        wl.stop()  # the next tests start from no running workload


def test_capture_never_replaces_an_artifact(captured):
    wl, artifact, _art = captured
    before = artifact.read_bytes()

    def same_output(req):
        req["output"]["artifact_dir"] = str(artifact.parent)

    res = wl.run(wl.request("capture", mutate=same_output))
    err = failed(res, phase_word="commit")
    assert "never replaces" in err["message"]
    assert artifact.read_bytes() == before
    wl.stop()


def unit_state(res) -> str:
    assert res.succeeded, res.receipt.get("error")
    return res.receipt["result"]["operation"]["units"][0]["state"]


def test_a_stopped_workload_reads_stopped_and_cannot_sleep_or_wake(captured):
    """After a capture (whose engine ended with the dump) and after a restore that failed, status says
    stopped, not crashed: no control file of an engine that is gone is left; sleep and wake of a
    workload that does not run fail by name instead of reporting success."""
    wl, artifact, _art = captured
    assert not wl.engines()
    assert unit_state(wl.run(wl.request("status", artifact=artifact))) == "stopped"
    for verb in ("sleep", "wake"):
        res = wl.run(wl.request(verb, artifact=artifact))
        assert not res.succeeded, f"{verb} of a stopped workload reported success"
        message = res.receipt["error"]["message"]
        assert "is stopped" in message and "restore the workload first" in message, message


def criu_that_kills_after_restore(tmp_path: Path, pid: int, *, once: bool = False) -> Path:
    """A CRIU (for COLDSNAP_CRIU) whose successful restore is followed by a SIGKILL of ``pid``: the restored
    engine dies right as CRIU brings it back (``once``: only the first time)."""
    real = shutil.which("criu") or "/usr/local/sbin/criu"
    wrapper = tmp_path / "criu-whose-restore-dies"
    flag = tmp_path / "criu-killed-once"
    guard = f'[ ! -e {flag} ] && touch {flag} && ' if once else ""
    wrapper.write_text(f'#!/bin/sh\n{real} "$@"; rc=$?\n'
                       f'if [ "$1" = restore ] && [ $rc = 0 ]; then {guard}kill -9 {pid}; fi\nexit $rc\n')
    wrapper.chmod(0o755)
    return wrapper


def test_an_engine_that_dies_as_criu_restores_it_is_named_and_status_says_stopped(captured, state_root, tmp_path):
    wl, artifact, art = captured
    pid = captured_worker(state_root, art)["pid"]
    wrapper = criu_that_kills_after_restore(tmp_path, pid)
    res = wl.run(wl.request("restore", artifact=artifact), envvars={"COLDSNAP_CRIU": str(wrapper)})
    assert not res.succeeded
    message = json.dumps(res.receipt["error"])
    assert "ProcessLookupError" not in message and "died" in message and "engine" in message, message
    assert "killed by SIGKILL" in message, message  # the keeper that reaped it recorded how it ended
    assert not engines_after(wl, 10)
    assert unit_state(wl.run(wl.request("status", artifact=artifact))) == "stopped", \
        "a failed restore leaves no control file behind"
    res = restore_captured(captured, state_root)  # and the capsule restores as before
    assert res.succeeded, res.receipt["error"]
    assert wl.complete() == art["acceptance"]["reply"]
    wl.stop()


def test_a_restore_that_fails_after_eviction_says_the_previous_workload_was_evicted(captured, state_root, tmp_path):
    """A workload runs; a restore passes prepare, evicts it, and its restored engine dies as CRIU restores it.
    The error says, once, that the workload that ran before was evicted and is not running (its unit and
    pid) and how to serve again; the receipt records it (result.eviction); status says it is stopped; and
    restoring again, as the error says, brings it back."""
    wl, artifact, art = captured
    ok = restore_captured(captured, state_root)
    assert ok.succeeded, ok.receipt["error"]
    running = wl.engines()
    assert running, "the workload must run before the failing restore"
    pid = captured_worker(state_root, art)["pid"]
    wrapper = criu_that_kills_after_restore(tmp_path, pid)
    try:
        res = wl.run(wl.request("restore", artifact=artifact), envvars={"COLDSNAP_CRIU": str(wrapper)})
        err = failed(res, phase_word="activate")
        message = err["message"]
        assert "died" in message, message  # the technical failure first
        assert message.count("was evicted and is not running") == 1, message
        assert f"unit unit-0 (engine pid {running[0]})" in message, message
        assert "restore again" in message and "another generation" in message and "recovery" in message, message
        assert ok.receipt["result"]["eviction"]["previous_workload"] in ("none-running", "replaced")
        record = res.receipt["result"]["eviction"]
        assert record["previous_workload"] == "evicted" and record["evicted"] is True, record
        assert [(u["host"], u["unit"], u["pids"], u["restored"]) for u in record["units"]] == \
            [("localhost", "unit-0", running, False)], record
        # The controller tried to bring back what ran (its own restore) and failed the same way.
        rollback = res.receipt["result"]["rollback"]
        assert rollback["attempted"] and rollback["state"] == "failed", rollback
        assert rollback["operation_id"] == res.receipt["operation_id"] + "-rollback"
        assert rollback["from_operation"] == ok.receipt["operation_id"], rollback
        assert f"The rollback (restore {rollback['operation_id']}" in message and "failed too" in message, message
        assert not engines_after(wl, 10)
        assert unit_state(wl.run(wl.request("status", artifact=artifact))) == "stopped", \
            "the evicted workload does not run after the failed restore"
    finally:
        wl.stop()
    again = restore_captured(captured, state_root)  # the fix the error names
    try:
        assert again.succeeded, again.receipt["error"]
        assert again.receipt["result"]["eviction"]["previous_workload"] == "none-running"
        assert wl.complete() == art["acceptance"]["reply"]
    finally:
        wl.stop()


def test_a_restore_that_fails_after_eviction_rolls_back_to_what_ran(captured, state_root, tmp_path):
    """A workload this controller restored runs; a restore evicts it and its engine dies as CRIU restores it
    (once). The controller restores what ran before again (a full restore of the recorded request, as
    <id>-rollback): it serves the same reply, status says ready, and the failed restore's receipt says it
    was rolled back (it still failed). A workload stopped since has nothing to roll back to."""
    wl, artifact, art = captured
    ok = restore_captured(captured, state_root)
    assert ok.succeeded, ok.receipt["error"]
    running = wl.engines()
    wrapper = criu_that_kills_after_restore(tmp_path, captured_worker(state_root, art)["pid"], once=True)
    try:
        res = wl.run(wl.request("restore", artifact=artifact), envvars={"COLDSNAP_CRIU": str(wrapper)})
        err = failed(res, phase_word="activate")
        message = err["message"]
        assert message.startswith("restore failed after eviction and was rolled back: the workload that ran "
                                  f"before was restored again (capture {art['capture_id']}) by restore "
                                  f"{res.receipt['operation_id']}-rollback"), message
        assert "The cause: " in message and "died" in message and "was evicted and is not running" not in message
        record = res.receipt["result"]["eviction"]
        assert record["previous_workload"] == "rolled-back" and record["evicted"] is True, record
        assert [u["pids"] for u in record["units"]] == [running]
        rollback = res.receipt["result"]["rollback"]
        assert rollback["attempted"] and rollback["state"] == "succeeded", rollback
        assert rollback["from_operation"] == ok.receipt["operation_id"]
        assert json.loads(Path(rollback["receipt"]).read_text())["state"] == "succeeded"
        assert wl.engines(), "what ran before runs again"
        assert wl.complete() == art["acceptance"]["reply"]
        assert unit_state(wl.run(wl.request("status", artifact=artifact))) == "ready"
        # stopped: nothing serves, nothing to roll back to (the controller forgot it)
        assert wl.run(wl.request("stop", artifact=artifact)).succeeded
        assert not (state_root / "serving" / f"{wl.name}.json").exists()
    finally:
        wl.stop()


def test_a_criu_killed_part_way_leaves_no_tree_and_the_rollback_restores_what_ran(captured, state_root, tmp_path):
    """CRIU killed with -9 (the OOM killer) once it has recreated the engine's root, after the eviction: no
    half-restored process keeps the captured pid, so the rollback restores what ran before (the same capture,
    the same pids) and it serves."""
    wl, artifact, art = captured
    ok = restore_captured(captured, state_root)
    assert ok.succeeded, ok.receipt["error"]
    pid = captured_worker(state_root, art)["pid"]
    real = shutil.which("criu") or "/usr/local/sbin/criu"
    flag = tmp_path / "criu-killed"
    wrapper = tmp_path / "criu-killed-part-way"
    # The shell becomes CRIU; the loop in the background kills it once the engine's root is back (once).
    wrapper.write_text(f'#!/bin/sh\nif [ "$1" != restore ] || [ -e {flag} ]; then exec {real} "$@"; fi\n'
                       f"touch {flag}\n(while [ ! -e /proc/{pid} ]; do sleep 0.001; done; kill -9 $$) &\n"
                       f'exec {real} "$@"\n')
    wrapper.chmod(0o755)
    try:
        res = wl.run(wl.request("restore", artifact=artifact), envvars={"COLDSNAP_CRIU": str(wrapper)})
        err = failed(res, phase_word="activate")
        assert flag.exists()
        assert "CRIU was killed by SIGKILL" in err["message"], err
        rollback = res.receipt["result"]["rollback"]
        assert rollback["attempted"] and rollback["state"] == "succeeded", (rollback, err["message"])
        assert wl.engines() == [pid], "what ran before runs again, at its captured pid"
        assert wl.complete() == art["acceptance"]["reply"]
    finally:
        wl.stop()


def test_a_restore_under_another_state_root_is_refused_in_prepare(captured, tiny_model, env_digest, tmp_path):
    """The restored engine reads its control file at its captured path: another state root is refused
    before anything is evicted, naming the capture's root."""
    wl, artifact, _art = captured
    other = Workload(tmp_path / "other-root", tiny_model, env_digest, tp=1, name=wl.name)
    other.port = wl.port
    err = failed(other.run(other.request("restore", artifact=artifact)), phase_word="prepare")
    assert f"captured under state root {wl.state_root}" in err["message"], err
    assert f"--state-root {wl.state_root}" in err["message"]
