"""Barrier and rendezvous over CSKV: N ranks arrive, all leave together, or a clear error.

A rank of ``barrier(client, name, rank, world, timeout)`` makes two requests: one
``add`` that registers it, and one blocking ``get`` of the release key (the rank
that completes the barrier ``set``s that key instead of waiting). Keys, all under
``barrier/<name>/`` and documented so that other clients can take part:

* ``arrived/<g>@<world>``: ranks are taken in groups of ``GROUP`` (16): rank ``r`` owns
  the two-bit field at bit ``2 * (r % 16)`` of group ``g = r // 16``. Each rank ``add``s
  ``2**32 + 4**(r % 16)``: the value's low 32 bits count each rank of the group that
  arrived (in base 4) and the bits from 32 up count the arrivals. The field the
  ``add`` returns is 1 for a rank's first arrival; a second arrival of the same rank (a
  duplicated process, a reused name) makes it 2 (two bits a rank: no carry into the
  next rank's field, so no other rank is ever taken for the duplicate), takes its delta
  back with a second ``add`` and is an error instead of a miscount. A group is complete
  when its value is exactly ``size * 2**32 + (4**size - 1) / 3``: that many arrivals,
  each rank's field 1 (a sum of ``size`` powers of four has ``size`` digits 1 in base 4
  only when no two are equal).
* ``groups@<world>``: with more than one group, the rank that completes a group adds 1
  here; the rank that brings it to the number of groups completes the barrier.
* ``release@<world>``: the completing rank sets it; every other rank waits for it with
  a blocking ``get``.

The world size is part of every key, so ranks that disagree on it never release each
other early (they time out instead). A barrier name is single-use within one
activation: name each phase uniquely (``criu-restore``, ``cuda-restore``,
``transport/2``...). Timeouts end with a ``BarrierTimeout`` that names the ranks
that never arrived (read from the group keys). The wait is cut into slices of at
most ``POLL_SLICE`` seconds (a waiting ``get`` holds a connection slot of the
server; slices free it, so a world larger than the slots still gets its releasing
rank in). A caller that must also watch something else while it waits (the
activation's abort key) passes ``poll``, which runs before each slice; whatever it
raises ends the wait.

Every step is one short TCP request (client.py, CSKV v1 is one request per
connection): no connection or thread outlives the call, so a rank may be
checkpointed between barriers.
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
GROUP = 16  # ranks per arrival key: two bits each in bits 0..31; the count starts at bit 32
FIELD_BITS = 2
COUNT_UNIT = 1 << 32
MAX_WORLD = 1 << 16  # ranks of one barrier (its timeout reads one key per group)
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


def arrival_key(name: str, group: int, world: int) -> str:
    """The key counting the arrivals of ranks ``16 * group`` .. ``16 * group + 15``."""
    return barrier_key(name, f"arrived/{group}@{world}")


def group_size(group: int, world: int) -> int:
    return min(GROUP, world - GROUP * group)


def group_complete(group: int, world: int) -> int:
    """The value of a group's arrival key once each of its ranks arrived exactly once."""
    size = group_size(group, world)
    return size * COUNT_UNIT + ((1 << FIELD_BITS * size) - 1) // 3


def barrier(client: CoordinatorClient, name: str, rank: int, world: int, timeout: float, *,
            poll: Callable[[], None] | None = None) -> int:
    """Block until all ``world`` ranks reached barrier ``name``; return this rank's arrival order in
    its group of up to 16 ranks (1..16; for a world of at most 16, its order among all ranks).

    Raises BarrierTimeout naming the missing ranks when ``timeout`` seconds pass
    first, and BarrierError for a duplicate rank or a reused name. ``poll`` (optional)
    runs before every wait slice (module doc); an exception from it propagates.
    """
    _check_args(name, rank, world, timeout)
    deadline = time.monotonic() + timeout
    group, slot = divmod(rank, GROUP)
    delta = COUNT_UNIT + (1 << FIELD_BITS * slot)
    key = arrival_key(name, group, world)
    total = client.add(key, delta)
    if _field(total, slot) != 1:  # 2 or 3: arrived before; 0: four times over (carried out)
        client.add(key, -delta)  # take this arrival back: the rank's first arrival still counts
        raise BarrierError(
            f"barrier {name!r}: rank {rank} arrived more than once",
            fix="give every process a distinct rank, and every barrier phase a unique name",
        )
    if total == group_complete(group, world):
        groups = -(-world // GROUP)
        if groups == 1 or client.add(barrier_key(name, f"groups@{world}"), 1) == groups:
            client.set(barrier_key(name, f"release@{world}"), RELEASE_VALUE)
            return total // COUNT_UNIT
    release = barrier_key(name, f"release@{world}")
    try:
        _wait_release(client, release, deadline, poll)
    except CoordinatorTimeout:
        # The release may have landed right at the deadline: look once more.
        if client.try_get(release) is not None:
            return total // COUNT_UNIT
        missing = missing_ranks(client, name, world)
        raise BarrierTimeout(
            f"barrier {name!r} timed out after {timeout:g}s with {world - len(missing)} of {world} ranks: "
            f"missing {_list(missing)} (this is rank {rank} of a world of {world})",
            fix="check the missing ranks' processes and logs, that every rank passes the same world size "
                "(ranks count only with those of their world), or raise the timeout",
            missing=missing,
            arrived=world - len(missing),
        ) from None
    return total // COUNT_UNIT


def _wait_release(client: CoordinatorClient, key: str, deadline: float, poll: Callable[[], None] | None) -> None:
    """Wait for ``key`` until ``deadline`` (CoordinatorTimeout after it), calling ``poll`` between slices."""
    while True:
        if poll is not None:
            poll()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CoordinatorTimeout("no time left")
        try:
            # Always in slices: a waiting get holds one of the server's connection slots, and with every
            # slot held by waiters the rank that would release them could not get in before they time out.
            client.get(key, timeout=min(POLL_SLICE, remaining))
            return
        except CoordinatorTimeout:
            if time.monotonic() >= deadline:
                raise


def _field(value: int, slot: int) -> int:
    """How often the rank in ``slot`` arrived, as far as its two bits hold (0 after four)."""
    return value >> FIELD_BITS * slot & ((1 << FIELD_BITS) - 1)


def rendezvous_key(name: str, rank: int) -> str:
    """The CSKV key holding rank ``rank``'s value in rendezvous ``name``."""
    return f"rendezvous/{name}/{rank}"


def missing_ranks(client: CoordinatorClient, name: str, world: int) -> list[int]:
    """Ranks of barrier ``name`` whose arrival is not recorded (one short request per group of 16)."""
    missing = []
    for group in range(-(-world // GROUP)):
        raw = client.try_get(arrival_key(name, group, world))
        try:
            arrived = int(raw) % COUNT_UNIT if raw is not None else 0
        except ValueError:
            arrived = 0
        missing += [GROUP * group + b for b in range(group_size(group, world)) if not _field(arrived, b)]
    return missing


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
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= MAX_WORLD:
        raise BarrierError(f"barrier {name!r}: world {world!r} must be an int in 1..{MAX_WORLD}",
                           fix="pass the rank count")
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
        return "none (every rank registered: the release key was deleted, or the rank completing the barrier failed)"
    shown = ", ".join(str(r) for r in ranks[:_MAX_LISTED])
    more = f" and {len(ranks) - _MAX_LISTED} more" if len(ranks) > _MAX_LISTED else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{more}"
