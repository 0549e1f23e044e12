"""Two tensor-parallel ranks of the reference engine (real gloo through a real CSKV coordinator):
a follower's sleep never frees weights a collective of rank 0's may still read. It waits until
rank 0, paused, parks it (its generation in flight finished), in whatever order the ranks are
asked — the activation asks them all at once, other units' ranks on other hosts too."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("torch")

from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.daemon import (
    start_coordinator,
    stop_coordinator,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import engine_control as ec
from ansible_collections.coldsnap.fleet.plugins.module_utils.process.engine_client import EngineClient
from engines_testlib import REPO, free_port, make_reference_model

sys.path.insert(0, str(REPO / "runtime_image" / "activation"))
from coldsnap_activation import probes

PROMPT = "ColdSnap says:"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("followers")
    model_dir = tmp / "reference-tiny"
    make_reference_model(model_dir)
    endpoint = tmp / "coord" / "endpoint.json"
    start_coordinator(endpoint, scope="followers-test")
    port = free_port()
    procs = []
    try:
        for rank in (0, 1):
            env = {k: v for k, v in os.environ.items() if not k.startswith("COLDSNAP_")}
            env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
                [str(REPO / "runtime_image" / "integrations"), env.get("PYTHONPATH", "")]))
            env.update({ec.ENV_RANK: str(rank), ec.ENV_WORLD_SIZE: "2", ec.ENV_COORDINATOR: str(endpoint),
                        ec.ENV_CONTROL_FILE: str(tmp / f"control-{rank}.json")})
            with open(tmp / f"rank{rank}.log", "wb") as fh:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "coldsnap_engines.reference.server", "--model", str(model_dir),
                     "--port", str(port), "--device", "cpu"], env=env, stdout=fh, stderr=subprocess.STDOUT))
        probes.wait_http_ready("127.0.0.1", port, "/health", timeout=180,
                               alive=lambda: all(p.poll() is None for p in procs))
        yield {"port": port, "tmp": tmp, "procs": procs}
    finally:
        for p in procs:
            p.kill()
            p.wait()
        stop_coordinator(endpoint)


def control(ranks, rank: int) -> EngineClient:
    return EngineClient(ec.ControlInfo.load(ranks["tmp"] / f"control-{rank}.json"))


def state(ranks, rank: int) -> str:
    return control(ranks, rank).call("GET", ec.STATUS, None, timeout=30)["state"]


def complete(ranks, max_tokens: int) -> str:
    return probes.stream_completion("127.0.0.1", ranks["port"], model="", prompt=PROMPT, max_tokens=max_tokens,
                                    timeout=120).text


def test_a_follower_asked_to_sleep_first_waits_for_rank_0_and_its_generation_in_flight(ranks):
    expected = complete(ranks, 96)  # undisturbed: what both ranks compute together
    assert complete(ranks, 96) == expected

    got: dict[str, object] = {}

    def generate():
        got["text"] = complete(ranks, 96)

    def sleep_follower():
        try:
            got["follower"] = control(ranks, 1).call("POST", ec.SLEEP, None, timeout=120)
        except Exception as exc:  # surfaced below
            got["follower"] = exc

    gen = threading.Thread(target=generate)
    gen.start()
    follower = threading.Thread(target=sleep_follower)
    follower.start()
    # While rank 0 has not been asked, the follower keeps its weights: it stays ready, its sleep pending.
    for _look in range(20):
        assert state(ranks, 1) == ec.READY, "the follower released its memory before rank 0 parked it"
        time.sleep(0.05)
    assert follower.is_alive()
    control(ranks, 0).call("POST", ec.SLEEP, None, timeout=120)
    follower.join(120)
    gen.join(120)
    assert not isinstance(got["follower"], Exception), got["follower"]
    assert got["text"] == expected, "the generation in flight finished on both ranks' weights"
    assert [state(ranks, r) for r in (0, 1)] == [ec.SLEEPING, ec.SLEEPING]
    assert control(ranks, 1).call("GET", ec.STATUS, None, timeout=30).get("last_error") is None
