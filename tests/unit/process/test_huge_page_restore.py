"""Restoring into huge pages: with ``huge_pages`` ColdSnap's CRIU build reads a process's private
anonymous memory of 2 MiB or more back into transparent huge pages (advised with ``MADV_HUGEPAGE``
before the pages are read), where the host's THP mode is ``madvise``; without it the process comes
back as it was. The bytes are the dumped ones either way; a unit's environment can say "off"."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import huge_pages_wanted
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import criu as criu_mod

MIB = 1 << 20
BIG = 24 * MIB

CHILD = r"""
import ctypes, hashlib, json, mmap, os, sys, time

flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
big = mmap.mmap(-1, BIG_BYTES, flags=flags)
# A small mapping between two inaccessible pages: its own VMA, never merged with a neighbour.
fenced = mmap.mmap(-1, (1 << 20) + 2 * mmap.PAGESIZE, flags=flags)
base = ctypes.addressof(ctypes.c_char.from_buffer(fenced))
libc = ctypes.CDLL(None)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
for guard in (base, base + mmap.PAGESIZE + (1 << 20)):
    assert libc.mprotect(guard, mmap.PAGESIZE, 0) == 0  # PROT_NONE
small = (ctypes.c_char * (1 << 20)).from_address(base + mmap.PAGESIZE)
block = hashlib.sha256(b"coldsnap").digest() * 32768
for off in range(0, len(big), len(block)):
    big[off:off + len(block)] = bytes(b ^ (off >> 20) & 0xFF for b in block[:64]) * (len(block) // 64)
ctypes.memset(small, ord("s"), len(small))
info = {"pid": os.getpid(), "big": ctypes.addressof(ctypes.c_char.from_buffer(big)),
        "small": ctypes.addressof(small), "sha256": hashlib.sha256(big[:]).hexdigest()}
out = sys.argv[1]
with open(out + ".tmp", "w") as fh:
    json.dump(info, fh)
os.rename(out + ".tmp", out)
while True:
    time.sleep(1)
""".replace("BIG_BYTES", str(BIG))


def mapping(pid: int, address: int) -> dict:
    """The smaps entry of ``pid``'s mapping that holds ``address``: bounds, VmFlags, AnonHugePages (KiB)."""
    cur: dict | None = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            cur = {"lo": lo, "hi": hi} if lo <= address < hi else None
        elif cur is not None and head[0] == "AnonHugePages:":
            cur["anon_huge_kib"] = int(head[1])
        elif cur is not None and head[0] == "VmFlags:":
            cur["flags"] = head[1:]
            return cur
    raise AssertionError(f"no mapping of pid {pid} holds {address:#x}")


@pytest.mark.parametrize("env,wanted", [(None, True), ({}, True), ({"COLDSNAP_HUGE_PAGES": "on"}, True),
                                        ({"COLDSNAP_HUGE_PAGES": "off"}, False),
                                        ({"COLDSNAP_HUGE_PAGES": " OFF "}, False),
                                        ({"COLDSNAP_HUGE_PAGES": "0"}, False),
                                        ({"OTHER": "off"}, True)])
def test_a_units_environment_decides(env, wanted):
    assert huge_pages_wanted(env) is wanted


@pytest.mark.parametrize("env,wanted", [(None, False), ({"COLDSNAP_HUGE_PAGES": "on"}, True),
                                        ({"COLDSNAP_HUGE_PAGES": "off"}, False)])
def test_the_hosts_default_applies_only_where_the_unit_does_not_say(env, wanted):
    assert huge_pages_wanted(env, default=False) is wanted


def _virtio(root: Path, name: str, device: str, features: str, *, driver: bool = True) -> None:
    dev = root / name
    dev.mkdir(parents=True)
    (dev / "device").write_text(device + "\n")
    (dev / "features").write_text(features + "\n")
    if driver:
        (root / f"{name}-driver").mkdir()
        (dev / "driver").symlink_to(root / f"{name}-driver")


REPORTING = "0110010100" + "0" * 118  # bits 1, 2, 5 (free page reporting) and 7, as a cloud VM's balloon
NOT_REPORTING = "0110000100" + "0" * 118


@pytest.mark.parametrize("devices,reports", [
    ([("virtio0", "0x0005", REPORTING, True), ("virtio1", "0x0002", NOT_REPORTING, True)], True),
    ([("virtio0", "0x0005", NOT_REPORTING, True)], False),
    ([("virtio0", "0x0005", REPORTING, False)], False),  # no driver bound: nothing reports
    ([("virtio0", "0x0001", REPORTING, True)], False),  # bit 5 of a network device means something else
    ([("virtio0", "0x0005", "01", True)], False),  # a features string too short to carry the bit
    ([], False),
], ids=["balloon-reports", "balloon-without-reporting", "balloon-unbound", "not-a-balloon", "short", "none"])
def test_huge_pages_by_default_except_where_free_memory_goes_back_to_a_hypervisor(tmp_path, devices, reports):
    root = tmp_path / "virtio"
    root.mkdir()
    for name, device, features, driver in devices:
        _virtio(root, name, device, features, driver=driver)
    no_gpu = tmp_path / "no-nvidia"
    assert criu_mod.free_page_reporting(root) is reports
    assert criu_mod.huge_pages_by_default(root, no_gpu) is (not reports)
    assert criu_mod.huge_pages_by_default(tmp_path / "no-such-bus", no_gpu) is True  # a host without virtio
    # A GPU host keeps huge pages: a VM with a GPU passed through cannot give its memory back.
    gpus = tmp_path / "gpus"
    (gpus / "0000:1b:00.0").mkdir(parents=True)
    assert criu_mod.huge_pages_by_default(root, gpus) is True


@pytest.mark.criu
@pytest.mark.parametrize("huge", [True, False], ids=["huge-pages", "as-dumped"])
def test_restored_memory_is_the_dumped_bytes_in_huge_pages_when_asked(tmp_path, huge, criu_build, reap, spawn_ready):
    criu, coldsnap_build = criu_build
    proc, info = spawn_ready(CHILD, "child")
    before_small = mapping(info["pid"], info["small"])
    assert before_small["hi"] - before_small["lo"] == MIB, "the small mapping is a VMA of its own"
    assert "hg" not in mapping(info["pid"], info["big"])["flags"], "nothing advised before the dump"
    criu_mod.dump(criu, info["pid"], tmp_path / "images")
    proc.wait(timeout=30)
    restored = criu_mod.restore(criu, tmp_path / "images", work_dir=tmp_path / "work", huge_pages=huge).pid
    reap(restored)
    assert restored == info["pid"]
    with open(f"/proc/{restored}/mem", "rb") as mem:
        mem.seek(info["big"])
        assert hashlib.sha256(mem.read(BIG)).hexdigest() == info["sha256"], "the dumped bytes come back"
        mem.seek(info["small"])
        assert mem.read(MIB) == b"s" * MIB
    big, small = mapping(restored, info["big"]), mapping(restored, info["small"])
    assert "hg" not in small["flags"], "under 2 MiB nothing gains from huge pages: left as dumped"
    if not coldsnap_build or criu_mod.thp_mode() in ("absent", "never"):
        return  # another CRIU ignores the request; without THP there are no huge pages to have
    if huge:
        assert "hg" in big["flags"], big
        assert big["anon_huge_kib"] * 1024 >= BIG // 2, f"restored in 4 KiB pages: {big}"
    else:
        assert "hg" not in big["flags"], "without the request the process comes back as it was"
        if criu_mod.thp_mode() == "madvise":
            assert big["anon_huge_kib"] == 0, big


def test_a_request_with_an_unknown_value_is_refused_naming_the_field(example_request_text):
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import FormatError
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request

    req = json.loads(example_request_text)
    req["launch"]["units"][0].setdefault("environment", {})["COLDSNAP_HUGE_PAGES"] = "of"
    with pytest.raises(FormatError) as err:
        validate_request(req)
    assert "$.launch.units[0].environment.COLDSNAP_HUGE_PAGES" in str(err.value)
    assert "'on'" in str(err.value) and "'off'" in str(err.value)
    req["launch"]["units"][0]["environment"]["COLDSNAP_HUGE_PAGES"] = "Off"
    assert not huge_pages_wanted(validate_request(req)["launch"]["units"][0]["environment"])
