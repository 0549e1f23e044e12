"""Listener placement on restore: one shift per unit, addresses mapped, CRIU's files.img rewritten
in a linked copy with every other byte kept (the image codec against hand-encoded protobuf)."""

from __future__ import annotations

import socket
import struct

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import AdmissionError
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import criu_images
from ansible_collections.coldsnap.fleet.plugins.module_utils.process.placement import (
    Placement,
    for_unit,
    rebind,
)

MAGIC = struct.pack("<II", 0x54564319, 0x56303138)


def varint(v: int) -> bytes:
    out = b""
    while True:
        b, v = v & 0x7F, v >> 7
        out += bytes([b | 0x80]) if v else bytes([b])
        if not v:
            return out


def field(num: int, value) -> bytes:
    if isinstance(value, int):
        return varint(num << 3) + varint(value)
    return varint(num << 3 | 2) + varint(len(value)) + value


def inet_entry(fid: int, family: int, state: int, addr: str, port: int, *, extra: bytes = b"") -> bytes:
    packed = socket.inet_pton(family, addr)
    words = [struct.unpack_from("<I", packed, i)[0] for i in range(0, len(packed), 4)]
    isk = (field(1, fid) + field(2, 1000 + fid) + field(3, family) + field(4, socket.SOCK_STREAM) + field(5, 6)
           + field(6, state) + field(7, port) + field(8, 0) + field(9, 2) + field(10, 128)
           + b"".join(field(11, w) for w in words) + field(13, b"\x08\x00") + field(14, b"\x08\x01") + extra)
    return field(1, 4) + field(2, fid) + field(4, isk)


def reg_entry(fid: int, path: bytes) -> bytes:
    return field(1, 1) + field(2, fid) + field(3, field(1, fid) + field(2, 0) + field(3, 0) + field(4, path))


def write_images(tmp_path, entries: list[bytes]):
    d = tmp_path / "images"
    d.mkdir()
    (d / "files.img").write_bytes(MAGIC + b"".join(struct.pack("<I", len(e)) + e for e in entries))
    (d / "pages-1.img").write_bytes(b"\x11" * 4096)
    (d / "dump.log").write_text("log")
    (d / "stats-restore").write_bytes(b"stats")
    return d


def test_listeners_are_read_and_rebound_in_a_linked_copy(tmp_path):
    entries = [reg_entry(1, b"/usr/bin/python3"),
               inet_entry(2, socket.AF_INET, 10, "127.0.0.1", 8000),
               inet_entry(3, socket.AF_INET6, 10, "::", 41000, extra=field(15, 1)),
               inet_entry(4, socket.AF_INET, 7, "127.0.0.1", 8000),   # a closed connection of the listener
               inet_entry(5, socket.AF_INET, 1, "127.0.0.1", 50000)]  # an outgoing one: left alone
    src = write_images(tmp_path, entries)
    before = (src / "files.img").read_bytes()
    assert criu_images.listeners(src) == [criu_images.Listener(socket.AF_INET, "127.0.0.1", 8000),
                                          criu_images.Listener(socket.AF_INET6, "::", 41000)]
    place = Placement(port_shift=5, addresses={"127.0.0.1": "0.0.0.0"})
    out, moved = rebind(src, tmp_path / "placed", place, unit="unit-0")
    assert moved == [{"from": ["127.0.0.1", 8000], "to": ["0.0.0.0", 8005]},
                     {"from": ["::", 41000], "to": ["::", 41005]}]
    assert (src / "files.img").read_bytes() == before, "the captured images are never edited"
    assert criu_images.listeners(out) == [criu_images.Listener(socket.AF_INET, "0.0.0.0", 8005),
                                          criu_images.Listener(socket.AF_INET6, "::", 41005)]
    assert (out / "pages-1.img").stat().st_ino == (src / "pages-1.img").stat().st_ino
    assert not (out / "dump.log").exists() and not (out / "stats-restore").exists()
    head, got = criu_images.read_image(out / "files.img")
    assert head == MAGIC and got[0] == entries[0] and got[4] == entries[4], "other entries are kept byte for byte"
    assert got[3] != entries[3], "the listener's closed connection moves with it"
    assert field(15, 1) in got[2], "fields after the address survive"


def test_nothing_moves_when_the_restore_serves_where_the_capture_did(tmp_path):
    src = write_images(tmp_path, [inet_entry(2, socket.AF_INET, 10, "127.0.0.1", 8000)])
    out, moved = rebind(src, tmp_path / "placed", Placement(), unit="unit-0")
    assert out == src and moved == [] and not (tmp_path / "placed").exists()


def test_a_rebind_replaces_a_stale_copy(tmp_path):
    src = write_images(tmp_path, [inet_entry(2, socket.AF_INET, 10, "127.0.0.1", 8000)])
    stale = tmp_path / "placed"
    stale.mkdir()
    (stale / "core-999.img").write_bytes(b"old")
    out, _moved = rebind(src, stale, Placement(port_shift=1), unit="unit-0")
    assert not (out / "core-999.img").exists()


