"""CSKV v1 frames against the golden fixtures (tests/fixtures/cskv/), which the in-unit runtime shares."""

from __future__ import annotations

import subprocess
import sys

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord import protocol as p
from cskv_testlib import CSKV_FIXTURES, load_index

CASES = load_index()["cases"]


def _bytes(name: str) -> bytes:
    return (CSKV_FIXTURES / name).read_bytes()


def test_fixtures_are_up_to_date() -> None:
    # The generator packs frames field by field from DESIGN.md, independently of protocol.py.
    r = subprocess.run([sys.executable, str(CSKV_FIXTURES / "generate.py"), "--check"],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr


def test_constants_match_the_index(cskv_index) -> None:
    proto = cskv_index["protocol"]
    assert p.REQUEST_HEADER_SIZE == proto["request_header_size"] == 28
    assert p.RESPONSE_HEADER_SIZE == proto["response_header_size"] == 12
    assert p.MAGIC == proto["magic"].encode()
    assert p.VERSION == proto["version"] == 1
    assert {op.name.lower(): int(op) for op in p.Op} == proto["ops"]
    assert {s.label: int(s) for s in p.Status} == proto["statuses"]
    assert (p.MAX_TOKEN, p.MAX_KEY, p.MAX_VALUE, p.MIN_TOKEN) == (
        proto["caps"]["token"], proto["caps"]["key"], proto["caps"]["value"], proto["caps"]["min_token"])


def test_every_op_and_status_has_a_fixture() -> None:
    assert {c["op"] for c in CASES if c["op"]} == set(p.OPS_BY_NAME)
    assert {c["status"] for c in CASES} == set(p.STATUS_BY_LABEL)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_response_encoding_matches_fixture(case) -> None:
    status = p.STATUS_BY_LABEL[case["status"]]
    value = bytes.fromhex(case["response_value_hex"])
    golden = _bytes(case["response"])
    assert p.encode_response(status, value) == golden
    assert p.decode_response(golden) == p.Response(status, value)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_request_header_checks_match_fixture(case) -> None:
    raw = _bytes(case["request"])
    header = p.decode_request_header(raw[: p.REQUEST_HEADER_SIZE])
    verdict = p.check_request_header(header)
    if case["status"] in ("invalid", "too-large") and case["name"] not in _OP_LEVEL:
        assert verdict == p.STATUS_BY_LABEL[case["status"]]
    else:
        assert verdict is None
        assert len(raw) == p.REQUEST_HEADER_SIZE + header.body_len


# Cases whose refusal comes from the op itself (after the header and token checks).
_OP_LEVEL = {"health-invalid-key", "get-invalid-value", "delete-invalid-value", "add-not-decimal",
             "add-plus-sign", "add-empty-delta", "add-stored-not-decimal", "add-overflow", "add-underflow",
             "too-large-store-full"}


def _well_formed(case) -> bool:
    header = p.decode_request_header(_bytes(case["request"])[: p.REQUEST_HEADER_SIZE])
    return bool(case["op"]) and case["request_complete"] and p.check_request_header(header) is None


@pytest.mark.parametrize("case", [c for c in CASES if _well_formed(c)], ids=lambda c: c["name"])
def test_request_encoding_matches_fixture(case) -> None:
    raw = _bytes(case["request"])
    token, key, value = (bytes.fromhex(case[f]) for f in ("token_hex", "key_hex", "value_hex"))
    assert p.encode_request(p.OPS_BY_NAME[case["op"]], token, key, value, timeout_ms=case["timeout_ms"]) == raw
    decoded = p.decode_request(raw)
    assert (decoded.op, decoded.token, decoded.key, decoded.value, decoded.timeout_ms) == (
        p.OPS_BY_NAME[case["op"]], token, key, value, case["timeout_ms"])


def test_request_layout_by_hand() -> None:
    frame = p.encode_request(p.Op.ADD, b"T" * 16, b"k", b"-1", timeout_ms=0x01020304)
    assert frame[:4] == b"CSKV" and frame[4] == 1 and frame[5] == 5 and frame[6:8] == b"\0\0"
    assert frame[8:12] == bytes([1, 2, 3, 4])
    assert frame[12:16] == (16).to_bytes(4, "big") and frame[16:20] == (1).to_bytes(4, "big")
    assert frame[20:24] == (2).to_bytes(4, "big") and frame[24:28] == (19).to_bytes(4, "big")
    assert frame[28:] == b"T" * 16 + b"k-1"


def test_check_order_invalid_before_too_large() -> None:
    huge = p.U32_MAX
    bad_magic = p.decode_request_header(
        p.pack_request_header(1, token_len=0, key_len=0, value_len=huge, magic=b"NOPE"))
    assert p.check_request_header(bad_magic) == p.Status.INVALID
    for field in ("token_len", "key_len", "value_len"):
        lengths = {"token_len": 0, "key_len": 0, "value_len": 0, field: huge}
        header = p.decode_request_header(p.pack_request_header(1, **lengths))
        assert p.check_request_header(header) == p.Status.TOO_LARGE, field


def test_caps_are_inclusive() -> None:
    header = p.decode_request_header(
        p.pack_request_header(1, token_len=p.MAX_TOKEN, key_len=p.MAX_KEY, value_len=p.MAX_VALUE))
    assert p.check_request_header(header) is None
    with pytest.raises(ValueError, match="caps"):
        p.encode_request(p.Op.SET, b"t" * 16, b"k" * (p.MAX_KEY + 1))


@pytest.mark.parametrize("raw", [
    b"CSKX\x01\x00\x00\x00\x00\x00\x00\x00",  # magic
    b"CSKV\x02\x00\x00\x00\x00\x00\x00\x00",  # version
    b"CSKV\x01\x00\x00\x01\x00\x00\x00\x00",  # reserved
    b"CSKV\x01\x07\x00\x00\x00\x00\x00\x00",  # unknown status
    b"CSKV\x01\x00\x00\x00\x01\x00\x00\x01",  # value over 16 MiB
    b"CSKV\x01\x00\x00\x00\x00\x00\x00",  # short
])
def test_bad_response_headers_are_refused(raw) -> None:
    with pytest.raises(p.ProtocolError):
        p.decode_response_header(raw)


@pytest.mark.parametrize(("text", "number"), [
    (b"0", 0), (b"-0", 0), (b"42", 42), (b"007", 7), (b"9223372036854775807", 2**63 - 1),
    (b"-9223372036854775808", -(2**63)), (b"9223372036854775808", None), (b"", None), (b"+1", None),
    (b" 1", None), (b"1 ", None), (b"1\n", None), (b"0x10", None), (b"1.0", None), (b"\xd9\xa1", None),
    (b"-", None), (b"1" * 20, None),
])
def test_parse_int64(text, number) -> None:
    assert p.parse_int64(text) == number


def test_request_repr_hides_the_token() -> None:
    request = p.decode_request(p.encode_request(p.Op.GET, b"supersecrettoken-123", b"k"))
    assert b"supersecrettoken" not in repr(request).encode()
    assert request.token == b"supersecrettoken-123"
