"""Restore admission's port check and the GPU map handed to the CUDA driver on restore."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common import listen_ports
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    AdmissionError,
    ColdSnapError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import ports
from ansible_collections.coldsnap.fleet.plugins.module_utils.process.cuda_checkpoint import restore_map

import coldsnap  # noqa: F401  # pylint: disable=unused-import

A, B, C, D = (f"GPU-{c * 8}-0000-0000-0000-000000000000" for c in "abcd")

TCP = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:A115 0100007F:A8BA 06 00000000:00000000 03:00000F95 00000000     0        0 0 3
   1: 0100007F:A8BA 0100007F:A115 01 00000000:00000000 00:00000000 00000000     0        0 77 1
   2: 0100007F:4E20 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 88 1
"""


def test_local_states_reads_the_local_port_only():
    tables = {"tcp": TCP, "tcp6": TCP.splitlines()[0]}
    assert ports.local_states(0xA115, tables) == ["06"]
    assert ports.local_states(0xA8BA, tables) == ["01"]  # the client end, not the remote column
    assert ports.local_states(20000, tables) == ["0A"]
    assert ports.local_states(1, tables) == []


def test_restorable_ports_avoid_the_ephemeral_range(tmp_path, monkeypatch):
    low, high = listen_ports.ephemeral_range()
    picked = listen_ports.restorable_ports(500)
    assert len(picked) == len(set(picked)) == 500
    assert all(10000 <= p <= 65535 and not low <= p <= high for p in picked)
    real = Path.read_text

    def narrow(self, *a, **kw):
        return "1024\t65535\n" if str(self).endswith("ip_local_port_range") else real(self, *a, **kw)

    monkeypatch.setattr(Path, "read_text", narrow)
    assert listen_ports.ephemeral_range() == (1024, 65535) and listen_ports.restorable_ports() == []


def test_a_listening_port_fails_at_once_naming_its_holder():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        with pytest.raises(AdmissionError) as ei:
            ports.require_ports_free([("127.0.0.1", port)], unit="unit-0", time_wait_grace=30)
        assert f"127.0.0.1:{port} is taken on this host by pid " in str(ei.value)
        assert "python" in str(ei.value)
    finally:
        s.close()
    ports.require_ports_free([("127.0.0.1", port)], unit="unit-0")  # free again


class _Refusing(socket.socket):
    """A socket whose bind fails as a kernel that counts TIME_WAIT against SO_REUSEADDR does."""

    refusals = 0

    def bind(self, address):
        if _Refusing.refusals > 0:
            _Refusing.refusals -= 1
            raise OSError(errno.EADDRINUSE, "Address already in use")
        return super().bind(address)


def test_a_port_held_only_by_time_wait_is_waited_for(monkeypatch):
    monkeypatch.setattr(ports.socket, "socket", _Refusing)
    monkeypatch.setattr(ports, "local_states", lambda port: ["06", "06"])
    monkeypatch.setattr(ports.time, "sleep", lambda s: None)
    _Refusing.refusals = 3
    ports.require_ports_free([("127.0.0.1", 0)], unit="unit-0")
    assert _Refusing.refusals == 0


def test_time_wait_that_outlives_the_grace_fails(monkeypatch):
    monkeypatch.setattr(ports.socket, "socket", _Refusing)
    monkeypatch.setattr(ports, "local_states", lambda port: ["06"])
    monkeypatch.setattr(ports.time, "sleep", lambda s: None)
    _Refusing.refusals = 10**9
    with pytest.raises(AdmissionError, match="TIME_WAIT connections that outlived 0s"):
        ports.require_ports_free([("127.0.0.1", 0)], unit="unit-0", time_wait_grace=0)


