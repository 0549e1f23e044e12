"""FAULTS.md 10: layer extraction refuses anything that could write outside its root.

Every case builds a real tar with the standard library, extracts it with
``safe_extract`` into ``tmp/dest`` and checks that nothing was written: not the
destination, not a temporary directory, and not the outside sentinel. Cases run on
both readers: a stream (Docker's archive API) and a local file (a capsule's blob,
read by offset).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import stat
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import archive
from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.archive import ArchiveError, safe_extract
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import IntegrityError


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return buf.getvalue()


def _file(name: str, data: bytes = b"x", mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.mode = mode
    return info, data


def _dir(name: str, mode: int = 0o755) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    info.mode = mode
    return info, None


def _link(name: str, target: str, *, hard: bool = False) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = tarfile.LNKTYPE if hard else tarfile.SYMTYPE
    info.linkname = target
    return info, None


def _special(name: str, kind: bytes) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.devmajor, info.devminor = 1, 3
    return info, None


READERS = ["stream", "file"]


@pytest.fixture
def opened(tmp_path: Path) -> Iterator[Callable[[bytes, str], IO[bytes]]]:
    """``opened(data, how)``: ``data`` as the reader ``how`` names, "stream" (no file descriptor: Docker's
    archive API) or "file" (a regular file, as a capsule blob is read); closed after the test."""
    with contextlib.ExitStack() as stack:
        def make(data: bytes, how: str) -> IO[bytes]:
            if how == "stream":
                return io.BytesIO(data)
            path = tmp_path / f"layer-{hashlib.sha256(data).hexdigest()[:12]}.tar"
            path.write_bytes(data)
            return stack.enter_context(open(path, "rb"))

        yield make


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture
def sandbox(tmp_path: Path) -> Path:
    """tmp/work is the extraction parent; tmp/outside.txt is a sentinel that must never change."""
    (tmp_path / "work").mkdir()
    (tmp_path / "outside.txt").write_text("untouched")
    return tmp_path


def _assert_nothing_written(sandbox: Path) -> None:
    assert sorted(os.listdir(sandbox / "work")) == [], "no destination and no temporary directory may remain"
    assert (sandbox / "outside.txt").read_text() == "untouched"
    assert sorted(n for n in os.listdir(sandbox) if not n.startswith("layer-")) == ["outside.txt", "work"]


UNSAFE = {
    "dotdot": [_file("ok.txt"), _file("../outside.txt", b"pwned")],
    "dotdot-nested": [_dir("a"), _file("a/../../outside.txt", b"pwned")],
    "absolute": [_file("/tmp/coldsnap-test-absolute-member", b"pwned")],
    "symlink-out-relative": [_link("escape", "../outside.txt")],
    "symlink-out-absolute": [_link("escape", "/etc/passwd")],
    "symlink-then-write-through": [_dir("sub"), _link("via", "sub"), _file("via/file.txt", b"x")],
    "symlink-dir-escape-then-write": [_link("up", ".."), _file("up/outside.txt", b"pwned")],
    "hardlink-outside": [_link("h", "../outside.txt", hard=True)],
    "hardlink-absolute": [_link("h", "/etc/passwd", hard=True)],
    "hardlink-unknown": [_link("h", "never-extracted.txt", hard=True)],
    "char-device": [_special("null", tarfile.CHRTYPE)],
    "block-device": [_special("sda", tarfile.BLKTYPE)],
    "fifo": [_special("pipe", tarfile.FIFOTYPE)],
    "duplicate": [_file("a.txt", b"1"), _file("a.txt", b"2")],
    "duplicate-directory": [_dir("d", 0o700), _file("d/x"), _dir("d", 0o755)],
}


@pytest.mark.parametrize("how", READERS)
@pytest.mark.parametrize("case", sorted(UNSAFE))
def test_unsafe_archive_is_refused_and_nothing_is_written(sandbox: Path, opened, case: str, how: str) -> None:
    data = _tar(UNSAFE[case])
    with pytest.raises(ArchiveError) as err:
        safe_extract(opened(data, how), sandbox / "work" / "dest", what="test layer")
    assert "test layer" in str(err.value)
    assert "fix" not in str(err.value) or ";" in str(err.value)
    _assert_nothing_written(sandbox)
    assert not Path("/tmp/coldsnap-test-absolute-member").exists()


@pytest.mark.parametrize("how", READERS)
def test_a_good_archive_extracts_with_modes_links_and_setuid(sandbox: Path, opened, how: str) -> None:
    data = _tar([_dir("img", 0o750), _file("img/pages-1.img", b"pages", 0o600), _file("tool", b"#!", 0o4755),
                 _link("img/latest", "pages-1.img"), _link("img/hard", "img/pages-1.img", hard=True),
                 _link("up-and-in", "img/../tool")])
    dest = sandbox / "work" / "dest"
    digests: dict[str, str] = {}
    written = safe_extract(opened(data, how), dest, expected_digest=_sha(data), digests=digests)
    assert "img/pages-1.img" in written
    # Every regular file's digest, hard links included, taken from the bytes as they were written.
    assert digests == {"img/pages-1.img": _sha(b"pages"), "tool": _sha(b"#!"), "img/hard": _sha(b"pages")}
    assert (dest / "img" / "pages-1.img").read_bytes() == b"pages"
    assert stat.S_IMODE(os.stat(dest / "img").st_mode) == 0o750
    assert stat.S_IMODE(os.stat(dest / "img" / "pages-1.img").st_mode) == 0o600
    # Extraction never keeps set-id, sticky or world-write bits.
    assert stat.S_IMODE(os.stat(dest / "tool").st_mode) == 0o755
    assert os.readlink(dest / "img" / "latest") == "pages-1.img"
    assert os.stat(dest / "img" / "hard").st_ino == os.stat(dest / "img" / "pages-1.img").st_ino
    assert sorted(os.listdir(sandbox / "work")) == ["dest"]


def test_a_directory_listed_after_its_members_is_one_entry(sandbox: Path) -> None:
    """Tools may list a directory after the files in it (its parent was made for them): one entry, fine."""
    safe_extract(io.BytesIO(_tar([_file("d/x"), _dir("d", 0o750)])), sandbox / "work" / "dest", what="test layer")
    assert stat.S_IMODE(os.stat(sandbox / "work" / "dest" / "d").st_mode) == 0o750


@pytest.mark.parametrize("how", READERS)
def test_digest_mismatch_leaves_nothing(sandbox: Path, opened, how: str) -> None:
    data = _tar([_file("a.txt", b"hello")])
    with pytest.raises(IntegrityError, match="expected sha256:0000"):
        safe_extract(opened(data, how), sandbox / "work" / "dest", expected_digest="sha256:" + "0" * 64)
    _assert_nothing_written(sandbox)


@pytest.mark.parametrize("where", ["data", "header", "padding", "end-of-archive"])
@pytest.mark.parametrize("how", READERS)
def test_one_corrupted_byte_anywhere_in_the_layer_is_caught(sandbox: Path, opened, how: str, where: str) -> None:
    """The layer digest covers every byte: file data, headers, the padding between members and the
    zero blocks after the last one (a reader that skips what it does not extract still hashes it)."""
    data = bytearray(_tar([_file("a.txt", b"a" * 700), _file("b.txt", b"b" * 100)]))
    digest = _sha(bytes(data))
    with tarfile.open(fileobj=io.BytesIO(bytes(data)), mode="r:") as tar:
        a, b = tar.getmembers()
    at = {"data": b.offset_data + 10, "header": b.offset + 100, "padding": a.offset_data + 700 + 5,
          "end-of-archive": len(data) - 3}[where]
    data[at] ^= 0x01
    with pytest.raises((IntegrityError, ArchiveError)):
        safe_extract(opened(bytes(data), how), sandbox / "work" / "dest", expected_digest=digest)
    _assert_nothing_written(sandbox)


@pytest.mark.parametrize("how", READERS)
def test_truncated_archive_is_refused(sandbox: Path, opened, how: str) -> None:
    data = _tar([_file("a.txt", b"x" * 5000)])
    with pytest.raises(ArchiveError, match=r"not a readable tar|ends before its 5000 bytes|outside the 1500-byte layer"):
        safe_extract(opened(data[:1500], how), sandbox / "work" / "dest")
    _assert_nothing_written(sandbox)


@pytest.mark.parametrize("how", READERS)
@pytest.mark.parametrize("extracted", [True, False])
def test_a_member_with_a_negative_size_is_refused_not_looped_on(sandbox: Path, opened, how: str,
                                                                extracted: bool) -> None:
    """A negative size field (base-256) sends tarfile's offset back onto the same header: refused, whether
    the member is extracted or skipped (a reader by offset would otherwise read that header for ever)."""
    good = _tar([_file("a.txt", b"a"), _file("skip/b.txt", b"b" * 600), _file("c.txt", b"c")])
    with tarfile.open(fileobj=io.BytesIO(good), mode="r:") as tar:
        b = tar.getmember("skip/b.txt")
    data = bytearray(good)
    field = b.offset + 124  # ustar size field: 12 bytes; 0xff... is base-256 for a negative number
    data[field:field + 12] = b"\xff" * 12
    chksum = sum(data[b.offset:b.offset + 148]) + 8 * 32 + sum(data[b.offset + 156:b.offset + 512])
    data[b.offset + 148:b.offset + 156] = b"%06o\0 " % chksum

    def select(name: str) -> str | None:
        return name if extracted or not name.startswith("skip") else None

    with pytest.raises(ArchiveError):
        safe_extract(opened(bytes(data), how), sandbox / "work" / "dest", select=select, what="test layer")
    _assert_nothing_written(sandbox)


def test_a_local_member_that_claims_bytes_past_the_end_is_refused(sandbox: Path, opened) -> None:
    good = _tar([_file("a.txt", b"a"), _file("skip/b.txt", b"b" * 600)])
    with tarfile.open(fileobj=io.BytesIO(good), mode="r:") as tar:
        b = tar.getmember("skip/b.txt")
    data = bytearray(good)
    data[b.offset + 124:b.offset + 136] = b"%011o\0" % (1 << 32)
    chksum = sum(data[b.offset:b.offset + 148]) + 8 * 32 + sum(data[b.offset + 156:b.offset + 512])
    data[b.offset + 148:b.offset + 156] = b"%06o\0 " % chksum
    with pytest.raises(ArchiveError, match="outside the"):
        safe_extract(opened(bytes(data), "file"), sandbox / "work" / "dest",
                     select=lambda n: None if n.startswith("skip") else n, what="test layer")
    _assert_nothing_written(sandbox)


@pytest.mark.parametrize("how", READERS)
def test_a_sparse_member_is_refused(sandbox: Path, opened, how: str) -> None:
    """A sparse member's holes would be filled by tarfile's reader but not by a read by offset: refused."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo("pages.img")
        info.type = tarfile.GNUTYPE_SPARSE
        tar.addfile(info)
    with pytest.raises(ArchiveError, match="sparse file"):
        safe_extract(opened(buf.getvalue(), how), sandbox / "work" / "dest", what="test layer")
    _assert_nothing_written(sandbox)


