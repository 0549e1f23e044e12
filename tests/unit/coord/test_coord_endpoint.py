"""The endpoint descriptor: 0600, atomic, strict, and the token never shown."""

from __future__ import annotations

import json
import os
import stat

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common import fsutil
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError, FormatError
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.endpoint import (
    EndpointDescriptor,
    check_address,
    new_token,
    read_endpoint,
    write_endpoint,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.versions import (
    ENDPOINT_FORMAT,
    ENDPOINT_KIND,
)


@pytest.fixture
def descriptor() -> EndpointDescriptor:
    return EndpointDescriptor(address="127.0.0.1", port=40123, scope="op-1", token=new_token())


def test_written_0600_with_exactly_the_design_fields(tmp_path, descriptor) -> None:
    path = write_endpoint(tmp_path / "sub" / "endpoint.json", descriptor)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    doc = json.loads(path.read_text())
    assert doc == {"format": ENDPOINT_FORMAT, "kind": ENDPOINT_KIND, "address": "127.0.0.1", "port": 40123,
                   "scope": "op-1", "token": descriptor.token}
    assert (ENDPOINT_FORMAT, ENDPOINT_KIND) == (1, "coldsnap-coordinator-endpoint")
    assert read_endpoint(path) == descriptor


def test_mode_0600_regardless_of_umask(tmp_path, descriptor) -> None:
    old = os.umask(0)
    try:
        path = write_endpoint(tmp_path / "endpoint.json", descriptor)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_a_directory_the_write_creates_is_private_whatever_the_umask(tmp_path, descriptor) -> None:
    old = os.umask(0o022)
    try:
        path = write_endpoint(tmp_path / "run" / "endpoint.json", descriptor)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700


def test_rewrite_is_atomic_and_leaves_no_temp_files(tmp_path, descriptor, monkeypatch) -> None:
    path = write_endpoint(tmp_path / "endpoint.json", descriptor)
    inode = os.stat(path).st_ino
    newer = EndpointDescriptor("127.0.0.1", 40124, "op-1", new_token())
    write_endpoint(path, newer)
    assert os.stat(path).st_ino != inode  # a new file renamed over the old one, never rewritten in place
    assert read_endpoint(path) == newer

    def broken_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(fsutil.os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        write_endpoint(path, descriptor)
    monkeypatch.undo()
    assert read_endpoint(path) == newer  # the old descriptor is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["endpoint.json"]


def test_group_or_other_readable_file_is_refused(tmp_path, descriptor) -> None:
    path = write_endpoint(tmp_path / "endpoint.json", descriptor)
    os.chmod(path, 0o640)
    with pytest.raises(ColdSnapError, match="chmod 600"):
        read_endpoint(path)


def test_missing_file_names_the_fix(tmp_path) -> None:
    with pytest.raises(ColdSnapError, match=r"does not exist.*start the coordinator"):
        read_endpoint(tmp_path / "nope.json")


def _write_raw(tmp_path, text: str):
    path = tmp_path / "endpoint.json"
    path.write_text(text)
    os.chmod(path, 0o600)
    return path


GOOD = {"format": 1, "kind": "coldsnap-coordinator-endpoint", "address": "127.0.0.1", "port": 40123,
        "scope": "op-1", "token": "ab" * 32}


@pytest.mark.parametrize(("change", "message"), [
    ({"extra": 1}, "unknown"),
    ({"token": None}, "token"),
    ({"format": 2}, "format 2"),
    ({"format": True}, "format"),
    ({"format": 1.0}, "format"),
    ({"kind": "coldsnap-other"}, "kind"),
    ({"address": "localhost"}, "not an IP address"),
    ({"address": 127}, "address"),
    ({"port": 0}, "port"),
    ({"port": 65536}, "port"),
    ({"port": "40123"}, "port"),
    ({"port": True}, "port"),
    ({"scope": ""}, "scope"),
    ({"scope": "a\nb"}, "scope"),
    ({"token": "AB" * 32}, "token"),
    ({"token": "ab" * 31}, "token"),
    ({"token": "zz" * 32}, "token"),
])
def test_strict_validation(tmp_path, change, message) -> None:
    doc = {**GOOD, **change}
    if change.get("token", "") is None:
        del doc["token"]
        message = "missing"
    path = _write_raw(tmp_path, json.dumps(doc))
    with pytest.raises(ColdSnapError, match=message) as exc:
        read_endpoint(path)
    assert "ab" * 32 not in str(exc.value) and ("zz" * 32) not in str(exc.value)


def test_duplicate_keys_and_trailing_data_are_refused(tmp_path) -> None:
    body = json.dumps(GOOD)
    with pytest.raises(ColdSnapError, match="duplicated"):
        read_endpoint(_write_raw(tmp_path, body[:-1] + ', "port": 1}'))
    with pytest.raises(FormatError, match="trailing"):
        read_endpoint(_write_raw(tmp_path, body + "{}"))


def test_token_never_in_repr_str_or_public(descriptor) -> None:
    for text in (repr(descriptor), str(descriptor), json.dumps(descriptor.public())):
        assert descriptor.token not in text
    assert "token" not in descriptor.public()
    assert descriptor.token_bytes == descriptor.token.encode("ascii")


def test_tokens_are_fresh_64_hex() -> None:
    tokens = {new_token() for _i in range(100)}
    assert len(tokens) == 100
    assert all(len(t) == 64 and set(t) <= set("0123456789abcdef") for t in tokens)


def test_wildcard_bind_connects_over_loopback() -> None:
    assert EndpointDescriptor("0.0.0.0", 1, "s", "a" * 64).connect_address() == "127.0.0.1"
    assert EndpointDescriptor("::", 1, "s", "a" * 64).connect_address() == "::1"
    assert EndpointDescriptor("10.1.2.3", 1, "s", "a" * 64).connect_address() == "10.1.2.3"


def test_every_directory_the_write_creates_is_private(tmp_path, descriptor) -> None:
    old = os.umask(0o022)
    try:
        write_endpoint(tmp_path / "fresh" / "runs" / "op-9" / "endpoint.json", descriptor)
    finally:
        os.umask(old)
    for d in ("fresh", "fresh/runs", "fresh/runs/op-9"):
        assert stat.S_IMODE(os.stat(tmp_path / d).st_mode) == 0o700, d


@pytest.mark.parametrize("address", ["::ffff:0.0.0.0", "::ffff:127.0.0.1"])
def test_an_ipv4_address_written_as_ipv6_is_refused_naming_the_ipv4_form(address) -> None:
    with pytest.raises(ColdSnapError, match=r"IPv4 address written as IPv6.*give the IPv4 address itself: "
                                            + address.rsplit(":", 1)[1].replace(".", r"\.")):
        check_address(address)


def test_a_descriptor_another_user_could_replace_is_refused(world_writable, descriptor) -> None:
    """A directory of uid 65534 in a world-writable one (``/tmp/cskv``): its owner could swap in a descriptor that
    names their own listener, which would then receive every key a rank sets."""
    theirs = world_writable / "cskv"
    theirs.mkdir()
    path = write_endpoint(theirs / "coordinator.json", descriptor)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ColdSnapError, match=r"cskv belongs to uid 65534, .*anyone may write to.*directory of your own"):
        read_endpoint(path)
    os.chown(theirs, 0, 0)
    os.chown(path, 65534, 65534)  # their file in a directory of root's that anyone may write to
    theirs.chmod(0o1777)
    with pytest.raises(ColdSnapError, match=r"coordinator.json belongs to uid 65534"):
        read_endpoint(path)
    os.chown(path, 0, 0)
    assert read_endpoint(path) == descriptor
