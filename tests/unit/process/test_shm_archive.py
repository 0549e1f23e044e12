"""/dev/shm of a unit's container, archived beside the CRIU images after a dump and put back before
the restore (``CriuOptions.shm_archive``): plain files and directories with their modes, sockets
left to CRIU, and an archive from an altered capsule refused before a byte lands outside."""

from __future__ import annotations

import io
import os
import socket
import tarfile

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import criu


def test_files_and_modes_come_back_and_sockets_are_left_to_criu(tmp_path):
    shm = tmp_path / "shm"
    (shm / "ring").mkdir(parents=True)
    (shm / "psm_0a1b").write_bytes(os.urandom(70_000))
    (shm / "ring" / "sem.mp-x").write_bytes(b"\x01")
    os.chmod(shm / "psm_0a1b", 0o600)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(shm / "ipc-socket"))
        images = tmp_path / "images"
        images.mkdir()
        assert criu.archive_shm(images, str(shm)) == 70_001
    assert not (images / (criu.SHM_ARCHIVE + ".part")).exists()
    assert (images / criu.SHM_ARCHIVE).stat().st_mode & 0o777 == 0o600, "owner-only, as the CRIU images"
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert criu.unpack_shm(images, str(fresh)) == 2
    assert (fresh / "psm_0a1b").read_bytes() == (shm / "psm_0a1b").read_bytes()
    assert (fresh / "psm_0a1b").stat().st_mode & 0o777 == 0o600
    assert (fresh / "ring" / "sem.mp-x").read_bytes() == b"\x01"
    assert not (fresh / "ipc-socket").exists()


def test_options_record_the_archive_only_when_used():
    assert "shm_archive" not in criu.CriuOptions(link_remap=True, mount_namespace=True).to_json()
    opts = criu.CriuOptions(link_remap=True, shm_archive=True)
    assert criu.CriuOptions.from_json(opts.to_json()) == opts


@pytest.mark.parametrize("name,kind", [("../outside", tarfile.REGTYPE), ("/abs", tarfile.REGTYPE),
                                       ("link", tarfile.SYMTYPE), ("hard", tarfile.LNKTYPE)])
@pytest.mark.parametrize("after_a_good_file", [False, True])
def test_an_altered_archive_is_refused_before_anything_is_written(tmp_path, name, kind, after_a_good_file):
    images = tmp_path / "images"
    images.mkdir()
    with tarfile.open(images / criu.SHM_ARCHIVE, "w:gz") as tar:
        if after_a_good_file:
            good = tarfile.TarInfo("psm_good")
            good.size = 1
            tar.addfile(good, io.BytesIO(b"g"))
        info = tarfile.TarInfo(name)
        info.type = kind
        if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
            info.linkname = "/etc/passwd" if kind == tarfile.SYMTYPE else "psm_good"
            tar.addfile(info)
        else:
            info.size = 1
            tar.addfile(info, io.BytesIO(b"z"))
    dest = tmp_path / "shm"
    dest.mkdir()
    with pytest.raises(ColdSnapError, match="not a plain relative file"):
        criu.unpack_shm(images, str(dest))
    assert not (tmp_path / "outside").exists() and not list(dest.iterdir())


def test_a_missing_archive_names_the_capsule(tmp_path):
    with pytest.raises(ColdSnapError, match="archived /dev/shm"):
        criu.unpack_shm(tmp_path, str(tmp_path / "shm"))


def _archive(images, members):
    """members: (name, type, mode) in order; files hold one byte."""
    images.mkdir(exist_ok=True)
    with tarfile.open(images / criu.SHM_ARCHIVE, "w:gz") as tar:
        for name, kind, mode in members:
            info = tarfile.TarInfo(name)
            info.type, info.mode = kind, mode
            if kind == tarfile.REGTYPE:
                info.size = 1
                tar.addfile(info, io.BytesIO(b"x"))
            else:
                tar.addfile(info)


@pytest.mark.parametrize("members", [
    [("x", tarfile.REGTYPE, 0o600), ("x/y", tarfile.REGTYPE, 0o600)],   # below a file
    [("x/y", tarfile.REGTYPE, 0o600), ("x", tarfile.REGTYPE, 0o600)],   # a file where a directory is
    [("x", tarfile.REGTYPE, 0o600), ("x", tarfile.REGTYPE, 0o600)],     # twice
    [("d", tarfile.DIRTYPE, 0o700), ("d", tarfile.REGTYPE, 0o600)],
])
def test_names_that_collide_are_refused_before_anything_is_written(tmp_path, members):
    _archive(tmp_path / "images", members)
    dest = tmp_path / "shm"
    dest.mkdir()
    with pytest.raises(ColdSnapError, match="named twice or lies below a file"):
        criu.unpack_shm(tmp_path / "images", str(dest))
    assert not list(dest.iterdir())


