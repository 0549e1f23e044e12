"""A floor under a download's throughput, for the registry client and the peer transfer alike.

A read timeout bounds each read only: a source (or something between) that sends a byte now and then
never reaches it and holds the download, and whatever lock it holds, for as long as it keeps trickling.
A download is too slow once fewer than ``MIN_RATE`` bytes a second came over a span of at least
``window`` seconds (the caller's read timeout): 32 KiB a second, about 1.9 MiB a minute.
"""

from __future__ import annotations

import time

MIN_RATE = 32 << 10  # bytes a second


class RateFloor:
    """Counts one download's bytes as they come; says when a span of ``window`` seconds fell below the floor."""

    def __init__(self, window: float, min_rate: float = MIN_RATE) -> None:
        self.window, self.min_rate = window, min_rate
        self._since, self._got = time.monotonic(), 0

    def count(self, n: int) -> str | None:
        """Count ``n`` bytes just received: what fell short ("N bytes in S s, under ...") when the span
        since the last check is at least ``window`` seconds long and brought too little, else None."""
        self._got += n
        now = time.monotonic()
        span = now - self._since
        if span < self.window:
            return None
        got, self._since, self._got = self._got, now, 0
        if got >= self.min_rate * span:
            return None
        return (f"{got} bytes in {span:.1f} s, under the floor of {self.min_rate / 1024:g} KiB a second "
                f"(a stalled or throttled source)")
