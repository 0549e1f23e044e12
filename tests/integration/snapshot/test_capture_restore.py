"""Capture and restore of the reference engine with real CRIU, TP1 and TP2, native and recovery."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import StateLayout
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import load_artifact
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.cpulist import format_cpus
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.receipt import validate_receipt
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import affinity, criu
from netports import another_free_port
from snapshot_workload import Workload, units_of

pytestmark = [pytest.mark.criu, pytest.mark.slow]


def huge_page_kib(pids: list[int]) -> int:
    """AnonHugePages of these processes, summed (KiB)."""
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


def restores_into_huge_pages() -> bool:
    """ColdSnap's CRIU build on a host with transparent huge pages (not ``never``) whose restores ask for
    them (not a VM whose balloon hands free memory back to its hypervisor)."""
    return criu.find_criu().coldsnap_build and criu.thp_mode() not in ("never", "absent") \
        and criu.huge_pages_by_default()


def capture(wl: Workload, *, live: bool = False) -> tuple[Path, dict]:
    req = wl.request("capture")
    res = wl.run(req, live=live)
    assert res.succeeded, res.receipt["error"]
    validate_receipt(res.receipt)
    assert res.receipt["replay_semantics"] == "conflict-on-existing-output"
    artifact = Path(res.receipt["result"]["operation"]["artifact"])
    art = load_artifact(artifact.read_bytes())
    assert not wl.engines(), "capture must leave no engine running (CRIU dump stops it)"
    return artifact, art


def restore(wl: Workload, artifact: Path, *, mode: str, live: bool = False) -> dict:
    def set_mode(req):
        req["policy"]["weights"]["mode"] = mode

    res = wl.run(wl.request("restore", artifact=artifact, mutate=set_mode), live=live)
    assert res.succeeded, res.receipt["error"]
    validate_receipt(res.receipt)
    assert res.receipt["replay_semantics"] == "reconcile-replace"
    return res.receipt


@pytest.mark.parametrize("tp", [1, 2])
def test_capture_then_restore_native_and_recovery(tp, state_root, tiny_model, env_digest):
    wl = Workload(state_root, tiny_model, env_digest, tp=tp, name=f"tp{tp}")
    try:
        # TP1 runs the long steps as async jobs waited for with live progress (a terminal's way), TP2 in the
        # foreground (the controller's way when nobody watches): the same results either way.
        artifact, art = capture(wl, live=tp == 1)
        accepted = art["acceptance"]["reply"]
        assert len(accepted) == 16
        # The reference engine's default: the top 5 log-probabilities of every token are recorded.
        assert art["acceptance"]["logprobs"]["top"] == 5
        assert len(art["weights"]["workers"]) == tp
        for w in art["weights"]["workers"]:
            assert w["payload"] is not None and w["model_bytes"] > 0 and w["residual_bytes"] > 0
        # The model bytes are outside the capsule: each capsule is far smaller than process + weights.
        for c in art["capsule"]["units"]:
            assert c["layout"] == "oci-layout"

        native = restore(wl, artifact, mode="native", live=tp == 1)
        names = [t["task"] for t in native["result"]["tasks"]]
        assert ("Restore the units on this host (start)" in names) == (tp == 1)
        assert ("Restore the units on this host (result)" in names) == (tp != 1)
        unit0 = next(u for u in units_of(native) if u["unit"] == "unit-0")
        assert unit0["reply"] == accepted
        assert unit0["logprobs_check"] == "identical" and unit0["logprobs"] == art["acceptance"]["logprobs"]
        assert unit0["readiness"]["ttft_s"] > 0
        # A live request after the restore gives the same greedy reply.
        assert wl.complete() == accepted
        if restores_into_huge_pages():  # the engine's large anonymous mappings came back in 2 MiB pages
            assert huge_page_kib(wl.engines()) > 0
        # The receipt says which page size each unit's CRIU restore asked for: this host's default.
        steps = [s for s in native["timing"]["spans"] if s["name"] == "unit.criu.restore"]
        assert len(steps) == tp and {s["attrs"]["huge_pages"] for s in steps} == {criu.huge_pages_by_default()}
        log = (state_root / "workloads" / wl.name / "unit-0" / "target.log").read_text().splitlines()
        marker = json.loads(log[0])
        assert marker["coldsnap"] == "restore-boundary" and marker["provider"] == "native"

        recovery = restore(wl, artifact, mode="recovery")  # evicts the native restore first
        unit0 = next(u for u in units_of(recovery) if u["unit"] == "unit-0")
        assert unit0["reply"] == accepted
        # A fresh engine loading the pinned safetensors computes the same values, bit for bit.
        assert unit0["logprobs_check"] == "identical"
        log = (state_root / "workloads" / wl.name / "unit-0" / "target.log").read_text().splitlines()
        assert json.loads(log[0])["provider"] == "recovery"
        assert len(wl.engines()) == tp
        # The activation runtime's bytecode is kept beside the staged runtimes, which stay as staged.
        layout = StateLayout(state_root)
        assert any(layout.activation_bytecode.rglob("coldsnap_activation/sequence*.pyc"))
        assert not any(layout.activation_runtimes.rglob("__pycache__"))
        assert layout.activation_bytecode.stat().st_mode & 0o777 == 0o700
    finally:
        wl.stop()


def test_prepare_only_touches_nothing(state_root, tiny_model, env_digest):
    wl = Workload(state_root, tiny_model, env_digest, tp=1, name="prep")
    try:
        artifact, _unused = capture(wl)
        first = restore(wl, artifact, mode="auto")
        running = wl.engines()
        assert len(running) == 1
        # The unit's spans are in the receipt once (the step's own task, not also the wait that hands it on).
        unit_spans = [sp["name"] for sp in first["timing"]["spans"] if sp["name"].startswith("unit.")]
        assert unit_spans.count("unit.criu.restore") == 1 and len(unit_spans) == len(set(unit_spans)), unit_spans
        res = wl.run(wl.request("restore", artifact=artifact), prepare_only=True)
        assert res.succeeded, res.receipt["error"]
        assert res.receipt["replay_semantics"] == "safe-repeat"
        assert res.receipt["prepare_only"] is True
        assert wl.engines() == running, "prepare-only must not evict or restart the workload"
        assert first["state"] == "succeeded"
    finally:
        wl.stop()


def test_a_compiled_engine_under_recreate_from_plan_drops_and_rebuilds_its_graphs(state_root, tiny_model, env_digest):
    """policy.process.graph_policy 'recreate-from-plan': the capture drops the compiled graphs before
    the dump (the evidence counts them); the restore compiles them again from the plan (the --compile
    settings and TorchInductor's cache, carried in the capsule) and the reply is the captured one."""
    wl = Workload(state_root, tiny_model, env_digest, tp=1, name="graphs")
    inductor = state_root / "inductor-graphs"
    inductor.mkdir(parents=True)

    def compiled(req):
        req["launch"]["units"][0]["command"].append("--compile")
        req["launch"]["units"][0]["environment"]["TORCHINDUCTOR_CACHE_DIR"] = str(inductor)
        req["policy"]["cache"]["paths"] = [str(inductor)]
        req["policy"]["process"]["graph_policy"] = "recreate-from-plan"

    try:
        res = wl.run(wl.request("capture", mutate=compiled))
        assert res.succeeded, res.receipt["error"]
        artifact = Path(res.receipt["result"]["operation"]["artifact"])
        art = load_artifact(artifact.read_bytes())
        evidence = json.loads((state_root / "captures" / art["capture_id"] / "units" / "unit-0" / "evidence.json")
                              .read_text())
        assert evidence["workers"][0]["graphs"] == {"policy": "recreate-from-plan", "released": 2}
        res = wl.run(wl.request("restore", artifact=artifact, mutate=compiled))
        assert res.succeeded, res.receipt["error"]
        assert units_of(res.receipt)[0]["reply"] == art["acceptance"]["reply"]
        assert "engine.graphs.recreate" in json.dumps(res.receipt["timing"])
        assert wl.complete() == art["acceptance"]["reply"]
    finally:
        wl.stop()


def test_an_engine_core_child_holding_the_model_is_captured_and_restored_with_its_api_server(
        state_root, tiny_model, env_digest):
    """The vLLM V1 shape (``--engine-core-process``): the unit's process serves HTTP and holds no
    model; its child holds the weights and the control API. Capture dumps both with the socket
    pair between them, restore brings both back (same pids), hydrates the child, and the API
    server answers through it — also on another port than at capture. The child pins its threads
    to one CPU, as vLLM's CPU worker does (``--bind-cpus``): the restored threads are pinned again,
    the API server's stay free (CRIU alone would leave every thread free)."""
    from test_placement import on_port

    allowed = frozenset(os.sched_getaffinity(0))
    assert len(allowed) >= 2, "pinning is only visible with two CPUs or more (CI has two)"
    cpu = max(allowed)

    def two_processes(req):
        req["launch"]["units"][0]["command"] += ["--engine-core-process", "--bind-cpus", str(cpu)]

    def thread_cpus(pid: int) -> set[frozenset[int]]:
        return {affinity.thread_cpus(int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()}

    wl = Workload(state_root, tiny_model, env_digest, tp=1, name="core-child")
    try:
        res = wl.run(wl.request("capture", mutate=two_processes))
        assert res.succeeded, res.receipt["error"]
        artifact = Path(res.receipt["result"]["operation"]["artifact"])
        art = load_artifact(artifact.read_bytes())
        ev = json.loads((state_root / "captures" / art["capture_id"] / "units" / "unit-0" / "evidence.json")
                        .read_text())
        worker = ev["workers"][0]
        assert worker["memory_at_checkpoint"]["processes"] == 2 and worker["cuda_pids"] == []
        control = json.loads((state_root / "captures" / art["capture_id"] / "units" / "unit-0" / "control"
                              / "worker-0.json").read_text())
        assert control["pid"] != worker["pid"], "the control API is the child's"
        pins = worker["affinity"]
        assert pins["inherited"] == format_cpus(allowed)
        assert pins["threads"] and set(pins["threads"].values()) == {str(cpu)}
        assert str(control["pid"]) in pins["threads"] and str(worker["pid"]) not in pins["threads"]
        assert not wl.engines()

        new_port = another_free_port(wl.port)

        def moved(req):
            two_processes(req)
            on_port(new_port)(req)

        res = wl.run(wl.request("restore", artifact=artifact, mutate=moved))
        assert res.succeeded, res.receipt["error"]
        unit0 = units_of(res.receipt)[0]
        assert unit0["reply"] == art["acceptance"]["reply"] and unit0["logprobs_check"] == "identical"
        root = unit0["workers"][0]["pid"]
        assert root == worker["pid"] and wl.engines() == [control["pid"]]
        children = Path(f"/proc/{root}/task/{root}/children").read_text().split()
        assert children == [str(control["pid"])], "the engine core is the API server's child again"
        assert thread_cpus(control["pid"]) == {frozenset({cpu})} and thread_cpus(root) == {allowed}
        step = next(s for s in res.receipt["timing"]["spans"] if s["name"] == "unit.criu.restore")
        assert step["attrs"]["affinity"] == {"pinned": len(pins["threads"]), "narrowed": 0, "unpinned": 0, "gone": 0}
        assert "libtorch" not in Path(f"/proc/{root}/maps").read_text(), "the API server never loads torch"
        assert wl.complete(port=new_port) == art["acceptance"]["reply"]
    finally:
        wl.stop()