def test_set_id_and_sticky_bits_never_come_back(tmp_path):
    _archive(tmp_path / "images", [("d", tarfile.DIRTYPE, 0o7777), ("d/f", tarfile.REGTYPE, 0o6755)])
    dest = tmp_path / "shm"
    dest.mkdir()
    assert criu.unpack_shm(tmp_path / "images", str(dest)) == 1
    assert (dest / "d" / "f").stat().st_mode & 0o7777 == 0o755
    assert not (dest / "d").stat().st_mode & 0o7000


@pytest.mark.parametrize("damage", ["truncated", "not gzip"])
def test_a_damaged_archive_is_named_not_a_traceback(tmp_path, damage):
    images = tmp_path / "images"
    _archive(images, [("psm_a", tarfile.REGTYPE, 0o600)])
    data = (images / criu.SHM_ARCHIVE).read_bytes()
    (images / criu.SHM_ARCHIVE).write_bytes(data[: len(data) // 2] if damage == "truncated" else b"junk" * 100)
    with pytest.raises(ColdSnapError, match="not a readable gzip'd tar archive"):
        criu.unpack_shm(images, str(tmp_path))


def test_a_restore_that_cannot_recreate_a_mount_of_the_captured_namespace_says_which_way_out(tmp_path):
    """Seen with a host unit in its own mount namespace: the host had a container's overlay mounted when the
    engine started, gone by the restore. The fix names the cause, not only the log."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.process.criu import failure_fix

    errs = ["23517: Error (criu/mount.c:2232): mnt: Unable to mount overlay /tmp/.criu.mntns.x/mnt-0000000080 "
            "(id=80): No such file or directory"]
    fix = failure_fix("restore", errs, tmp_path / "restore.log")
    assert "mount namespace" in fix and "docker runtime" in fix and str(tmp_path / "restore.log") in fix
    assert failure_fix("restore", ["Error (criu/files.c:1): other"], tmp_path / "r.log") == \
        f"see {tmp_path / 'r.log'} for the full CRIU log"
    assert "mount namespace" not in failure_fix("dump", errs, tmp_path / "dump.log")


def test_a_restore_onto_another_port_finds_the_archive_in_the_rebound_images(tmp_path):
    """A unit whose /dev/shm is archived (a container's vLLM) restored onto another serving port: CRIU
    restores a rebound copy of the images, and the archive must be unpacked from there too."""
    import struct

    from ansible_collections.coldsnap.fleet.plugins.module_utils.process.placement import Placement, rebind

    def field(num: int, value) -> bytes:  # protobuf: a varint (all below 128 here) or bytes
        return bytes([num << 3, value]) if isinstance(value, int) else bytes([num << 3 | 2, len(value)]) + value

    # A file_entry (type INETSK) whose inet_sk_entry is a TCP listener on 127.0.0.1:8000.
    port = field(7, 0)[:1] + bytes([0xC0, 0x3E])  # 8000 as a varint
    isk = (field(1, 2) + field(3, socket.AF_INET) + field(4, socket.SOCK_STREAM) + field(6, 10) + port
           + bytes([11 << 3]) + bytes([0xFF, 0x80, 0x80, 0x08]))  # src_addr 127.0.0.1 as one u32
    entry = field(1, 4) + field(2, 2) + field(4, isk)
    images = tmp_path / "images"
    images.mkdir()
    (images / "files.img").write_bytes(struct.pack("<II", 0x54564319, 0x56303138)
                                       + struct.pack("<I", len(entry)) + entry)
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "psm_0a1b").write_bytes(b"ring")
    criu.archive_shm(images, str(shm))
    placed, moved = rebind(images, tmp_path / "placed", Placement(port_shift=5), unit="unit-0")
    assert moved and placed == tmp_path / "placed"
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert criu.unpack_shm(placed, str(fresh)) == 1
    assert (fresh / "psm_0a1b").read_bytes() == b"ring"


def test_a_criu_that_hangs_is_stopped_with_an_error_that_names_its_log(tmp_path):
    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\nexec sleep 30\n")
    fake.chmod(0o755)
    images = tmp_path / "images"
    images.mkdir()
    (images / "dump.log").write_text("(00.001) Error (criu/cr-dump.c:1): stuck seizing 42\n")
    with pytest.raises(ColdSnapError) as err:
        criu.dump(criu.Criu(str(fake), "4.1.1"), 42, images, timeout=0.5)
    assert "did not finish within" in err.value.problem and "stuck seizing 42" in err.value.problem
    assert str(images / "dump.log") in err.value.fix
