"""The shared control API and lifecycle, driven by the activation runtime's own client
(``EngineHandle``) over a real loopback socket, on an in-process worker whose stable
allocations are the reference engine's mmap arenas (release = MADV_DONTNEED)."""

from __future__ import annotations

import http.client
import json
import os
import stat
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import UnitError  # noqa: E402
from coldsnap_engines.common.allocations import AllocationTable, LiveAllocation  # noqa: E402
from coldsnap_engines.common.control import ControlServer, control_file_for  # noqa: E402
from coldsnap_engines.common.lifecycle import Lifecycle  # noqa: E402
from coldsnap_engines.common.local import LocalControl  # noqa: E402
from coldsnap_engines.common.observer import LoadObserver  # noqa: E402
from engines_testlib import (  # noqa: E402
    REPO,
    arenas_for,
    make_reference_model,
    model_identity,
    safetensors_iter,
    table_of,
    vllm_style_load,
)

sys.path.insert(0, str(REPO / "runtime_image" / "activation"))
from coldsnap_activation.engine_handle import EngineHandle  # noqa: E402


class ArenaControl(LocalControl):
    """A CPU worker over reference arenas: weights ('params', 'derived') and a KV arena."""

    engine = "cpu-test"

    def __init__(self, arenas: dict, kv, extents: list, model_dir: Path) -> None:
        super().__init__()
        self.arenas, self.kv = arenas, kv
        self.extents, self.model_dir = extents, model_dir
        self.events: list[str] = []

    def weights_table(self) -> AllocationTable:
        return table_of(self.arenas)

    def kv_table(self):
        return AllocationTable([LiveAllocation("kv_cache.0", "cpu", self.kv.address, self.kv.size, self.kv.view())])

    def _pause_serving(self):
        self.events.append("pause")

    def _resume_serving(self):
        self.events.append("resume")

    def _release_transport(self):
        self.events.append("transport-release")

    def _rebuild_transport(self, spec):
        self.events.append(f"transport-rebuild:{spec.get('generation')}")

    def _release(self, tags):
        for tag in tags:
            for a in ([self.kv] if tag == "kv_cache" else self.arenas.values()):
                a.release()

    def _recreate(self, tags):
        for a in [*self.arenas.values(), self.kv]:
            a.recreate()

    def _switch_load_format(self):
        self.events.append("load-format:coldsnap")


def _snapshot(arenas) -> dict:
    return {k: bytes(a.view()) for k, a in arenas.items()}


@pytest.fixture
def rig(tmp_path):
    from coldsnap_engines.common.arena import CpuArena

    model_dir = tmp_path / "model"
    ident = make_reference_model(model_dir)
    cfg, plan, arenas = arenas_for(model_dir, 1, 2)
    obs = LoadObserver()
    vllm_style_load(model_dir, safetensors_iter(model_dir), plan, arenas, getattr(torch, cfg.dtype), observer=obs)
    arenas["derived"].view()[:] = os.urandom(arenas["derived"].size)  # residual-only bytes
    kv = CpuArena("kv", 8192)
    kv.view()[:] = b"\xab" * kv.size
    control = ArenaControl(arenas, kv, obs.resolve(table_of(arenas)), model_dir)
    life = Lifecycle(control)
    life.mark_ready()
    handle = EngineHandle(unit="unit-0", worker={"id": "worker-0"}, workload_dir=tmp_path / "wl")
    server = ControlServer(life, control_file=handle.control_file, extra_status={"unit": "unit-0"})
    try:
        yield {"control": control, "handle": handle, "server": server, "arenas": arenas, "kv": kv,
               "model": model_identity(ident), "model_dir": model_dir, "tmp": tmp_path, "life": life}
    finally:
        server.close()


def _capture(rig, release: dict | None = None) -> tuple[dict, dict, Path]:
    h = rig["handle"]
    before = _snapshot(rig["arenas"])
    assert h.call("POST", "/quiesce")["state"] == "quiesced"
    assert bytes(rig["kv"].view()) == bytes(rig["kv"].size), "quiesce discards the KV cache"
    out = rig["tmp"] / "unit" / "workers" / "worker-0"
    state_root = rig["tmp"] / "state"
    r = h.call("POST", "/export", {"out_dir": str(out), "export_pack": True, "state_root": str(state_root),
                                   "model": rig["model"]})
    payload = r["payload"]
    assert payload["model_bytes"] == sum(e.size for e in rig["control"].extents) > 0
    assert payload["demoted_extents"] == 0
    assert (out / "engine-layout.json").exists() is False  # no named tensors in this rig
    rel = h.call("POST", "/release", release)
    assert rel["state"] == "released"
    rig["released"] = rel
    assert all(b == 0 for b in rig["arenas"]["params"].view()[:4096]), "released weights leave the process image"
    return before, payload, out


