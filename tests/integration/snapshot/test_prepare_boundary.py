"""The prepare boundary holds (issue: reliability and security), with real CRIU and a running
workload: a capture whose state was tampered with, or a captured port held by someone else,
fails in prepare and the running engine keeps serving; the state is private; a restored engine
answers only to a fresh control token; one operation runs per workload at a time."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from netports import squatting
from snapshot_workload import Workload, free_port

pytestmark = [pytest.mark.criu, pytest.mark.slow]

UNIT = "unit-0"
WORKER = "worker-0"


@pytest.fixture(scope="module")
def running(state_root, tiny_model, env_digest):
    """Capture once, restore once: the workload runs from that capture while the tests tamper."""
    wl = Workload(state_root, tiny_model, env_digest, tp=1, name="boundary")
    control = state_root / "workloads" / wl.name / UNIT / f"control-{WORKER}.json"
    seen: list[str] = []  # the capture's engine token, read while it runs (the capture removes the file)
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            with contextlib.suppress(OSError, ValueError, KeyError):
                token = json.loads(control.read_text())["token"]
                if token not in seen:
                    seen.append(token)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        cap = wl.run(wl.request("capture"))
    finally:
        done.set()
        watcher.join()
    assert cap.succeeded, cap.receipt["error"]
    assert not control.exists(), "the capture's engine is gone: its control file goes with it"
    assert len(seen) == 1, seen
    capture_token = seen[0]
    artifact = Path(cap.receipt["result"]["operation"]["artifact"])
    art = json.loads(artifact.read_text())
    res = wl.run(wl.request("restore", artifact=artifact))
    assert res.succeeded, res.receipt["error"]
    yield wl, artifact, art, capture_token
    wl.stop()


def unit_dir(state_root: Path, art: dict) -> Path:
    return state_root / "captures" / art["capture_id"] / "units" / UNIT


def still_serving(wl: Workload, pids: list[int]) -> None:
    assert wl.engines() == pids, "a failed prepare must leave the running workload alone"
    assert wl.complete(max_tokens=4)


def flip(path: Path, offsets: list[int]) -> bytes:
    original = path.read_bytes()
    data = bytearray(original)
    for off in offsets:
        data[off] ^= 0x5A
    path.write_bytes(bytes(data))
    return original


@pytest.mark.parametrize("target", ["workers/worker-0/weights.blob", "workers/worker-0/native-manifest.json",
                                    "criu/worker-0/pstree.img", "criu/worker-0/pages-1.img"])
def test_tampered_capture_state_fails_in_prepare_and_the_workload_keeps_serving(running, state_root, target):
    wl, artifact, art, _token = running
    pids = wl.engines()
    assert pids
    path = unit_dir(state_root, art) / target
    size = path.stat().st_size
    # pstree.img: its magic; pages: three bytes in the middle; the others: one byte.
    offsets = [0] if target.endswith("pstree.img") else [size // 2, size // 2 + 1, size // 2 + 2] \
        if target.endswith("pages-1.img") else [size // 3]
    original = flip(path, offsets)
    try:
        res = wl.run(wl.request("restore", artifact=artifact))
        assert not res.succeeded
        err = res.receipt["error"]
        assert "prepare" in (err["phase"] or ""), err
        assert target.rsplit("/", 1)[-1] in err["message"], err["message"]
        still_serving(wl, pids)
    finally:
        path.write_bytes(original)
    assert wl.run(wl.request("restore", artifact=artifact), prepare_only=True).succeeded


def test_an_unlisted_file_among_the_criu_images_is_refused(running, state_root):
    wl, artifact, art, _token = running
    planted = unit_dir(state_root, art) / "criu" / WORKER / "fs-1.img"
    assert not planted.exists()
    planted.write_bytes(b"\x00" * 16)
    try:
        res = wl.run(wl.request("restore", artifact=artifact), prepare_only=True)
        assert not res.succeeded and "fs-1.img" in res.receipt["error"]["message"]
    finally:
        planted.unlink()


def test_a_capture_never_takes_over_the_running_workload(running, state_root):
    """The workload runs: capturing it again (same port, or another one) is refused before anything
    starts, naming the engine; the running generation keeps serving and stays manageable."""
    wl, _artifact, _art, _token = running
    pids = wl.engines()
    for port in (wl.port, free_port()):
        serving, wl.port = wl.port, port
        try:
            refused = wl.run(wl.request("capture"))
        finally:
            wl.port = serving
        assert not refused.succeeded
        msg = refused.receipt["error"]["message"]
        assert f"workload {wl.name!r} is running" in msg and f"pid {pids[0]}" in msg, msg
        assert "state=stopped" in msg
        still_serving(wl, pids)


def test_a_capture_onto_a_port_a_stranger_holds_is_refused_before_starting(state_root, tiny_model, env_digest):
    wl = Workload(state_root, tiny_model, env_digest, tp=1, name="boundary-port")
    with squatting("0.0.0.0", wl.port) as squatter:
        res = wl.run(wl.request("capture"))
        assert not res.succeeded
        msg = res.receipt["error"]["message"]
        assert "serving port of service 'api'" in msg and f":{wl.port} " in msg and f"pid {squatter.pid}" in msg
        assert not (state_root / "workloads" / wl.name).exists() or not wl.engines()


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this host has an NVIDIA driver")
def test_a_gpu_unit_the_snapshot_driver_cannot_admit_is_refused_before_starting(state_root, tiny_model, env_digest):
    wl = Workload(state_root, tiny_model, env_digest, tp=1, name="boundary-driver")
    req = wl.request("capture")
    req["launch"]["units"][0]["devices"] = [0]
    req["launch"]["execution"]["workers"][0]["device_slot"] = 0
    req["policy"]["process"]["backend"] = "cuda-criu"  # what a GPU unit needs under n610
    res = wl.run(req)
    assert not res.succeeded
    msg = res.receipt["error"]["message"]
    assert "unit-0 on localhost" in msg and "needs an NVIDIA driver" in msg, msg
    assert not wl.engines()
    assert not (state_root / "captures" / req["id"]).exists()  # refused before a unit started or was dumped


def test_a_foreign_holder_of_a_captured_port_fails_prepare_only(running, state_root, tiny_model, env_digest):
    """A workload runs; a stranger holds a listener of another workload's capture: prepare-only must
    say so, naming the holder, instead of evicting later and failing; the running one is untouched."""
    wl, _artifact, _art, _token = running
    pids = wl.engines()
    other = Workload(state_root, tiny_model, env_digest, tp=1, name="boundary-other")
    cap = other.run(other.request("capture"))
    assert cap.succeeded, cap.receipt["error"]
    art2_path = Path(cap.receipt["result"]["operation"]["artifact"])
    art2 = json.loads(art2_path.read_text())
    ev2 = json.loads((unit_dir(state_root, art2) / "evidence.json").read_text())
    addr, port = next((a, p) for a, p in ev2["workers"][0]["listeners"] if p != other.port)
    with squatting(addr, port) as squatter:
        res = other.run(other.request("restore", artifact=art2_path), prepare_only=True)
        assert not res.succeeded
        msg = res.receipt["error"]["message"]
        assert f"{addr}:{port}" in msg and f"pid {squatter.pid}" in msg, msg
        assert other.engines() == []
        still_serving(wl, pids)


def test_state_is_private_to_its_owner(running, state_root):
    wl, artifact, art, _token = running
    assert stat.S_IMODE(os.stat(state_root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(artifact).st_mode) & 0o077 == 0, "the artifact holds the launch: 0600"
    ctl = state_root / "workloads" / wl.name / UNIT / f"control-{WORKER}.json"
    assert stat.S_IMODE(os.stat(ctl).st_mode) == 0o600

    def as_nobody(path: Path | str) -> int:
        return subprocess.run(["cat", str(path)], check=False, capture_output=True,
                              preexec_fn=lambda: (os.setgroups([]), os.setgid(65534), os.setuid(65534))).returncode

    assert as_nobody("/etc/passwd") == 0, "nobody can read what anyone may read"
    assert as_nobody(unit_dir(state_root, art) / "criu" / WORKER / "pages-1.img") != 0
    assert as_nobody(ctl) != 0
    # No control file (and so no token) inside the captured state or its capsule.
    for f in unit_dir(state_root, art).rglob("control/*.json"):
        assert "token" not in json.loads(f.read_text())


def _status(port: int, token: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/status", headers={"Authorization": f"Bearer {token}"})
    code = conn.getresponse().status
    conn.close()
    return code


def test_a_restored_engine_answers_only_its_fresh_token(running, state_root):
    wl, _artifact, _art, capture_token = running
    info = json.loads((state_root / "workloads" / wl.name / UNIT / f"control-{WORKER}.json").read_text())
    assert info["token"] != capture_token
    assert _status(info["port"], info["token"]) == 200
    assert _status(info["port"], capture_token) == 401, "the token in the capture's memory opens nothing"


def test_one_operation_per_workload_at_a_time_and_receipts_say_running(running, state_root):
    """Two restores of one workload with different ids: the second is refused while the first runs,
    whose receipt says 'running' (never the outcome of an earlier run)."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError

    wl, artifact, _art, _token = running
    pids = wl.engines()
    first = wl.request("restore", artifact=artifact)
    receipt = state_root / "runs" / first["id"] / "receipt.json"
    outcome: dict = {}
    t = threading.Thread(target=lambda: outcome.setdefault("first", wl.run(first, prepare_only=True)))
    t.start()
    seen_running = False
    for _i in range(600):
        if receipt.exists() and json.loads(receipt.read_text())["state"] == "running":
            seen_running = True
            break
        threading.Event().wait(0.02)
    assert seen_running, "a run's receipt says it is running while it runs"
    with pytest.raises(ColdSnapError, match="another operation of workload"):
        wl.run(wl.request("restore", artifact=artifact), prepare_only=True)
    t.join()
    assert outcome["first"].succeeded, outcome["first"].receipt["error"]
    assert json.loads(receipt.read_text())["state"] == "succeeded"
    still_serving(wl, pids)


