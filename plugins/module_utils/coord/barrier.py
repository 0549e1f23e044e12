"""Barrier and rendezvous over CSKV: N ranks arrive, all leave together, or a clear error.

Keys used by ``barrier(client, name, rank, world, timeout)`` (all under
``barrier/<name>/``):

* ``rank/<r>``: each rank ``add``s 1 to its own key first. The result must be 1:
  a second arrival of the same rank (a duplicated process, a reused name) is an
  error instead of a silent miscount. These keys also say who arrived when the
  barrier times out.
* ``count@<world>``: then each rank ``add``s 1; the rank that brings it to
  ``world`` sets ``release@<world>``. The world size is part of both keys, so ranks that
  disagree on it never release each other early (they time out instead).
* ``release@<world>``: every rank waits for it with a blocking ``get``.

A barrier name is single-use within one activation: name each phase uniquely
(``criu-restore``, ``cuda-restore``, ``transport/2``...). Timeouts end with a
``BarrierTimeout`` that names the ranks that never arrived. A caller that must also
watch something else while it waits (the activation's abort key) passes ``poll``: the
wait is then cut into slices of at most ``POLL_SLICE`` seconds and ``poll()`` runs
before each; whatever it raises ends the wait.

Every step is one short TCP request (client.py): no connection or thread
outlives the call, so a rank may be checkpointed between barriers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.client import (
    CoordinatorClient,
    CoordinatorError,
    CoordinatorTimeout,
)

RELEASE_VALUE = b"released"
POLL_SLICE = 1.0  # seconds a blocking wait lasts between two poll() calls
_MAX_LISTED = 32  # missing ranks listed by number in a message; the rest are counted


class BarrierError(CoordinatorError):
    """A barrier was misused (bad rank/world, duplicate arrival, reused name)."""


class BarrierTimeout(CoordinatorTimeout):
    """Not every rank arrived in time; ``missing`` lists the ranks that did not."""

    def __init__(self, message: str, *, fix: str, missing: Sequence[int], arrived: int) -> None:
        super().__init__(message, fix=fix)
        self.missing = list(missing)
        self.arrived = arrived


def barrier_key(name: str, part: str) -> str:
    """The CSKV key of one part of barrier ``name`` (documented, so other clients can join)."""
    return f"barrier/{name}/{part}"


def barrier(client: CoordinatorClient, name: str, rank: int, world: int, timeout: float, *,
            poll: Callable[[], None] | None = None) -> int:
    """Block until all ``world`` ranks reached barrier ``name``; return this rank's arrival order (1..world).

    Raises BarrierTimeout naming the missing ranks when ``timeout`` seconds pass
    first, and BarrierError for a duplicate rank or a reused name. ``poll`` (optional)
    runs before every wait slice (module doc); an exception from it propagates.
    """
    _check_args(name, rank, world, timeout)
    deadline = time.monotonic() + timeout
    mine = client.add(barrier_key(name, f"rank/{rank}"), 1)
    if mine != 1:
        raise BarrierError(
            f"barrier {name!r}: rank {rank} arrived {mine} times",
            fix="give every process a distinct rank, and every barrier phase a unique name",
        )
    order = client.add(barrier_key(name, f"count@{world}"), 1)
    if order > world:
        raise BarrierError(
            f"barrier {name!r}: {order} arrivals for a world of {world}",
            fix="use the same world size on every rank and a new barrier name for each phase",
        )
    if order == world:
        client.set(barrier_key(name, f"release@{world}"), RELEASE_VALUE)
        return order
    try:
        _wait_release(client, barrier_key(name, f"release@{world}"), deadline, poll)
    except CoordinatorTimeout:
        # The release may have landed right at the deadline: look once more.
        if client.try_get(barrier_key(name, f"release@{world}")) is not None:
            return order
        missing = missing_ranks(client, name, world)
        raise BarrierTimeout(
            f"barrier {name!r} timed out after {timeout:g}s with {world - len(missing)} of {world} ranks: "
            f"missing {_list(missing)} (this is rank {rank})",
            fix="check the missing ranks' processes and logs, or raise the timeout",
            missing=missing,
            arrived=world - len(missing),
        ) from None
    return order


def _wait_release(client: CoordinatorClient, key: str, deadline: float, poll: Callable[[], None] | None) -> None:
    """Wait for ``key`` until ``deadline`` (CoordinatorTimeout after it), calling ``poll`` between slices."""
    while True:
        if poll is not None:
            poll()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CoordinatorTimeout("no time left")
        try:
            client.get(key, timeout=remaining if poll is None else min(POLL_SLICE, remaining))
            return
        except CoordinatorTimeout:
            if poll is None or time.monotonic() >= deadline:
                raise


def rendezvous_key(name: str, rank: int) -> str:
    """The CSKV key holding rank ``rank``'s value in rendezvous ``name``."""
    return f"rendezvous/{name}/{rank}"