def _spec(rig, out: Path, payload: dict, provider: str, **extra) -> dict:
    pack = payload["pack"]
    return {"provider": provider, "manifest": str(out / "native-manifest.json"), "residual": str(out / "weights.blob"),
            "replay": str(out / "replay-plan.json"), "model_dir": str(rig["model_dir"]),
            "pack": {"path": str(rig["tmp"] / "state" / pack["path"]), "sha256": pack["sha256"], "size": pack["size"]},
            "state_root": str(rig["tmp"] / "state"), "generation": "g1", **extra}


def test_control_file_is_private_and_names_this_process(rig):
    path = rig["handle"].control_file
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    info = json.loads(path.read_text())
    assert info["pid"] == os.getpid() and info["port"] == rig["server"].port
    rig["handle"].adopt(info["pid"], info)  # as the runtime does for a restored process
    st = rig["handle"].wait_control(10)
    assert st["state"] == "ready" and st["engine"] == "cpu-test" and st["unit"] == "unit-0"
    assert set(st["arenas"]) == {"params", "derived"}


def test_the_control_port_is_outside_the_ephemeral_range(rig):
    """A restore binds the captured control port again: an ephemeral one could by then be the local port
    of any outgoing connection on the host."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.listen_ports import ephemeral_range

    low, high = ephemeral_range()
    assert not low <= rig["server"].port <= high


def test_capture_then_native_restore_reproduces_every_byte(rig):
    before, payload, out = _capture(rig)
    r = rig["handle"].call("POST", "/resume", _spec(rig, out, payload, "native", operation_id="op-1"))
    assert r["state"] == "ready" and r["hydration"]["provider"] == "native"
    assert _snapshot(rig["arenas"]) == before
    assert bytes(rig["kv"].view()) == bytes(rig["kv"].size), "KV comes back zeroed"
    names = [s["name"] for s in r["spans"]]
    assert names[:3] == ["engine.arenas.recreate", "engine.transport.rebuild", "engine.hydrate"]
    assert rig["control"].events == ["pause", "transport-release", "load-format:coldsnap", "transport-rebuild:g1",
                                     "resume"]


def test_recovery_restore_then_sleep_and_wake(rig):
    before, payload, out = _capture(rig)
    r = rig["handle"].call("POST", "/resume", _spec(rig, out, payload, "recovery", materialize="required"))
    assert _snapshot(rig["arenas"]) == before
    assert r["hydration"]["materialized"]["sha256"] == payload["pack"]["sha256"], "canonical writer, same object"
    assert rig["handle"].call("POST", "/sleep")["state"] == "sleeping"
    assert not any(rig["arenas"]["params"].view()[:4096])
    r = rig["handle"].call("POST", "/wake", _spec(rig, out, payload, "recovery"))
    assert r["state"] == "ready" and _snapshot(rig["arenas"]) == before


def test_a_sleep_waits_for_the_background_materialize_that_reads_the_weights(rig):
    """materialize 'async' writes the pack from the resident weights after a recovery restore: a
    sleep at once must not free them under it (the pack would be lost, or written from zeros)."""
    import threading

    before, payload, out = _capture(rig)
    spec = _spec(rig, out, payload, "recovery", materialize="async")
    Path(spec["pack"]["path"]).unlink()  # another host: the pack is not cached, the weights are its source
    gate, reading = threading.Event(), threading.Event()
    write = rig["control"].materialize

    def slow_materialize(body):
        reading.set()
        gate.wait(60)
        return write(body)

    rig["control"].materialize = slow_materialize
    assert rig["handle"].call("POST", "/resume", spec)["state"] == "ready"
    assert reading.wait(30)
    slept = {}
    sleeper = threading.Thread(target=lambda: slept.update(rig["handle"].call("POST", "/sleep")))
    sleeper.start()
    for _look in range(10):
        assert rig["handle"].call("GET", "/status")["state"] == "ready", "weights freed under the materialize"
        time.sleep(0.05)
    gate.set()
    sleeper.join(60)
    assert slept["state"] == "sleeping"
    assert "engine.materialize.wait" in [s["name"] for s in slept["spans"]]
    assert rig["life"].last_error is None
    assert rig["life"].materialized["sha256"] == payload["pack"]["sha256"]
    assert Path(spec["pack"]["path"]).exists(), "the pack written from the weights before they were freed"
    assert not any(rig["arenas"]["params"].view()[:4096])
    r = rig["handle"].call("POST", "/wake", _spec(rig, out, payload, "native"))
    assert r["state"] == "ready" and _snapshot(rig["arenas"]) == before


def test_warm_restore_stops_before_hydration(rig):
    before, payload, out = _capture(rig)
    assert rig["handle"].call("POST", "/resume", _spec(rig, out, payload, "native", warm=True))["state"] == "warm"
    assert rig["handle"].call("POST", "/finish-warm", _spec(rig, out, payload, "native"))["state"] == "ready"
    assert _snapshot(rig["arenas"]) == before


def test_wrong_state_is_refused_with_409(rig):
    rig["handle"].call("POST", "/quiesce")
    with pytest.raises(UnitError, match="engine refused /quiesce: engine is 'quiesced'"):
        rig["handle"].call("POST", "/quiesce")
    conn = http.client.HTTPConnection("127.0.0.1", rig["server"].port, timeout=5)
    conn.request("POST", "/sleep", body=b"{}", headers={"Authorization": f"Bearer {rig['server'].token}"})
    assert conn.getresponse().status == 409


def test_a_wrong_token_is_unauthorized(rig):
    conn = http.client.HTTPConnection("127.0.0.1", rig["server"].port, timeout=5)
    conn.request("GET", "/status", headers={"Authorization": "Bearer " + "0" * 64})
    resp = conn.getresponse()
    assert resp.status == 401 and json.loads(resp.read())["error"] == "unauthorized"


def test_an_engine_without_a_canonical_writer_refuses_materialization(rig):
    _before, payload, out = _capture(rig)
    rig["life"].materialize_modes = ("off",)
    with pytest.raises(UnitError, match="materialize='async' is not supported"):
        rig["handle"].call("POST", "/resume", _spec(rig, out, payload, "recovery", materialize="async"))
    assert rig["handle"].call("GET", "/status")["state"] == "released"


def test_a_tampered_manifest_fails_closed_before_any_byte(rig):
    _before, payload, out = _capture(rig)
    man = json.loads((out / "native-manifest.json").read_text())
    man["allocations"][0]["size"] += 4096
    (out / "native-manifest.json").write_text(json.dumps(man))
    with pytest.raises(UnitError, match="engine refused /resume"):
        rig["handle"].call("POST", "/resume", _spec(rig, out, payload, "native"))


def test_control_file_names_per_rank(tmp_path):
    env = {"COLDSNAP_CONTROL_FILE": str(tmp_path / "control-worker-0.json")}
    assert control_file_for(0, 1, env) == tmp_path / "control-worker-0.json"
    assert control_file_for(1, 2, env) == tmp_path / "control-worker-0.rank1.json"
    assert control_file_for(0, 1, {}) is None


def test_bytes_changed_behind_the_observer_are_demoted_to_the_residual(rig):
    victim = rig["control"].extents[0]
    view = rig["arenas"][victim.allocation].view()
    view[victim.offset] = (view[victim.offset] + 1) % 256  # a raw write no dispatch mode sees
    before = _snapshot(rig["arenas"])
    rig["handle"].call("POST", "/quiesce")
    out = rig["tmp"] / "w"
    payload = rig["handle"].call("POST", "/export", {"out_dir": str(out), "export_pack": True,
                                                     "state_root": str(rig["tmp"] / "state"),
                                                     "model": rig["model"]})["payload"]
    assert payload["demoted_extents"] == 1 and payload["demoted_bytes"] == victim.size
    rig["handle"].call("POST", "/release")
    rig["handle"].call("POST", "/resume", _spec(rig, out, payload, "recovery"))
    assert _snapshot(rig["arenas"]) == before, "recovery replays only verified bytes; the rest is residual"


def test_the_token_is_read_from_the_control_file_so_a_restore_can_replace_it(rig):
    """A restored engine keeps its captured token in memory; the runtime writes a fresh one into the
    0600 control file before the restore, and only that one opens the control API."""
    h = rig["handle"]
    old = json.loads(h.control_file.read_text())
    assert h.call("GET", "/status")["state"] == "ready"
    fresh = {**old, "token": "f" * 64}
    h.control_file.write_text(json.dumps(fresh))
    with pytest.raises(UnitError, match="unauthorized"):
        h.call("GET", "/status")
    h.adopt(fresh["pid"], fresh)
    assert h.call("GET", "/status")["state"] == "ready"


def test_export_writes_only_below_the_state_roots_captures(rig, monkeypatch):
    """With the token, a local user could otherwise make the root engine write anywhere."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import engine_control as ec

    state_root = rig["tmp"] / "state"
    monkeypatch.setenv(ec.ENV_STATE_ROOT, str(state_root))
    h = rig["handle"]
    assert h.call("POST", "/quiesce")["state"] == "quiesced"
    outside = rig["tmp"] / "home" / "evil"
    for body in ({"out_dir": str(outside), "model": rig["model"], "state_root": str(state_root)},
                 {"out_dir": str(state_root / "captures" / ".." / "evil"), "model": rig["model"]},
                 {"out_dir": str(state_root / "captures" / "c1" / "w"), "model": rig["model"],
                  "state_root": str(rig["tmp"] / "other-root")}):
        with pytest.raises(UnitError, match=r"may write only below|node cache of"):
            h.call("POST", "/export", body)
    assert not (rig["tmp"] / "home").exists() and not (state_root / "evil").exists()
    r = h.call("POST", "/export", {"out_dir": str(state_root / "captures" / "c1" / "units" / "u" / "workers" / "w"),
                                   "model": rig["model"], "state_root": str(state_root)})
    assert r["payload"]["model_bytes"] > 0