def test_stopped_ends_the_engines_keeps_the_capture_and_converges(running, state_root):
    """unit_lifecycle state=stopped: the engine tree goes (its port frees), the capture stays restorable,
    and a second run changes nothing. Runs last: it stops the module's running workload."""
    from coldsnap._collection import collection_root

    wl, artifact, art, _token = running
    pids = wl.engines()
    assert pids
    req = wl.request("restore", artifact=artifact)
    args = {"state": "stopped", "request": req, "host": "localhost", "state_root": str(state_root),
            "activation_digest": art["runtime"]["activation_runtime"]["digest"]}
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(collection_root()),
           "ANSIBLE_PYTHON_INTERPRETER": sys.executable, "ANSIBLE_LOCALHOST_WARNING": "false",
           "ANSIBLE_INVENTORY_UNPARSED_WARNING": "false", "ANSIBLE_LOAD_CALLBACK_PLUGINS": "true",
           "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.json", "ANSIBLE_NOCOLOR": "1"}

    def stop(*extra: str) -> dict:
        proc = subprocess.run([str(Path(sys.executable).parent / "ansible"), "localhost", "-m",
                               "coldsnap.fleet.unit_lifecycle", "-a", json.dumps(args), *extra],
                              capture_output=True, text=True, env=env, timeout=300, check=False)
        text = proc.stdout
        return json.loads(text[text.index("{"):])["plays"][0]["tasks"][0]["hosts"]["localhost"]

    dry = stop("--check")
    assert dry["changed"] and wl.engines() == pids, dry
    first = stop()
    assert first["changed"] and first["units"][0]["state"] == "stopped", first
    assert first["units"][0]["stopped"]["pid"] == pids[0]
    assert wl.engines() == [] and not Path(f"/proc/{pids[0]}").exists()
    again = stop()
    assert not again["changed"] and again["units"][0]["stopped"] is None, again
    assert unit_dir(state_root, art).joinpath("evidence.json").exists(), "the capture stays"
    # status reports a stopped workload in a successful receipt; `coldsnap stop` converges.
    status = wl.run(wl.request("status"))
    assert status.succeeded, status.receipt["error"]
    assert [u["state"] for u in status.receipt["result"]["operation"]["units"]] == ["stopped"]
    again = wl.run(wl.request("stop"))
    assert again.succeeded and again.receipt["replay_semantics"] == "convergent", again.receipt["error"]
    res = wl.run(wl.request("restore", artifact=artifact))
    assert res.succeeded, res.receipt["error"]
    # An engine killed behind ColdSnap's back is reported crashed, not stopped; `coldsnap stop` cleans up.
    os.kill(wl.engines()[0], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while wl.engines() and time.monotonic() < deadline:
        time.sleep(0.1)
    status = wl.run(wl.request("status"))
    assert status.succeeded, status.receipt["error"]
    assert [u["state"] for u in status.receipt["result"]["operation"]["units"]] == ["crashed"]
    assert wl.run(wl.request("stop")).succeeded
    status = wl.run(wl.request("status"))
    assert [u["state"] for u in status.receipt["result"]["operation"]["units"]] == ["stopped"]
    res = wl.run(wl.request("restore", artifact=artifact))
    assert res.succeeded, res.receipt["error"]


def test_a_recovery_source_that_fails_its_pins_fails_in_prepare(running, tiny_model, tmp_path):
    """The pinned safetensors are checked before eviction (sizes, headers), not in hydration after it."""
    import shutil

    wl, artifact, _art, _token = running
    pids = wl.engines()
    model_dir, _ident = tiny_model
    copy = tmp_path / "model-copy"
    shutil.copytree(model_dir, copy)
    grown = sorted(copy.glob("*.safetensors"))[0]
    with grown.open("ab") as fh:
        fh.write(b"\0" * 8)

    def recover_from_the_copy(req: dict) -> None:  # the model's source path is placement
        req["launch"]["model"]["source"]["path"] = str(copy)
        req["policy"]["weights"]["mode"] = "recovery"

    res = wl.run(wl.request("restore", artifact=artifact, mutate=recover_from_the_copy))
    assert not res.succeeded
    err = res.receipt["error"]
    assert "pinned safetensors" in err["message"] and grown.name in err["message"], err
    assert "prepare" in (err["phase"] or ""), err
    still_serving(wl, pids)