def test_a_local_layer_is_read_in_chunks_through_its_buffer_ring(sandbox: Path, opened, monkeypatch) -> None:
    """Files larger than a chunk, gaps between them and a skipped member: the same files and digests
    from both readers, with tiny chunks so every buffer of the ring is reused many times."""
    monkeypatch.setattr(archive, "COPY_CHUNK", 4096)
    big = os.urandom(4096 * 9 + 123)
    other = os.urandom(70_000)
    data = _tar([_dir("s"), _file("s/big.img", big), _file("skip/me", os.urandom(10_000)), _file("s/other", other),
                 _file("s/empty", b"")])

    def select(name: str) -> str | None:
        return None if name.startswith("skip") else name

    results = []
    for how in READERS:
        digests: dict[str, str] = {}
        dest = sandbox / "work" / how
        safe_extract(opened(data, how), dest, expected_digest=_sha(data), select=select, digests=digests)
        assert (dest / "s" / "big.img").read_bytes() == big
        assert (dest / "s" / "other").read_bytes() == other
        assert not (dest / "skip").exists()
        results.append(digests)
    assert results[0] == results[1] == {"s/big.img": _sha(big), "s/other": _sha(other), "s/empty": _sha(b"")}


def test_existing_destination_is_not_overwritten_unless_asked(sandbox: Path) -> None:
    dest = sandbox / "work" / "dest"
    dest.mkdir()
    (dest / "old").write_text("old")
    data = _tar([_file("new", b"new")])
    with pytest.raises(ArchiveError, match="already exists"):
        safe_extract(io.BytesIO(data), dest)
    safe_extract(io.BytesIO(data), dest, replace=True)
    assert sorted(os.listdir(dest)) == ["new"]
    assert sorted(os.listdir(sandbox / "work")) == ["dest"]


