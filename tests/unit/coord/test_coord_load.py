"""FAULTS.md 17: 100 concurrent clients for a bounded time against a real server process."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.client import CoordinatorClient
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.daemon import SERVER_MODULE
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.endpoint import read_endpoint

CLIENTS = 100
ROUND_SECONDS = 1.5


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def server_process(tmp_path):
    endpoint_file = tmp_path / "endpoint.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", SERVER_MODULE, "--endpoint-file", str(endpoint_file), "--scope", "load"],
        stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not endpoint_file.exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        yield proc, read_endpoint(endpoint_file)
    finally:
        proc.terminate()
        proc.wait(30)


def run_round(client: CoordinatorClient, round_no: int) -> tuple[list[int], list[str], list[str]]:
    adds: list[list[int]] = [[] for _i in range(CLIENTS)]
    appended: list[list[str]] = [[] for _i in range(CLIENTS)]
    failures: list[str] = []
    start = threading.Barrier(CLIENTS)
    stop_at = [0.0]

    def worker(i: int) -> None:
        try:
            start.wait()
            j = 0
            while time.monotonic() < stop_at[0]:
                adds[i].append(client.add("counter", 1))
                item = f"{round_no}.{i}.{j}"
                client.append("log", item + ";")
                appended[i].append(item)
                client.set(f"key/{i}", item)
                got = client.get(f"key/{i}")
                if got != item.encode():
                    failures.append(f"client {i}: get returned {got!r}, expected {item!r}")
                j += 1
        except Exception as exc:
            failures.append(f"client {i}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(CLIENTS)]
    stop_at[0] = time.monotonic() + ROUND_SECONDS + 5  # provisional, reset once all are running
    for t in threads:
        t.start()
    stop_at[0] = time.monotonic() + ROUND_SECONDS
    for t in threads:
        t.join(120)
    assert not failures, failures[:5]
    log = client.get("log").decode()
    assert log.endswith(";")
    stored = log[:-1].split(";")
    return [n for per in adds for n in per], stored, [x for per in appended for x in per]


def test_concurrent_clients_lose_nothing(server_process) -> None:
    proc, endpoint = server_process
    client = CoordinatorClient(endpoint, io_timeout=60)
    client.health(wait_s=10)
    rss = []
    total = 0
    for round_no in range(2):
        adds, stored, appended = run_round(client, round_no)
        # Every add result unique and contiguous: together they are exactly total+1 .. total+n.
        assert sorted(adds) == list(range(total + 1, total + len(adds) + 1))
        total += len(adds)
        # No append lost, none duplicated, none invented.
        assert collections.Counter(stored) == collections.Counter(appended)
        assert len(stored) == len(appended) > CLIENTS
        assert client.delete("log")
        rss.append(rss_bytes(proc.pid))
        print(f"round {round_no}: {len(adds)} adds, server RSS {rss[-1] / 2**20:.1f} MiB")
    assert int(client.get("counter")) == total
    # Flat memory: the second round (same key set, log deleted) must not grow the server.
    assert rss[1] - rss[0] < 8 * 1024 * 1024, rss
    assert os.path.exists(f"/proc/{proc.pid}")