def test_recreate_from_plan_drops_the_graphs_before_the_dump_and_recreates_them_on_resume(rig):
    control = rig["control"]
    control.release_graphs = lambda: control.events.append("graphs-release") or 3
    control.recreate_graphs = lambda: control.events.append("graphs-recreate") or 3
    _before, payload, out = _capture(rig, {"graphs": "recreate-from-plan"})
    assert rig["released"]["graphs"] == {"policy": "recreate-from-plan", "released": 3}
    r = rig["handle"].call("POST", "/resume", _spec(rig, out, payload, "native"))
    names = [s["name"] for s in r["spans"]]
    assert names[:4] == ["engine.arenas.recreate", "engine.transport.rebuild", "engine.graphs.recreate", "engine.hydrate"]
    assert control.events == ["pause", "transport-release", "graphs-release", "load-format:coldsnap",
                              "transport-rebuild:g1", "graphs-recreate", "resume"]
    # preserve (the default) keeps them: nothing is released, nothing re-created on the next restore
    assert rig["handle"].call("POST", "/quiesce")["state"] == "quiesced"
    kept = rig["handle"].call("POST", "/release", {"graphs": "preserve"})["graphs"]
    assert kept == {"policy": "preserve", "released": 0}
    r = rig["handle"].call("POST", "/resume", _spec(rig, out, payload, "native"))
    assert "engine.graphs.recreate" not in [s["name"] for s in r["spans"]]
    assert control.events.count("graphs-release") == 1 and control.events.count("graphs-recreate") == 1


