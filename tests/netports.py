"""Ports for test engines: free now, and outside the kernel's ephemeral range, so that no outgoing
connection of another process can take a captured listener's port before the restore binds it again
(a port handed out by ``bind(0)`` is an ephemeral one). Also: another free port near a captured one, for a
restore onto another port, and a stranger's process holding a port."""

from __future__ import annotations

import contextlib
import random
import socket
import subprocess
import sys

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.listen_ports import restorable_ports


def free_port(host: str = "127.0.0.1") -> int:
    for candidate in restorable_ports(256):
        with socket.socket() as s:
            try:
                s.bind((host, candidate))
            except OSError:
                continue
            return candidate
    raise RuntimeError("no free port outside the ephemeral range")


def free_port_in(ports) -> int:
    """A free loopback port of ``ports`` (an iterable of port numbers), tried in a random order."""
    candidates = list(ports)
    random.shuffle(candidates)
    for candidate in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", candidate))
            except OSError:
                continue
        return candidate
    raise RuntimeError(f"no free port among {len(candidates)} tried")


def another_free_port(port: int, *, spread: int = 400) -> int:
    """A free loopback port within ``spread`` of ``port`` (never ``port`` itself), for a restore onto another
    port: every listener of the unit moves by the serving port's shift, so a port far away would often send
    the engine's control listener around the wrap (tested on purpose in test_placement, not everywhere)."""
    return free_port_in(p for p in range(max(1024, port - spread), min(65535, port + spread) + 1) if p != port)


@contextlib.contextmanager
def squatting(addr: str, port: int):
    """A stranger's process listening on ``addr:port`` for the duration."""
    squatter = subprocess.Popen([sys.executable, "-c", (
        "import socket,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
        f"s.bind(({addr!r}, {port})); s.listen(); print('up', flush=True); time.sleep(120)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout.readline().strip() == "up"
        yield squatter
    finally:
        squatter.kill()
        squatter.wait()
