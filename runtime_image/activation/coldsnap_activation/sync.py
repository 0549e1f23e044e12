"""Cross-unit phases through the activation's coordinator.

Each phase is the coordinator's barrier (``coord.barrier``: its documented keys, a unit
index that arrives twice refused) that also watches an ``abort`` key while it waits: a unit
that fails publishes why, and every other unit stops at its next phase with that reason
instead of waiting out a timeout.
"""

from __future__ import annotations

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import UnitError
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.barrier import (
    BarrierError,
    BarrierTimeout,
    barrier,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.client import CoordinatorClient

ABORT_KEY = "activation/abort"


class Phases:
    """Barriers between the units of one activation (rank = unit index)."""

    def __init__(self, endpoint_file: str | None, *, rank: int, world: int, unit: str) -> None:
        self.rank = rank
        self.world = world
        self.unit = unit
        self.client = CoordinatorClient.from_file(endpoint_file) if endpoint_file else None

    def wait(self, name: str, timeout: float) -> None:
        """Arrive at phase ``name`` and wait for every unit (or an abort)."""
        if self.client is None or self.world == 1:
            return
        try:
            barrier(self.client, name, self.rank, self.world, timeout, poll=self._check_abort)
        except BarrierTimeout as exc:
            raise UnitError(f"unit {self.unit}: phase {name!r} timed out after {timeout:.0f}s waiting for "
                            f"unit index(es) {exc.missing}", fix="check those units' logs") from None
        except BarrierError as exc:
            raise UnitError(f"unit {self.unit}: phase {name!r}: {exc.problem}", fix=exc.fix) from None

    def _check_abort(self) -> None:
        reason = self.client.try_get(ABORT_KEY)
        if reason is not None:
            raise UnitError(f"unit {self.unit}: stopped because another unit failed: {reason.decode(errors='replace')}")

    def abort(self, reason: str) -> None:
        """Tell every unit of the activation to stop (best effort)."""
        if self.client is None:
            return
        try:
            if self.client.try_get(ABORT_KEY) is None:
                self.client.set(ABORT_KEY, f"unit {self.unit}: {reason}"[:4000])
        except Exception:  # the coordinator itself may be the problem; the caller still fails
            pass

    def publish(self, key: str, value: bytes) -> None:
        if self.client is not None:
            self.client.set(f"activation/{key}", value)

    def fetch(self, key: str, timeout: float) -> bytes | None:
        if self.client is None:
            return None
        return self.client.get(f"activation/{key}", timeout=timeout)
