"""CSKV coordinator benchmark: ops/s and p99 latency on loopback, barrier completion time.

Every figure is reported next to a baseline measured in the same run:

* request ops (set / get / add): C client processes, one TCP connection per
  request (as the real client works), against the coordinator running as its
  own process; the baseline is a bare TCP round trip (connect, send the same
  request frame, read 12 bytes, close) against a minimal single-threaded
  selectors echo server, also in Python, with the same client processes;
* barriers for 2, 8 and 64 rank processes: completion time (first rank enters
  -> last rank leaves), reported in units of the baseline round trip and of the
  measured ``add`` latency.

    python bench/bench_coordinator.py [--seconds 1] [--rounds 3] [--clients 4] [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.coord import protocol as p
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.barrier import barrier
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.client import CoordinatorClient
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.daemon import SERVER_MODULE
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.endpoint import (
    EndpointDescriptor,
    read_endpoint,
)

VALUE = b"v" * 16


# -- servers -----------------------------------------------------------------------------------


def echo_server(port_file: str) -> None:
    """Baseline: accept, read one request's bytes, answer a 12-byte OK header, close."""
    reply = p.encode_response(p.Status.OK)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    listener.setblocking(False)
    Path(port_file).write_text(str(listener.getsockname()[1]))
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, None)
    while True:
        for key, _events in sel.select():
            if key.data is None:
                while True:
                    try:
                        conn, _addr = listener.accept()
                    except BlockingIOError:
                        break
                    conn.setblocking(False)
                    sel.register(conn, selectors.EVENT_READ, bytearray())
                continue
            conn, buf = key.fileobj, key.data
            try:
                chunk = conn.recv(65536)
            except BlockingIOError:
                continue
            buf += chunk
            whole = len(buf) >= p.REQUEST_HEADER_SIZE and (
                len(buf) >= p.REQUEST_HEADER_SIZE + int.from_bytes(buf[24:28], "big"))
            if not chunk or whole:
                sel.unregister(conn)
                if whole:
                    conn.send(reply)
                conn.close()


def start_process(args: list[str], ready_file: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not ready_file.exists() or not ready_file.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"benchmark server {args} did not start")
        time.sleep(0.02)
    return proc


# -- request load ------------------------------------------------------------------------------


def raw_round_trip(port: int, frame: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(frame)
        p.recv_exact(sock, p.RESPONSE_HEADER_SIZE)


def load_worker(kind: str, target: dict, worker: int, *, seconds: float, start_at: float, out) -> None:
    """One client process: run ``kind`` requests back to back for ``seconds``; report latencies."""
    endpoint = EndpointDescriptor(**target["endpoint"]) if "endpoint" in target else None
    client = CoordinatorClient(endpoint) if endpoint else None
    key = f"bench/{worker}"
    if client is not None:
        client.set(key, VALUE)
    frame = p.encode_request(p.Op.SET, b"t" * 64, key, VALUE)
    latencies = []
    while time.time() < start_at:
        time.sleep(0.001)
    stop = time.perf_counter() + seconds
    first = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        if t0 >= stop:
            break
        if kind == "baseline":
            raw_round_trip(target["port"], frame)
        elif kind == "set":
            client.set(key, VALUE)
        elif kind == "get":
            client.get(key)
        elif kind == "add":
            client.add("bench/counter", 1)
        latencies.append(time.perf_counter() - t0)
    out.put((worker, first, time.perf_counter(), latencies))


def run_load(kind: str, target: dict, clients: int, seconds: float) -> dict:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    start_at = time.time() + 0.5
    procs = [ctx.Process(target=load_worker, args=(kind, target, w),
                         kwargs={"seconds": seconds, "start_at": start_at, "out": out})
             for w in range(clients)]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=seconds + 60) for _proc in procs]
    for proc in procs:
        proc.join()
    wall = max(r[2] for r in results) - min(r[1] for r in results)
    return {"wall": wall, "latencies": [x for r in results for x in r[3]]}


def summarize(phases: list[dict]) -> dict:
    """Pool the rounds of one op: total ops over total wall time, percentiles of all latencies."""
    latencies = sorted(x for ph in phases for x in ph["latencies"])
    wall = sum(ph["wall"] for ph in phases)
    return {
        "ops": len(latencies),
        "ops_per_s": len(latencies) / wall,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
    }


# -- barriers ----------------------------------------------------------------------------------