@pytest.mark.parametrize("data", [b"\x19\x43", MAGIC + b"\x10\x00\x00\x00\x08", MAGIC + b"\x02\x00\x00\x00\x08\xff"])
def test_a_damaged_files_image_is_an_image_error(tmp_path, data):
    d = tmp_path / "images"
    d.mkdir()
    (d / "files.img").write_bytes(data)
    with pytest.raises(criu_images.ImageError):
        criu_images.listeners(d)


def test_one_shift_for_every_listener_and_the_range_is_checked():
    place = Placement(port_shift=1000, field_path="$.launch.execution.services[0].port")
    moved = place.listeners([("127.0.0.1", 8000), ("127.0.0.1", 41000)])
    assert moved == [("127.0.0.1", 9000), ("127.0.0.1", 42000)]
    with pytest.raises(AdmissionError, match=r"port 65535\b|out of range") as exc:
        place.apply("127.0.0.1", 64600, unit="unit-0")
    assert "services[0].port" in str(exc.value)
    with pytest.raises(AdmissionError, match="another address family"):
        Placement(addresses={"127.0.0.1": "::"}).apply("127.0.0.1", 8000)


def test_an_internal_listener_pushed_out_of_range_wraps_and_the_serving_port_is_the_one_asked_for():
    # Captured on 35000 with the control API on 43813, restored onto 58710 (+23710): the control listener
    # would land on 67523; it wraps within 1024..65535 instead of refusing a perfectly good serving port.
    place = Placement(port_shift=23710, service_port=35000, field_path="$.launch.execution.services[0].port")
    moved = place.moves([("0.0.0.0", 35000), ("127.0.0.1", 43813)], unit="unit-0")
    assert moved == {("0.0.0.0", 35000): ("0.0.0.0", 58710), ("127.0.0.1", 43813): ("127.0.0.1", 67523 - 64512)}
    assert place.apply("127.0.0.1", 43813) == ("127.0.0.1", 3011)
    down = Placement(port_shift=-30000, service_port=40000)
    assert down.apply("127.0.0.1", 20000) == ("127.0.0.1", 20000 - 30000 + 64512)
    assert down.apply("127.0.0.1", 40000) == ("127.0.0.1", 10000)
    # The wrap is one-to-one over 1024..65535; a privileged listener wrapped onto another's port is refused.
    assert len({place.apply("127.0.0.1", p)[1] for p in range(1024, 65536)}) == 65536 - 1024
    clash = Placement(port_shift=-1000, service_port=65012, field_path="$.launch.execution.services[0].port")
    with pytest.raises(AdmissionError, match=r"ports 65012 and 500 would both move to port 64012") as exc:
        clash.moves([("127.0.0.1", 65012), ("127.0.0.1", 500)], unit="unit-0")
    assert "services[0].port" in str(exc.value) and exc.value.fix


def test_the_shift_comes_from_the_units_service():
    def launch(port: int, address: str = "127.0.0.1") -> dict:
        return {"execution": {"services": [{"id": "api", "unit": "unit-0", "port": port, "address": address}]}}

    assert for_unit(launch(8000), launch(8000), "unit-0") == Placement(
        field_path="$.launch.execution.services[0].port", service_port=8000)
    p = for_unit(launch(8000), launch(9100, "0.0.0.0"), "unit-0")
    assert p.port_shift == 1100 and p.addresses == {"127.0.0.1": "0.0.0.0"} and p.moves_anything
    # Only the service's own listener changes address: the engine's control API (an ephemeral port on
    # loopback) moves by the shift and stays on loopback, never exposed by a restore onto 0.0.0.0.
    assert p.listeners([("127.0.0.1", 8000), ("127.0.0.1", 41234)]) == [("0.0.0.0", 9100), ("127.0.0.1", 42334)]
    q = for_unit(launch(8000), launch(8000, "192.0.2.2"), "unit-0")
    assert q.listeners([("127.0.0.1", 8000), ("127.0.0.1", 41234)]) == [("192.0.2.2", 8000), ("127.0.0.1", 41234)]
    assert for_unit(launch(8000), launch(9100), "unit-1") == Placement(), "a unit without a service stays"
    assert Placement.from_json(p.to_json()) == p