def test_an_integration_that_cannot_recreate_graphs_refuses_and_keeps_the_weights(rig):
    h = rig["handle"]
    h.call("POST", "/quiesce")
    with pytest.raises(UnitError, match="use 'preserve'"):
        h.call("POST", "/release", {"graphs": "recreate-from-plan"})
    with pytest.raises(UnitError, match="graphs must be one of"):
        h.call("POST", "/release", {"graphs": "sometimes"})
    assert h.call("GET", "/status")["state"] == "quiesced"
    assert any(rig["arenas"]["params"].view()[:4096]), "nothing was released"


def test_hydration_bytes_are_reported_in_status_and_watched_as_progress(rig):
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.progress import ProgressWriter
    from coldsnap_activation.sequence import watch_hydration

    h = rig["handle"]
    _before, payload, out = _capture(rig)
    assert "hydration" not in h.call("GET", "/status"), "nothing hydrated yet"
    (rig["tmp"] / "progress").mkdir()  # the step's progress directory (its module creates it)
    writer = ProgressWriter(rig["tmp"] / "progress", "hydrate-unit-0", phase="unit unit-0 hydration",
                            min_interval=0)
    end = watch_hydration([h], writer, interval=0.05)
    r = h.call("POST", "/resume", _spec(rig, out, payload, "native"))
    total = r["hydration"]["model_bytes"] + r["hydration"]["residual_bytes"]
    assert h.call("GET", "/status")["hydration"] == {"done": total, "total": total}
    deadline = time.monotonic() + 5
    while not writer.writes and time.monotonic() < deadline:
        time.sleep(0.05)
    end()
    record = json.loads((rig["tmp"] / "progress" / "hydrate-unit-0.progress.json").read_text())
    assert record["done"] == record["total"] == total and record["state"] == "done"
    assert record["phase"] == "unit unit-0 hydration" and record["unit"] == "bytes"