def rank_worker(endpoint: dict, world: int, rank: int, *, reps: int, line_up, out) -> None:
    client = CoordinatorClient(EndpointDescriptor(**endpoint), io_timeout=120)
    for rep in range(reps):
        line_up.wait()
        t0 = time.monotonic()
        barrier(client, f"bench/{world}/{rep}", rank, world, 120)
        out.put((rep, t0, time.monotonic()))


def run_barrier(endpoint: dict, world: int, reps: int) -> list[float]:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    line_up = ctx.Barrier(world)
    procs = [ctx.Process(target=rank_worker, args=(endpoint, world, r),
                         kwargs={"reps": reps, "line_up": line_up, "out": out}) for r in range(world)]
    for proc in procs:
        proc.start()
    per_rep: dict[int, list[tuple[float, float]]] = {}
    for _i in range(world * reps):
        rep, t0, t1 = out.get(timeout=300)
        per_rep.setdefault(rep, []).append((t0, t1))
    for proc in procs:
        proc.join()
    # Completion: the first rank enters -> the last rank leaves.
    return [max(t1 for _t0, t1 in v) - min(t0 for t0, _t1 in v) for _rep, v in sorted(per_rep.items())]


# -- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="duration of each request-load phase")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds of baseline/set/get/add (spreads noise over all of them)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent client processes")
    parser.add_argument("--reps", type=int, default=5, help="barrier repetitions per world size")
    parser.add_argument("--worlds", default="2,8,64")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--echo-server", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.echo_server:
        echo_server(args.echo_server)
        return 0

    with tempfile.TemporaryDirectory(prefix="cskv-bench-") as tmp:
        tmpdir = Path(tmp)
        endpoint_file = tmpdir / "endpoint.json"
        coord = start_process(["-m", SERVER_MODULE, "--endpoint-file", str(endpoint_file), "--scope", "bench",
                               "--max-connections", "1024"], endpoint_file)
        echo_port_file = tmpdir / "echo.port"
        echo = start_process([__file__, "--echo-server", str(echo_port_file)], echo_port_file)
        try:
            descriptor = read_endpoint(endpoint_file)
            CoordinatorClient(descriptor).health(wait_s=10)
            endpoint = {"address": descriptor.address, "port": descriptor.port, "scope": descriptor.scope,
                        "token": descriptor.token}
            results: dict = {"clients": args.clients, "seconds": args.seconds * args.rounds, "ops": {},
                             "barrier": {}}
            targets = {"baseline": {"port": int(echo_port_file.read_text())}, "set": {"endpoint": endpoint},
                       "get": {"endpoint": endpoint}, "add": {"endpoint": endpoint}}
            phases: dict[str, list[dict]] = {kind: [] for kind in targets}
            for _i in range(args.rounds):
                for kind, target in targets.items():
                    phases[kind].append(run_load(kind, target, args.clients, args.seconds))
            results["ops"] = {kind: summarize(ph) for kind, ph in phases.items()}
            for world in (int(w) for w in args.worlds.split(",")):
                times = run_barrier(endpoint, world, args.reps)
                results["barrier"][world] = {"median_ms": 1000 * statistics.median(times),
                                             "max_ms": 1000 * max(times), "reps": len(times)}
        finally:
            for proc in (coord, echo):
                proc.terminate()
                proc.wait(30)
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def report(results: dict) -> None:
    base = results["ops"]["baseline"]
    add = results["ops"]["add"]
    print(f"host: {platform.node()} ({os.cpu_count()} CPUs), Python {platform.python_version()}, "
          f"{results['clients']} client processes, {results['seconds']:g} s per op (interleaved rounds)")
    print()
    print("| op | ops/s | p50 ms | p99 ms | ops/s vs baseline | p99 vs baseline |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for kind, r in results["ops"].items():
        print(f"| {kind} | {r['ops_per_s']:.0f} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | "
              f"{r['ops_per_s'] / base['ops_per_s']:.2f}x | {r['p99_ms'] / base['p99_ms']:.2f}x |")
    print()
    print("| ranks | barrier median ms | max ms | median / baseline p50 RTT | median / add p50 |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for world, r in results["barrier"].items():
        print(f"| {world} | {r['median_ms']:.2f} | {r['max_ms']:.2f} | {r['median_ms'] / base['p50_ms']:.1f}x | "
              f"{r['median_ms'] / add['p50_ms']:.1f}x |")


if __name__ == "__main__":
    sys.exit(main())