def _outgoing_connection() -> tuple[socket.socket, socket.socket, socket.socket, int]:
    """(server, its accepted end, client, client's local port): the client's port is the ephemeral one an
    outgoing connection takes, and no listener holds it."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    client = socket.create_connection(server.getsockname())
    accepted, _addr = server.accept()
    return server, accepted, client, client.getsockname()[1]


def test_a_port_that_a_short_outgoing_connection_holds_is_waited_for():
    """An ephemeral port captured as a listener may be an outgoing connection's local port by restore time:
    such connections are mostly short, so admission waits for it a few seconds."""
    import threading

    server, accepted, client, port = _outgoing_connection()
    try:
        def end():
            accepted.close()  # the far end closes first: the client's end leaves no TIME_WAIT behind
            time.sleep(0.2)
            client.close()

        timer = threading.Timer(0.5, end)
        timer.start()
        ports.require_ports_free([("127.0.0.1", port)], unit="unit-0", connection_grace=20)
        timer.join()
    finally:
        for s in (server, accepted, client):
            s.close()


def test_a_connection_that_outlives_the_grace_is_named_as_one():
    server, accepted, client, port = _outgoing_connection()
    try:
        with pytest.raises(AdmissionError, match=rf"127\.0\.0\.1:{port} is taken on this host by a connection "
                                                 rf"\(not a listener\) of pid {os.getpid()} .* that outlived 0s"):
            ports.require_ports_free([("127.0.0.1", port)], unit="unit-0", connection_grace=0)
    finally:
        for s in (server, accepted, client):
            s.close()


@pytest.mark.parametrize(("used_before", "used_now", "host_before", "host_now", "expected"), [
    ([A], [A], [A, B], [A, B], None),                                   # nothing moves: no map at all
    ([A], [B], [A, B], [A, B], {A: B, B: A}),                           # rank moved: both GPUs paired
    ([B], [A], [A, B], [A, B], {B: A, A: B}),
    ([A], [D], [A, B, C, D], [A, B, C, D], {A: D, B: B, C: C, D: A}),  # the rest identity-first
    ([A], [C], [A, B], [C, D], {A: C, B: D}),                           # another host: bus order
    ([A], [B], None, [A, B], {A: B}),                                   # evidence without the host list
])
def test_restore_map_pairs_every_gpu_of_the_capture_host(used_before, used_now, host_before, host_now, expected):
    got = restore_map(used_before, used_now, host_before, host_now)
    assert got == expected
    if got and host_before:
        assert sorted(got) == sorted(host_before) and sorted(got.values()) == sorted(host_now)


def test_restore_map_refuses_another_gpu_count():
    with pytest.raises(ColdSnapError, match="2 GPU\\(s\\) and this host has 4"):
        restore_map([A], [C], [A, B], [A, B, C, D])


def test_restore_map_refuses_a_gpu_the_restorer_cannot_see():
    with pytest.raises(ColdSnapError, match="not visible to the restoring process"):
        restore_map([A], [C], [A, B], [A, B])


def test_gpu_placement_reads_the_workers_gpu_and_the_hosts_from_one_enumeration(monkeypatch):
    from types import SimpleNamespace

    from ansible_collections.coldsnap.fleet.plugins.module_utils.process import cuda_checkpoint as cuda

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3] / "runtime_image" / "activation"))
    from coldsnap_activation.sequence import gpu_placement

    calls = []
    monkeypatch.setattr(cuda, "device_uuids", lambda: calls.append(1) or [A, B, C, D])
    spec = SimpleNamespace(unit={"devices": [3, 1]})
    assert gpu_placement(spec, {"device_slot": 1}) == ([B], [A, B, C, D])
    assert gpu_placement(spec, {"device_slot": 0}) == ([D], [A, B, C, D])
    assert gpu_placement(SimpleNamespace(unit={"devices": []}), {"device_slot": None}) == ([], [A, B, C, D])
    assert len(calls) == 3


def test_a_port_taken_between_admission_and_criu_is_named_with_its_holder():
    """CRIU only says 'Can't bind inet socket (id 72)': the restore names the port and who holds it; that
    the replaced workload is gone the restore step that evicted it says, once, naming it."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.eviction import EVICTED_PHRASE
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units.restore import failed_after_eviction
    from coldsnap_activation.sequence import _port_taken_since_admission

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        criu_said = "CRIU restore failed: 1234: Error (criu/sk-inet.c:1049): inet: Can't bind inet socket (id 72): " \
                    "Address already in use"
        with pytest.raises(AdmissionError, match=rf"127\.0\.0\.1:{port} is taken on this host by pid") as err:
            _port_taken_since_admission(criu_said, [("127.0.0.1", port)], "unit-0")
        said = str(failed_after_eviction(err.value, [{"unit": "unit-0", "pid": 4242, "pids": [4242]}], host="gpu-a"))
        assert f"127.0.0.1:{port} is taken" in said and said.count(EVICTED_PHRASE) == 1, said
        assert "unit unit-0 (engine pid 4242)" in said and "restore onto another port" in said, said
        _port_taken_since_admission("CRIU restore failed: something else", [("127.0.0.1", port)], "unit-0")
    finally:
        holder.close()