def test_collect_tree_refuses_escaping_symlink_and_fifo(tmp_path: Path) -> None:
    src = tmp_path / "state"
    src.mkdir()
    (src / "ok").write_text("ok")
    (src / "inside").symlink_to("ok")
    entries, _unused = archive.collect_tree(src, "var/lib/state")
    assert [e.arcname for e in entries] == ["var/lib/state", "var/lib/state/inside", "var/lib/state/ok"]
    (src / "out").symlink_to("../elsewhere")
    with pytest.raises(ArchiveError, match="points outside"):
        archive.collect_tree(src, "var/lib/state")
    (src / "out").unlink()
    os.mkfifo(src / "fifo")
    with pytest.raises(ArchiveError, match="special file"):
        archive.collect_tree(src, "var/lib/state")


def test_written_layers_are_deterministic_and_round_trip(tmp_path: Path) -> None:
    src = tmp_path / "state"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f").write_bytes(b"abc")
    os.link(src / "d" / "f", src / "g")
    entries, _unused = archive.collect_tree(src, "s")
    out1, out2 = io.BytesIO(), io.BytesIO()
    d1 = archive.write_layer(entries, out1)
    d2 = archive.write_layer(entries, out2)
    assert d1 == d2 and out1.getvalue() == out2.getvalue()
    assert archive.write_layer(entries, None) == d1  # hash-only pass gives the same identity
    dest = tmp_path / "x"
    safe_extract(io.BytesIO(out1.getvalue()), dest, expected_digest=d1[0])
    assert (dest / "s" / "g").read_bytes() == b"abc"
    assert os.stat(dest / "s" / "g").st_ino == os.stat(dest / "s" / "d" / "f").st_ino


