"""Pinned threads of a captured tree: recorded at capture, pinned again by thread id at restore, within
the CPUs the restoring host allows (CRIU itself neither dumps nor restores CPU affinity)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import cpulist
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import affinity, ports

ALLOWED = frozenset(os.sched_getaffinity(0))

# A process that pins one of its threads to the CPU in argv[1] and keeps another thread free, then
# prints both thread ids and waits.
CHILD = r"""
import os, sys, threading
cpu = int(sys.argv[1])
ready = threading.Event()
tids = {}
def pinned():
    os.sched_setaffinity(0, {cpu})
    tids["pinned"] = threading.get_native_id()
    ready.set()
    threading.Event().wait()
def free():
    tids["free"] = threading.get_native_id()
    threading.Event().wait()
threading.Thread(target=free, daemon=True).start()
threading.Thread(target=pinned, daemon=True).start()
ready.wait()
while len(tids) < 2:
    pass
print(tids["pinned"], tids["free"], flush=True)
sys.stdin.read()
"""


def two_cpus() -> tuple[int, int]:
    assert len(ALLOWED) >= 2, "these tests need a machine with two CPUs or more (CI has two)"
    cpus = sorted(ALLOWED)
    return cpus[0], cpus[-1]


@pytest.fixture
def child():
    last = two_cpus()[1]
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(last)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        pinned, free = (int(x) for x in proc.stdout.readline().split())
        yield proc, pinned, free, last
    finally:
        proc.kill()
        proc.wait()


def cpus_of(tid: int) -> frozenset[int]:
    return affinity.thread_cpus(tid)


@pytest.mark.parametrize("text, cpus", [("0", {0}), ("0-2,5", {0, 1, 2, 5}), ("3,1", {1, 3}), ("7-7", {7}),
                                        (" 0-1\n", {0, 1})])
def test_cpu_lists_parse_as_the_kernel_writes_them(text, cpus):
    assert cpulist.parse_cpus(text) == cpus


@pytest.mark.parametrize("text", ["", " ", "a", "1-", "-1", "2-1", "1,,2", "+1", "1 ,2", "0x1", "1-2-3", "99999999",
                                  None, 3])
def test_anything_else_is_not_a_cpu_list(text):
    with pytest.raises(ValueError):
        cpulist.parse_cpus(text)


@pytest.mark.parametrize("cpus, text", [({0}, "0"), ({0, 1, 2, 5}, "0-2,5"), ({9, 3, 4}, "3-4,9"), (set(), "")])
def test_cpu_sets_format_as_ranges_and_round_trip(cpus, text):
    assert cpulist.format_cpus(cpus) == text
    if cpus:
        assert cpulist.parse_cpus(text) == cpus


def test_capture_records_the_pinned_thread_and_not_the_free_one(child):
    proc, pinned, free, last = child
    rec = affinity.capture(ports.tree_tids(proc.pid))
    assert rec["inherited"] == cpulist.format_cpus(ALLOWED)
    assert rec["threads"] == {str(pinned): str(last)}, "only threads narrower than the inherited set are recorded"
    assert str(free) not in rec["threads"] and str(proc.pid) not in rec["threads"]


def test_a_restore_pins_the_recorded_threads_again_by_id(child):
    proc, pinned, free, last = child
    rec = affinity.capture(ports.tree_tids(proc.pid))
    # What CRIU leaves: every thread with the restorer's CPUs.
    os.sched_setaffinity(pinned, ALLOWED)
    assert cpus_of(pinned) == ALLOWED
    done = affinity.apply(rec)
    assert done == affinity.Applied(pinned=1)
    assert cpus_of(pinned) == {last} and cpus_of(free) == ALLOWED


def test_on_a_host_without_the_recorded_cpus_the_thread_keeps_the_restorers(child):
    _proc, pinned, _free, last = child
    first = two_cpus()[0]
    os.sched_setaffinity(pinned, ALLOWED)
    # Captured on a larger host: pinned to CPUs this one does not have, or partly.
    rec = {"inherited": "0-255", "threads": {str(pinned): "200-201"}}
    assert affinity.apply(rec) == affinity.Applied(unpinned=1)
    assert cpus_of(pinned) == ALLOWED
    rec = {"inherited": "0-255", "threads": {str(pinned): f"{first},200-201"}}
    assert affinity.apply(rec) == affinity.Applied(narrowed=1)
    assert cpus_of(pinned) == {first}
    # A host (or container) that allows fewer CPUs than the restorer's own: the intersection is used.
    os.sched_setaffinity(pinned, ALLOWED)
    assert affinity.apply({"threads": {str(pinned): cpulist.format_cpus(ALLOWED)}},
                          allowed=frozenset({last})) == affinity.Applied(narrowed=1)
    assert cpus_of(pinned) == {last}


def test_a_thread_that_ended_is_counted_not_an_error():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    time.sleep(0.05)
    assert not Path(f"/proc/{proc.pid}").exists()
    assert affinity.apply({"threads": {str(proc.pid): "0"}}) == affinity.Applied(gone=1)


def test_an_artifact_without_the_record_restores_as_before():
    assert affinity.apply(None) == affinity.Applied()
    assert affinity.records(None) == []


@pytest.mark.parametrize("record, word", [
    ({"threads": []}, "threads is not an object"),
    ("0-1", "threads is not an object"),
    ({"threads": {"12a": "0"}}, "'12a' is not a thread id"),
    ({"threads": {"0": "0"}}, "'0' is not a thread id"),
    ({"threads": {"123": "0-"}}, "the CPUs of thread 123"),
    ({"threads": {"123": 1}}, "the CPUs of thread 123"),
])
def test_an_altered_record_is_refused_naming_it(record, word):
    with pytest.raises(ColdSnapError) as err:
        affinity.apply(record, where="unit unit-0 worker-0 affinity")
    assert "unit unit-0 worker-0 affinity" in str(err.value) and word in str(err.value)
    assert "recapture" in err.value.fix


def test_applied_counts_add_up():
    total = affinity.Applied(pinned=1, gone=1) + affinity.Applied(narrowed=2, unpinned=1)
    assert total.to_json() == {"pinned": 1, "narrowed": 2, "unpinned": 1, "gone": 1}


def test_a_recorded_thread_outside_the_restored_tree_is_never_touched(child):
    """A thread that ended between the record and the dump is not in the images, and its id may be
    another process's by now: with the restored tree given, only that tree's threads are pinned."""
    proc, pinned, _free, last = child
    first = two_cpus()[0]
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        rec = {"threads": {str(pinned): str(first), str(other.pid): str(first)}}
        assert affinity.apply(rec, tree=other.pid) == affinity.Applied(pinned=1, gone=1)
        assert cpus_of(pinned) == {last}, "the stranger's thread kept its CPUs"
        assert cpus_of(other.pid) == {first}
        assert affinity.apply(rec, tree=proc.pid) == affinity.Applied(pinned=1, gone=1)
        assert cpus_of(pinned) == {first}
    finally:
        other.kill()
        other.wait()