@pytest.mark.parametrize(("squatted", "captured", "taken"), [
    ("127.0.0.1", "127.0.0.1", True),
    ("0.0.0.0", "127.0.0.1", True),
    ("::", "127.0.0.1", True),  # a dual-stack wildcard holds the IPv4 port too
    ("::1", "127.0.0.1", False),
    ("127.0.0.2", "127.0.0.1", False),
    ("127.0.0.1", "0.0.0.0", True),
    ("127.0.0.1", "::", True),
    ("::1", "::", True),
])
def test_a_port_is_taken_exactly_where_the_captured_listener_could_not_bind(squatted, captured, taken):
    """Every pairing of a stranger's address and the captured listener's (a restore of a wildcard listener
    needs the port on every address; another loopback address leaves a specific one free)."""
    s = socket.socket(socket.AF_INET6 if ":" in squatted else socket.AF_INET)
    if ":" in squatted:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind((squatted, 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        if taken:
            with pytest.raises(AdmissionError, match=rf":{port} is taken on this host by pid {os.getpid()}"):
                ports.require_ports_free([(captured, port)], unit="unit-0", time_wait_grace=0)
        else:
            ports.require_ports_free([(captured, port)], unit="unit-0", time_wait_grace=0)
    finally:
        s.close()


@pytest.mark.parametrize("limit,hint", [(32768, True), (ports.WIDE_PID_MAX, False), (None, False)])
def test_a_taken_pid_names_its_holder_and_on_a_narrow_pid_range_how_to_widen_it(monkeypatch, limit, hint):
    """A pid in use refuses the restore naming the process; where this kernel's pids wrap soon (the kernel's
    own default of 32768), the fix also says how to make a stranger on a captured pid rare."""
    monkeypatch.setattr(ports, "pid_max", lambda: limit)
    with pytest.raises(AdmissionError) as err:
        ports.require_pids_free([os.getpid()], unit="unit-0", grace=0)
    assert f"captured pid {os.getpid()} is in use on this host by 'python" in err.value.problem, err.value.problem
    assert "stop that process, or use the docker runtime" in err.value.fix
    widen = f"kernel.pid_max is {limit}, so its pids are reused soon: raising it (sysctl -w kernel.pid_max=4194304)"
    assert (widen in err.value.fix) is hint, err.value.fix


def test_a_pid_held_by_a_process_that_ends_soon_is_waited_for():
    """On a host that reuses its pids, a short-lived command may hold a captured pid for a moment: the check
    waits for it (up to its grace) instead of refusing the restore; a holder that stays is refused, named."""
    brief = subprocess.Popen(["sleep", "0.5"])
    reaper = threading.Thread(target=brief.wait)
    reaper.start()
    try:
        ports.require_pids_free([brief.pid], unit="unit-0", grace=30)
        assert brief.poll() is not None, "returned only once the holder had ended"
    finally:
        reaper.join()
    stays = subprocess.Popen(["sleep", "60"])
    try:
        with pytest.raises(AdmissionError, match=rf"captured pid {stays.pid} is in use on this host by 'sleep' "
                                                 r"\(still after 0.3 s\)"):
            ports.require_pids_free([stays.pid], unit="unit-0", grace=0.3)
    finally:
        stays.kill()
        stays.wait()