def test_the_serving_listener_follows_the_commands_bind_address_too():
    """Bound to 0.0.0.0 and probed at 127.0.0.1 at capture (vLLM binds every interface by default), restored
    with --host 127.0.0.1: the serving socket moves to loopback instead of staying on every interface while
    the request and the receipt say 127.0.0.1."""
    def launch(host: str | None, engine: str = "reference") -> dict:
        command = ["coldsnap-reference-engine", "--port", "8000"] + (["--host", host] if host is not None else [])
        return {"engine": engine, "units": [{"id": "unit-0", "command": command}],
                "execution": {"services": [{"id": "api", "unit": "unit-0", "port": 8000, "address": "127.0.0.1"}]}}

    p = for_unit(launch("0.0.0.0"), launch("127.0.0.1"), "unit-0")
    assert p.listeners([("0.0.0.0", 8000), ("127.0.0.1", 41234)]) == [("127.0.0.1", 8000), ("127.0.0.1", 41234)]
    # vLLM without --host bound every interface; restored with --host 127.0.0.1 it serves on loopback only.
    v = for_unit(launch(None, "vllm"), launch("127.0.0.1", "vllm"), "unit-0")
    assert v.listeners([("0.0.0.0", 8000)]) == [("127.0.0.1", 8000)]
    # The same bind, or a restore command that does not say, moves nothing.
    assert not for_unit(launch("0.0.0.0"), launch("0.0.0.0"), "unit-0").moves_anything
    assert not for_unit(launch("0.0.0.0"), launch(None), "unit-0").moves_anything
    wide = for_unit(launch("127.0.0.1"), launch("0.0.0.0"), "unit-0")
    assert wide.listeners([("127.0.0.1", 8000), ("127.0.0.1", 41234)]) == [("0.0.0.0", 8000), ("127.0.0.1", 41234)]


def test_a_new_probe_address_never_narrows_a_wildcard_bind_the_command_keeps():
    """Captured and restored with --host 0.0.0.0, the service now probed at another address: the engine keeps
    listening on every interface (clients of the other interfaces would lose it silently)."""
    def launch(service_address: str) -> dict:
        command = ["coldsnap-reference-engine", "--port", "8000", "--host", "0.0.0.0"]
        return {"engine": "reference", "units": [{"id": "unit-0", "command": command}],
                "execution": {"services": [{"id": "api", "unit": "unit-0", "port": 8000, "address": service_address}]}}

    for probe in ("127.0.0.1", "10.1.2.3"):
        p = for_unit(launch("0.0.0.0"), launch(probe), "unit-0")
        assert p.listeners([("0.0.0.0", 8000), ("127.0.0.1", 41234)]) == [("0.0.0.0", 8000), ("127.0.0.1", 41234)]


def test_units_restored_on_one_host_never_need_the_same_pid_or_port():
    from ansible_collections.coldsnap.fleet.plugins.module_utils.process.ports import require_distinct_units

    claims: dict = {}
    require_distinct_units(claims, "unit-a", [2000001, 2000002], what="captured pid")
    require_distinct_units(claims, "unit-a", [("127.0.0.1", 8000), ("127.0.0.1", 23457)], what="port")
    require_distinct_units(claims, "unit-b", [3000001], what="captured pid")
    with pytest.raises(AdmissionError, match="units unit-a and unit-b restored on one host both need captured pid "
                                             "2000002") as exc:
        require_distinct_units(claims, "unit-b", [2000002], what="captured pid")
    assert "docker runtime" in exc.value.fix
    with pytest.raises(AdmissionError, match=r"both need port 127\.0\.0\.1:23457"):
        require_distinct_units(claims, "unit-b", [("127.0.0.1", 8001), ("127.0.0.1", 23457)], what="port")


def test_a_captured_pid_beyond_this_kernels_pid_max_is_refused_before_eviction(monkeypatch):
    from ansible_collections.coldsnap.fleet.plugins.module_utils.process import ports

    monkeypatch.setattr(ports, "pid_max", lambda: 32768)
    workers = [{"pid": 4000000, "tids": [4000001]}]
    with pytest.raises(AdmissionError, match=r"captured pid 4000001 is beyond this host's kernel.pid_max \(32768\)"):
        ports.require_restorable(workers, unit="unit-0", served=lambda w: [], pids=False)
    assert ports.pid_max() is None or ports.pid_max() > 300


def test_an_address_spelled_otherwise_than_the_images_record_it_still_moves_the_listener():
    """CRIU records ``fd00::5``; a request that writes ``FD00:0::5`` names the same address: its listener moves
    (matched by the spelling, it stayed where it was captured and the restore failed its probe after eviction)."""
    def launch(address: str) -> dict:
        command = ["coldsnap-reference-engine", "--port", "8000", "--host", address]
        return {"engine": "reference", "units": [{"id": "unit-0", "command": command}],
                "execution": {"services": [{"id": "api", "unit": "unit-0", "port": 8000, "address": address}]}}

    p = for_unit(launch("FD00:0::5"), launch("::1"), "unit-0")
    assert p.listeners([("fd00::5", 8000), ("::1", 41234)]) == [("::1", 8000), ("::1", 41234)]
    assert not for_unit(launch("FD00:0::5"), launch("fd00::5"), "unit-0").moves_anything