def missing_ranks(client: CoordinatorClient, name: str, world: int) -> list[int]:
    """Ranks of barrier ``name`` that have not registered (one short request per rank)."""
    return [r for r in range(world) if client.try_get(barrier_key(name, f"rank/{r}")) is None]


def rendezvous(
    client: CoordinatorClient, name: str, rank: int, world: int, value: bytes, *, timeout: float
) -> list[bytes]:
    """Publish ``value`` for this rank, wait for all ranks, return every rank's value in rank order.

    Used to exchange fresh transport endpoints (e.g. a new master address/port
    after restore) without any rank needing to know where the others run.
    """
    _check_args(name, rank, world, timeout)
    _check_args(f"rendezvous:{name}", rank, world, timeout, shown=name)  # its barrier's name, before the set
    deadline = time.monotonic() + timeout
    client.set(rendezvous_key(name, rank), value)
    barrier(client, f"rendezvous:{name}", rank, world, max(0.001, deadline - time.monotonic()))
    values = []
    for r in range(world):
        got = client.try_get(rendezvous_key(name, r))
        if got is None:  # only a misbehaving peer that deleted its value gets here
            raise BarrierError(
                f"rendezvous {name!r}: rank {r} passed the barrier without a value",
                fix="do not delete rendezvous keys while the activation runs",
            )
        values.append(got)
    return values


_MAX_NAME = 1024


def _check_args(name: str, rank: int, world: int, timeout: float, *, shown: str | None = None) -> None:
    if not isinstance(name, str) or not name or not name.isprintable():
        raise BarrierError(f"barrier name {name!r} is empty or malformed",
                           fix="give a short printable phase name, unique within the activation")
    if len(name) > _MAX_NAME:
        over = len(name) - _MAX_NAME
        raise BarrierError(f"barrier name {(shown if shown is not None else name)[:40]!r}... is {over} "
                           f"character{'s' if over > 1 else ''} too long",
                           fix=f"keep barrier names within {_MAX_NAME} characters "
                               f"(rendezvous names within {_MAX_NAME - len('rendezvous:')})")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise BarrierError(f"barrier {name!r}: world {world!r} must be an int >= 1", fix="pass the rank count")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise BarrierError(
            f"barrier {name!r}: rank {rank!r} is outside 0..{world - 1}",
            fix="pass this process's rank (0-based) and the world size",
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise BarrierError(f"barrier {name!r}: timeout {timeout!r} must be a finite number of seconds > 0",
                           fix="give seconds")


def _list(ranks: Sequence[int]) -> str:
    if not ranks:
        return "none (every rank registered: the ranks disagree on the world size, or the release key was deleted)"
    shown = ", ".join(str(r) for r in ranks[:_MAX_LISTED])
    more = f" and {len(ranks) - _MAX_LISTED} more" if len(ranks) > _MAX_LISTED else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{more}"
