"""Pure layout rules and the weight-provider selection matrix."""

from __future__ import annotations

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import (
    Allocation,
    PackRef,
    check_coverage,
    pack_order,
    padded,
    residual_complement,
    slice_geometry,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.provider import (
    may_contact_hub,
    resolve_provider,
    select_provider,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.stage import StageSource
from payload_testlib import capture, make_worker


def test_padding_rounds_up_to_4096():
    assert [padded(n) for n in (1, 4095, 4096, 4097, 8192)] == [4096, 4096, 4096, 8192, 8192]


def test_residual_is_the_exact_complement():
    allocs = [Allocation("a", 0, 100), Allocation("b", 1000, 50)]
    res = residual_complement(allocs, [("a", 10, 20), ("a", 30, 70), ("b", 0, 50)])
    assert [(r.allocation, r.offset, r.size, r.blob_offset) for r in res] == [("a", 0, 10, 0)]
    check_coverage(allocs, [("model", [("a", 10, 20), ("a", 30, 70), ("b", 0, 50)]),
                            ("residual", [(r.allocation, r.offset, r.size) for r in res])])


@pytest.mark.parametrize("extents,match", [
    ([("a", 0, 50)], "gap"),
    ([("a", 0, 60), ("a", 50, 50)], "overlapping"),
    ([("a", 0, 101)], "past the end"),
    ([("a", 0, 100), ("z", 0, 1)], "unknown allocation"),
])
def test_coverage_refusals(extents, match):
    with pytest.raises(IntegrityError, match=match):
        check_coverage([Allocation("a", 0, 100)], [("model", extents)])


def test_pack_order_ignores_input_order_and_ties_do_not_change_bytes():
    ext = [("b", 0, 10, "sha256:" + "2" * 64), ("a", 5, 10, "sha256:" + "1" * 64), ("a", 0, 3, "sha256:" + "1" * 64)]
    one = pack_order(ext)
    two = pack_order(list(reversed(ext)))
    assert one == two
    assert [(e.sha256[7], e.size, e.pack_offset) for e in one] == [("1", 3, 0), ("1", 10, 4096), ("2", 10, 8192)]


def test_slice_geometry_checks_bounds():
    assert slice_geometry("F16", (4, 6), (1, 2, 5)) == (4, 12, 4, 24)
    for bad in [(2, 0, 1), (1, 5, 7), (1, 3, 2)]:
        with pytest.raises(IntegrityError):
            slice_geometry("F16", (4, 6), bad)
    with pytest.raises(IntegrityError, match="dtype"):
        slice_geometry("Q4", (4,), None)


@pytest.mark.parametrize("mode,available,recovery,defined,expected", [
    ("auto", True, True, True, "native"),
    ("auto", False, True, True, "recovery"),
    ("auto", False, True, False, "recovery"),
    ("auto", False, False, True, ColdSnapError),
    ("native", True, False, True, "native"),
    ("native", False, True, True, ColdSnapError),
    ("native", False, True, False, ColdSnapError),
    ("recovery", True, True, True, "recovery"),
    ("recovery", True, False, True, ColdSnapError),
    ("cache-only-auto", True, True, True, "native"),
    ("cache-only-auto", False, True, True, "recovery"),
    ("bogus", True, True, True, ColdSnapError),
])
def test_select_provider_matrix(mode, available, recovery, defined, expected):
    kwargs = dict(pack_available=available, recovery_enabled=recovery, pack_defined=defined)
    if expected is ColdSnapError:
        with pytest.raises(ColdSnapError):
            select_provider(mode, **kwargs)
    else:
        assert select_provider(mode, **kwargs) == expected


def test_hub_contact_by_mode():
    assert [may_contact_hub(m) for m in ("auto", "native", "recovery", "cache-only-auto")] == [True, True, False, False]


def test_resolve_provider_uses_cache_then_local_source(tmp_path):
    w = make_worker(tmp_path)
    wp, _out, cache = capture(tmp_path, w)
    src = StageSource("local", path=cache.path_for(wp.pack.sha256))
    host = tmp_path / "host2"
    r = resolve_provider("cache-only-auto", state_root=host, pack=wp.pack, recovery_enabled=True)
    assert r.provider == "recovery" and "not in the node cache" in r.reasons
    r = resolve_provider("cache-only-auto", state_root=host, pack=wp.pack, recovery_enabled=True, sources=[src])
    assert r.provider == "native" and r.payload is not None and r.payload.sha256 == wp.pack.sha256
    r.close()
    r = resolve_provider("recovery", state_root=host, pack=wp.pack, recovery_enabled=True)
    assert r.provider == "recovery" and r.payload is None
    missing = PackRef.for_digest("sha256:" + "9" * 64, 4096)
    with pytest.raises(ColdSnapError, match="not available"):
        resolve_provider("native", state_root=host, pack=missing, recovery_enabled=True, sources=[src])


def test_a_truncated_pack_is_reported_as_refused_not_as_missing(tmp_path):
    """After the verifier quarantines a truncated copy, the provider says what happened to it."""
    import hashlib
    import os

    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import PayloadRef
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.provider import resolve_provider
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import PayloadVerifier

    data = os.urandom(8192)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    cache = NodeCache(tmp_path)
    cache.ensure_dirs()
    cache.path_for(digest).write_bytes(data[:5000])
    with pytest.raises(ColdSnapError, match="5000 bytes"):
        PayloadVerifier().verify(cache, digest, 8192)
    with pytest.raises(ColdSnapError) as exc:
        resolve_provider("native", state_root=tmp_path, pack=PayloadRef.for_pack(digest, 8192),
                         recovery_enabled=True)
    assert "truncated" in str(exc.value) and "quarantine" in str(exc.value)
    assert "not in the node cache" not in str(exc.value)
