"""The floor under a download's throughput (common.rate), shared by the registry client and the peer
transfer: judged over spans of the read timeout, never on one slow read."""

from __future__ import annotations

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common import rate


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(rate.time, "monotonic", lambda: now[0])
    return now


def test_a_span_shorter_than_the_window_is_never_judged(clock):
    floor = rate.RateFloor(10.0)
    for _second in range(9):
        clock[0] += 1.0
        assert floor.count(1) is None  # 9 bytes in 9 s: too few, but the span is not over


def test_a_span_that_brought_the_floor_passes_and_the_next_one_starts_empty(clock):
    floor = rate.RateFloor(10.0)
    clock[0] += 10.0
    assert floor.count(rate.MIN_RATE * 10) is None
    clock[0] += 10.0
    slow = floor.count(rate.MIN_RATE * 10 - 1)  # what the last span brought counts for it alone
    assert slow == (f"{rate.MIN_RATE * 10 - 1} bytes in 10.0 s, under the floor of 32 KiB a second "
                    "(a stalled or throttled source)")


def test_a_trickle_is_caught_at_the_first_read_past_the_window(clock):
    floor = rate.RateFloor(1.0, min_rate=1024)
    clock[0] += 0.5
    assert floor.count(10) is None
    clock[0] += 0.6
    assert floor.count(10).startswith("20 bytes in 1.1 s, under the floor of 1 KiB a second")
