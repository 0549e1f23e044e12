"""The CPU affinity of a captured process tree's threads, which CRIU neither dumps nor restores.

Engines pin threads: vLLM's CPU worker binds each OpenMP thread to one core of its NUMA node
(``VLLM_CPU_OMP_THREADS_BIND``), and a restored tree would otherwise come back with every thread
free to run anywhere (CRIU restores a task with the affinity of the process that restores it), so a
pinned engine would compete with its own busy-polling processes and, on a multi-socket host, leave
its NUMA node. ColdSnap records, at capture, the threads whose CPU set is narrower than the one the
engine inherited (the activation runtime's), and sets them again, by thread id (CRIU restores every
thread at its captured id), while the restored tree is still stopped.

On another host the recorded CPUs may not all exist or be allowed (a container's cpuset): a thread
gets the recorded CPUs this host allows, and where none of them is, it keeps the restorer's set.
The result counts both, so the restore's timing says what it could not give back.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.cpulist import format_cpus, parse_cpus
from ansible_collections.coldsnap.fleet.plugins.module_utils.process.ports import tree_tids


def thread_cpus(tid: int) -> frozenset[int] | None:
    """The CPUs thread ``tid`` may run on, or None when it is gone."""
    try:
        return frozenset(os.sched_getaffinity(tid))
    except OSError:
        return None


def capture(tids: Iterable[int], inherited: frozenset[int] | None = None) -> dict:
    """Of the threads ``tids`` (a tree's, ``ports.tree_tids``), those pinned to other CPUs than ``inherited``
    (default: the CPUs this process may use, which is what the engine was started with)::

        {"inherited": "0-63", "threads": {"<tid>": "8-15", ...}}
    """
    inherited = frozenset(os.sched_getaffinity(0)) if inherited is None else inherited
    threads = {}
    for tid in tids:
        cpus = thread_cpus(tid)
        if cpus and cpus != inherited:
            threads[str(tid)] = format_cpus(cpus)
    return {"inherited": format_cpus(inherited), "threads": threads}


@dataclass(frozen=True)
class Applied:
    """What :func:`apply` gave back: threads pinned as captured, pinned to the part of their CPUs this
    host allows, left with the restorer's CPUs (none of theirs allowed here), and gone already."""

    pinned: int = 0
    narrowed: int = 0
    unpinned: int = 0
    gone: int = 0

    def __add__(self, other: Applied) -> Applied:
        return Applied(self.pinned + other.pinned, self.narrowed + other.narrowed, self.unpinned + other.unpinned,
                       self.gone + other.gone)

    def to_json(self) -> dict:
        return {"pinned": self.pinned, "narrowed": self.narrowed, "unpinned": self.unpinned, "gone": self.gone}


def records(record: dict | None, *, where: str = "affinity") -> list[tuple[int, frozenset[int]]]:
    """The (thread id, CPUs) of a :func:`capture` record, checked; an absent record (an artifact
    captured before affinity was recorded) has none."""
    if record is None:
        return []
    threads = record.get("threads") if isinstance(record, dict) else None
    if not isinstance(threads, dict):
        raise ColdSnapError(f"{where}.threads is not an object of thread id -> CPU list",
                            fix="the capture's evidence was altered; restore from the published capsule or recapture")
    out = []
    for tid, text in sorted(threads.items()):
        try:
            if not (isinstance(tid, str) and tid.isdigit() and int(tid) > 0):
                raise ValueError(f"{tid!r} is not a thread id")
            out.append((int(tid), parse_cpus(text, what=f"the CPUs of thread {tid}")))
        except ValueError as exc:
            raise ColdSnapError(f"{where}.threads: {exc}",
                                fix="the capture's evidence was altered; restore from the published capsule or "
                                    "recapture") from None
    return out


def apply(record: dict | None, *, tree: int | None = None, allowed: frozenset[int] | None = None,
          where: str = "affinity") -> Applied:
    """Pin each recorded thread again (the restored tree should still be stopped), within ``allowed``
    (default: the CPUs this process may use). With ``tree`` (the restored root's pid), only threads of
    that tree are touched: a recorded thread that ended before the dump is not in the images, and its id
    may belong to another process by now."""
    wanted = records(record, where=where)
    allowed = frozenset(os.sched_getaffinity(0)) if allowed is None else allowed
    ours = set(tree_tids(tree)) if tree is not None else None
    pinned = narrowed = unpinned = gone = 0
    for tid, cpus in wanted:
        if ours is not None and tid not in ours:
            gone += 1
            continue
        target = cpus & allowed
        if not target:
            unpinned += 1
            continue
        try:
            os.sched_setaffinity(tid, target)
        except ProcessLookupError:
            gone += 1
            continue
        except OSError:  # EINVAL: a CPU went offline meanwhile, or a cpuset narrower than ours
            unpinned += 1
            continue
        if target == cpus:
            pinned += 1
        else:
            narrowed += 1
    return Applied(pinned, narrowed, unpinned, gone)