def _status_spec(rig, workers: list[str]):
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import UnitSpec

    return UnitSpec(operation="status", operation_id="op-status", capture_id="cap", unit={"id": "unit-0"},
                    workers=[{"id": w, "rank": i} for i, w in enumerate(workers)], world_size=len(workers),
                    unit_count=1, state_root=str(rig["tmp"] / "state"), unit_dir=str(rig["tmp"] / "unit"),
                    workload_dir=str(rig["tmp"] / "wl"), python=sys.executable, model={}, driver={})


def test_status_without_the_activation_runtime_reads_each_worker_as_the_activation_runtime_would(rig):
    """Runtime host answers ``status`` from the workers' control APIs: the state the engine reports,
    ``mixed`` across workers that disagree, ``absent`` without a control file, and a failure naming
    the worker when the pid in the control file is not the engine answering."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units.host_units import unit_status

    ev = unit_status(_status_spec(rig, ["worker-0"]))
    assert (ev["ok"], ev["state"], ev["changed"]) == (True, "ready", False)
    assert ev["workers"] == [{"worker": "worker-0", "pid": os.getpid(), "state": "ready"}]
    assert (ev["kind"], ev["operation"], ev["unit"]) == ("coldsnap-unit-evidence", "status", "unit-0")

    rig["handle"].call("POST", "/quiesce")
    assert unit_status(_status_spec(rig, ["worker-0"]))["state"] == "quiesced"

    # A second worker of the unit that never wrote its control file: the unit is not (all) here.
    assert unit_status(_status_spec(rig, ["worker-0", "worker-1"]))["state"] == "absent"

    # A second worker in another state: mixed.
    other = Lifecycle(rig["control"])
    other.mark_ready()
    second = EngineHandle(unit="unit-0", worker={"id": "worker-1"}, workload_dir=rig["tmp"] / "wl")
    server = ControlServer(other, control_file=second.control_file, extra_status={"unit": "unit-0"})
    try:
        ev = unit_status(_status_spec(rig, ["worker-0", "worker-1"]))
        assert ev["state"] == "mixed"
        assert [w["state"] for w in ev["workers"]] == ["quiesced", "ready"]
    finally:
        server.close()

    # The control file names a pid that is not the process answering on its port (a reused pid, a
    # stale file): the worker is reported as not running, by name.
    path = rig["handle"].control_file
    info = json.loads(path.read_text())
    path.write_text(json.dumps({**info, "pid": 1}))
    with pytest.raises(UnitError, match=r"worker-0 \(pid 1\) is not running"):
        unit_status(_status_spec(rig, ["worker-0"]))
    path.write_text("{not json")
    with pytest.raises(UnitError, match="worker-0's control file cannot be read"):
        unit_status(_status_spec(rig, ["worker-0"]))


def test_a_negative_or_bogus_content_length_is_refused_unread(rig):
    """A Content-Length of -1 used to pass the size limit and read until the client hung up."""
    import socket

    for length in ("-1", "12x"):
        with socket.create_connection(("127.0.0.1", rig["server"].port), timeout=10) as s:
            s.sendall(f"POST /quiesce HTTP/1.0\r\nAuthorization: Bearer {rig['server'].token}\r\n"
                      f"Content-Length: {length}\r\n\r\n".encode() + b"x" * 65536)
            t0 = time.monotonic()
            reply = s.recv(4096)
            assert reply.startswith(b"HTTP/1.0 400") and time.monotonic() - t0 < 5, reply[:200]
    assert rig["handle"].call("GET", "/status")["state"] == "ready"
