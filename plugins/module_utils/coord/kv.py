"""The CSKV v1 key/value semantics, apart from the socket loop that serves them.

:class:`KeyValueStore` owns the stored bytes, their accounting against
``max_store_bytes`` and the blocked ``get`` waiters; it knows nothing of
sockets. The server (:mod:`.server`) decodes a request, calls :meth:`apply` (or
:meth:`get` for a ``get``), sends the reply and wakes the waiters it is handed.

Rules (docs/coordinator.md): ``set`` stores; ``get`` of a missing key is
``not-found`` unless the caller waits; ``delete`` of a missing key is
``not-found``; ``add`` treats a missing key as 0, refuses a non-int64 value or an
overflow with ``invalid`` and leaves the stored value unchanged; ``append``
creates a missing key and refuses a result over the 16 MiB value cap with
``too-large``; any write that would take the stored bytes over the cap is
``too-large`` and changes nothing.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.coord import protocol as p

ENTRY_OVERHEAD = 64  # bytes charged per stored key on top of its key and value


def entry_size(key: bytes, value: bytes) -> int:
    return len(key) + len(value) + ENTRY_OVERHEAD


class KeyValueStore:
    """One activation's keys and values (single-threaded: the server's loop is its only caller)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._data: dict[bytes, bytes] = {}
        self._bytes = 0
        self._waiters: dict[bytes, list[Any]] = {}

    # ------------------------------------------------------------- reading
    def __len__(self) -> int:
        return len(self._data)

    @property
    def stored_bytes(self) -> int:
        return self._bytes

    @property
    def waiting(self) -> int:
        return sum(len(w) for w in list(self._waiters.values()))  # list(): one atomic copy

    def get(self, key: bytes) -> bytes | None:
        return self._data.get(key)

    # ------------------------------------------------------------- writing
    def apply(self, op: p.Op, key: bytes, value: bytes) -> tuple[p.Status, bytes, list[tuple[Any, bytes]]]:
        """Run a write op (set, delete, add, append): (status, reply value, woken waiters with their value)."""
        if op == p.Op.SET:
            return self._store(key, value)
        if op == p.Op.DELETE:
            if value:
                return p.Status.INVALID, b"", []
            if key not in self._data:
                return p.Status.NOT_FOUND, b"", []
            self._bytes -= entry_size(key, self._data.pop(key))
            return p.Status.OK, b"", []
        if op == p.Op.ADD:
            delta = p.parse_int64(value)
            raw = self._data.get(key)
            current = 0 if raw is None else p.parse_int64(raw)
            if delta is None or current is None:
                return p.Status.INVALID, b"", []
            total = current + delta
            if not p.INT64_MIN <= total <= p.INT64_MAX:
                return p.Status.INVALID, b"", []  # overflow: refused, the stored value is unchanged
            new = p.format_int64(total)
            status, _reply, woken = self._store(key, new)
            return status, new if status == p.Status.OK else b"", woken
        if op == p.Op.APPEND:
            old = self._data.get(key, b"")
            if len(old) + len(value) > p.MAX_VALUE:
                return p.Status.TOO_LARGE, b"", []
            return self._store(key, old + value)
        raise ValueError(f"{op!r} is not a write operation")

    def _store(self, key: bytes, value: bytes) -> tuple[p.Status, bytes, list[tuple[Any, bytes]]]:
        old = self._data.get(key)
        new_total = self._bytes + entry_size(key, value)
        if old is not None:
            new_total -= entry_size(key, old)
        if new_total > self.max_bytes:
            return p.Status.TOO_LARGE, b"", []
        self._data[key] = value
        self._bytes = new_total
        return p.Status.OK, b"", [(w, value) for w in self._waiters.pop(key, ())]

    # ------------------------------------------------------------- waiters
    def wait(self, key: bytes, waiter: Hashable) -> None:
        """Park ``waiter`` until ``key`` is written (the write returns it among the woken)."""
        self._waiters.setdefault(key, []).append(waiter)

    def unwait(self, key: bytes, waiter: Hashable) -> None:
        waiters = self._waiters.get(key)
        if waiters and waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self._waiters[key]

    def take_all_waiters(self) -> list[Any]:
        """Every parked waiter (shutdown answers them), removed."""
        out = [w for ws in self._waiters.values() for w in ws]
        self._waiters.clear()
        return out

    def clear(self) -> None:
        self._data.clear()
        self._bytes = 0
        self._waiters.clear()
