"""Barrier and rendezvous over a real server: threads and separate processes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.barrier import (
    BarrierError,
    BarrierTimeout,
    barrier,
    barrier_key,
    rendezvous,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.endpoint import write_endpoint
from cskv_testlib import client_for

RANK_PROGRAM = """
import json, sys
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.barrier import barrier, BarrierTimeout
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.client import CoordinatorClient
client = CoordinatorClient.from_file(sys.argv[1])
name, rank, world, timeout = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
out = {"rank": rank}
for phase in range(2):  # two phases: every rank must leave the first before the second can complete
    try:
        out[f"order{phase}"] = barrier(client, f"{name}/{phase}", rank, world, timeout)
    except BarrierTimeout as exc:
        out["missing"] = exc.missing
        out["error"] = str(exc)
        break
print(json.dumps(out))
"""


def run_threads(client, name: str, ranks, world: int, timeout: float) -> dict:
    results: dict = {}

    def rank_main(rank: int) -> None:
        try:
            results[rank] = barrier(client, name, rank, world, timeout)
        except Exception as exc:
            results[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_two_ranks_in_threads(client) -> None:
    results = run_threads(client, "two", range(2), 2, 30)
    assert sorted(results.values()) == [1, 2]


def test_eight_ranks_in_processes(server, tmp_path) -> None:
    endpoint_file = write_endpoint(tmp_path / "endpoint.json", client_for(server).endpoint)
    procs = [
        subprocess.Popen([sys.executable, "-c", RANK_PROGRAM, str(endpoint_file), "eight", str(r), "8", "60"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(8)
    ]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outputs.append(json.loads(out))
    assert [o["rank"] for o in outputs] == list(range(8))
    for phase in range(2):
        assert sorted(o[f"order{phase}"] for o in outputs) == list(range(1, 9))
    client = client_for(server)
    assert int(client.get(barrier_key("eight/1", "arrived/0@8"))) == 8 * 2**32 + 0x5555  # 8 fields of 1


def test_timeout_names_the_missing_ranks(client) -> None:
    results = run_threads(client, "partial", [0, 2], 4, 0.5)
    for rank in (0, 2):
        exc = results[rank]
        assert isinstance(exc, BarrierTimeout)
        assert exc.missing == [1, 3] and exc.arrived == 2
        assert "missing ranks 1, 3" in str(exc) and "2 of 4" in str(exc)


def test_timeout_in_a_process_names_the_missing_rank(server, tmp_path) -> None:
    endpoint_file = write_endpoint(tmp_path / "endpoint.json", client_for(server).endpoint)
    out = subprocess.run([sys.executable, "-c", RANK_PROGRAM, str(endpoint_file), "lonely", "1", "2", "0.3"],
                         capture_output=True, text=True, timeout=60, check=True)
    result = json.loads(out.stdout)
    assert result["missing"] == [0] and "missing rank 0" in result["error"]


def test_late_rank_still_releases_everyone(client) -> None:
    first: dict = {}
    t = threading.Thread(target=lambda: first.update(r=barrier(client, "late", 0, 2, 30)))
    t.start()
    assert barrier(client, "late", 1, 2, 30) in (1, 2)
    t.join(30)
    assert first["r"] in (1, 2)


def test_duplicate_rank_and_reused_name_are_errors(client) -> None:
    assert barrier(client, "solo", 0, 1, 5) == 1
    with pytest.raises(BarrierError, match="rank 0 arrived more than once"):
        barrier(client, "solo", 0, 1, 5)
    assert sorted(run_threads(client, "pair", range(2), 2, 10).values()) == [1, 2]
    # A rank that believes in a bigger world is never released by the smaller one.
    with pytest.raises(BarrierTimeout, match=r"rank 2 of a world of 3.*the same world size") as exc:
        barrier(client, "pair", 2, 3, 0.3)
    assert exc.value.missing == [0, 1]  # they passed as a world of 2


class Stop(Exception):
    pass


def test_poll_runs_while_waiting_and_its_exception_ends_the_wait(client, monkeypatch) -> None:
    monkeypatch.setattr("ansible_collections.coldsnap.fleet.plugins.module_utils.coord.barrier.POLL_SLICE", 0.05)
    calls = []

    def poll() -> None:
        calls.append(time.monotonic())
        if len(calls) == 4:
            raise Stop("another unit failed")

    started = time.monotonic()
    with pytest.raises(Stop):
        barrier(client, "watched", 0, 2, 30, poll=poll)
    # four slices of 50 ms, not the 30-s timeout
    assert len(calls) == 4 and time.monotonic() - started < 5
    # the rank registered before it waited: its second arrival is still a duplicate
    with pytest.raises(BarrierError, match="rank 0 arrived more than once"):
        barrier(client, "watched", 0, 2, 1)


def test_poll_waits_for_the_release_and_times_out_naming_the_missing(client, monkeypatch) -> None:
    monkeypatch.setattr("ansible_collections.coldsnap.fleet.plugins.module_utils.coord.barrier.POLL_SLICE", 0.05)
    calls = []
    t = threading.Timer(0.3, lambda: barrier(client, "sliced", 1, 2, 30))
    t.start()
    assert barrier(client, "sliced", 0, 2, 30, poll=lambda: calls.append(1)) == 1
    t.join(30)
    assert len(calls) >= 2  # it waited over several slices and was released, not timed out
    with pytest.raises(BarrierTimeout, match="missing rank 1") as exc:
        barrier(client, "sliced-alone", 0, 2, 0.3, poll=lambda: None)
    assert exc.value.missing == [1]


BAD_ARGUMENTS = [(-1, 2, 1), (2, 2, 1), (0, 0, 1), (0, 2, 0), (True, 2, 1),
                 (0, 2, float("nan")), (0, 2, float("inf")), (0, 2, "1")]


@pytest.mark.parametrize(("rank", "world", "timeout"), BAD_ARGUMENTS)
def test_bad_arguments(client, rank, world, timeout) -> None:
    with pytest.raises(BarrierError):
        barrier(client, "args", rank, world, timeout)
    # refused before this rank registered: the same rank with a good timeout is not a "duplicate"
    assert not [k for k in ("arrived/0@2", "arrived/0@0", "arrived/0@1") if client.try_get(barrier_key("args", k))]


def test_rendezvous_exchanges_values_in_rank_order(client) -> None:
    results: dict = {}

    def rank_main(rank: int) -> None:
        results[rank] = rendezvous(client, "addrs", rank, 3, f"10.0.0.{rank}:2950{rank}".encode(), timeout=30)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (2, 0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    expected = [b"10.0.0.0:29500", b"10.0.0.1:29501", b"10.0.0.2:29502"]
    assert results == {0: expected, 1: expected, 2: expected}


def test_a_rendezvous_name_too_long_for_its_barrier_is_refused_before_its_value_is_published(client) -> None:
    """The rendezvous's barrier is named ``rendezvous:<name>``: a name that fits the limit alone but
    not with that prefix is refused up front (naming the limit), and no value is left behind."""
    name = "n" * 1020
    with pytest.raises(BarrierError, match=r"too long.*rendezvous names within 1013"):
        rendezvous(client, name, 0, 1, b"v", timeout=5)
    assert client.try_get(f"rendezvous/{name}/0") is None
    assert rendezvous(client, "n" * 1013, 0, 1, b"v", timeout=5) == [b"v"]
    with pytest.raises(BarrierError, match=r"1 character too long"):
        barrier(client, "b" * 1025, 0, 1, 5)


def test_a_world_too_large_to_scan_is_refused_by_name() -> None:
    from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.barrier import MAX_WORLD

    with pytest.raises(BarrierError, match=f"world {MAX_WORLD + 1} must be an int in 1..{MAX_WORLD}"):
        barrier(None, "huge", 0, MAX_WORLD + 1, 1)
