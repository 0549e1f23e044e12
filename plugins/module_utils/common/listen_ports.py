"""Ports a listener can count on getting back: a restore binds every captured listener again, at
its captured port, so a listener the engine opens for itself should not take a port that any
outgoing connection on the host may be using by then."""

from __future__ import annotations

import random
from pathlib import Path


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (``ip_local_port_range``)."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2])
    except (OSError, ValueError):
        low, high = 32768, 60999
    return low, high


def restorable_ports(count: int = 64, *, floor: int = 10000) -> list[int]:
    """``count`` random candidates for a listener that a restore must bind again: ports outside the
    ephemeral range. A listener bound to port 0 gets an ephemeral port, which any outgoing connection of
    any process may hold by the time its capture is restored; a port outside that range can be held only
    by another listener. An empty list when the range leaves none."""
    low, high = ephemeral_range()
    pool = [p for p in range(floor, 65536) if p < low or p > high]
    return random.sample(pool, min(count, len(pool)))