@pytest.mark.parametrize("extra", [[_file("b/escaped", b"pwned")], []], ids=["written-through", "links-only"])
def test_a_symlink_chain_that_climbs_through_another_link_is_refused(sandbox: Path, extra) -> None:
    """``a/up -> ..`` is inside as text, ``b -> a/up/..`` too; together they leave the root."""
    data = _tar([_dir("a"), _link("a/up", ".."), _link("b", "a/up/.."), *extra])
    with pytest.raises(ArchiveError):
        safe_extract(io.BytesIO(data), sandbox / "work" / "dest")
    _assert_nothing_written(sandbox)


def test_links_are_checked_against_the_name_they_get_below_the_destination(sandbox: Path) -> None:
    """A state prefix stripped by ``select`` moves a link up one level: ``state/x -> ../..`` is inside
    the archive as text but outside ``dest`` once ``state/`` is dropped."""
    data = _tar([_dir("state"), _link("state/x", "../.."), _file("state/ok", b"1")])

    def select(name: str) -> str | None:
        return name[len("state/"):] if name.startswith("state/") else ("" if name == "state" else None)

    with pytest.raises(ArchiveError):
        safe_extract(io.BytesIO(data), sandbox / "work" / "dest", select=select)
    _assert_nothing_written(sandbox)


@pytest.mark.parametrize("mode", [0o6777, 0o4755, 0o2750, 0o1777, 0o666])
def test_set_id_sticky_and_world_write_bits_never_survive_extraction(sandbox: Path, mode: int) -> None:
    data = _tar([_dir("d", mode), _file("d/f", b"x", mode)])
    dest = sandbox / "work" / "dest"
    safe_extract(io.BytesIO(data), dest)
    for p in (dest / "d", dest / "d" / "f"):
        got = stat.S_IMODE(os.stat(p).st_mode)
        assert got & 0o7002 == 0, f"{p}: {oct(got)}"
        assert got == mode & 0o775


@pytest.mark.parametrize("mode", [0o755, 0o775, 0o777, 0o500, 0o000])
def test_the_destination_stays_private_whatever_the_archive_says_of_its_root(sandbox: Path, mode: int) -> None:
    """Captured state is process memory: a root entry (``./``, or the state prefix a select maps
    onto the root) neither widens the destination's 0700 nor locks its owner out."""
    data = _tar([_dir("state", mode), _file("state/f", b"x")])

    def select(name: str) -> str | None:
        return "" if name == "state" else (name[len("state/"):] if name.startswith("state/") else None)

    dest = sandbox / "work" / "dest"
    safe_extract(io.BytesIO(data), dest, select=select)
    assert stat.S_IMODE(os.stat(dest).st_mode) == 0o700
    assert (dest / "f").read_bytes() == b"x"


@pytest.mark.parametrize("mtime", [1e30, -1e20, float("nan"), -1])
def test_a_modification_time_no_file_system_takes_is_refused_by_name(sandbox: Path, mtime: float) -> None:
    info, data = _file("ok.txt")
    info.pax_headers = {"mtime": repr(mtime)}  # read back as the member's mtime
    with pytest.raises(ArchiveError, match="modification time"):
        safe_extract(io.BytesIO(_tar([(info, data)])), sandbox / "dest", what="layer")
    _assert_nothing_written(sandbox)


@pytest.mark.parametrize("name", ["d/" + "n" * 256, "x/" * 2100 + "f"])
def test_a_name_longer_than_a_file_system_takes_is_refused_by_name(sandbox: Path, name: str) -> None:
    with pytest.raises(ArchiveError, match="longer than a file system allows"):
        safe_extract(io.BytesIO(_tar([_file(name)])), sandbox / "dest", what="layer")
    _assert_nothing_written(sandbox)
