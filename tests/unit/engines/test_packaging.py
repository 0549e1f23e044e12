"""The plugins are discoverable the way vLLM and SGLang discover them: entry points."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import tomllib

from coldsnap_engines.common.distinfo import ENTRY_POINTS, write_dist_info
from engines_testlib import REPO


def test_pyproject_declares_the_same_entry_points():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    for group, items in ENTRY_POINTS.items():
        assert declared[group] == items, group


def test_entry_points_resolve_without_importing_the_engines():
    import sys

    for items in ENTRY_POINTS.values():
        for value in items.values():
            mod, attr = value.split(":")
            assert callable(getattr(importlib.import_module(mod), attr))
    assert "vllm" not in sys.modules and "sglang" not in sys.modules


def test_an_image_dist_info_is_found_by_importlib_metadata(tmp_path):
    write_dist_info(tmp_path, "0.1.0")
    dist = next(md.distributions(path=[str(tmp_path)]))
    found = {(ep.group, ep.name, ep.value) for ep in dist.entry_points}
    assert found == {(g, n, v) for g, items in ENTRY_POINTS.items() for n, v in items.items()}


def test_plugins_stay_inert_outside_coldsnap(monkeypatch):
    from coldsnap_engines.sglang import plugin

    monkeypatch.delenv("COLDSNAP_CONTROL_FILE", raising=False)
    monkeypatch.delenv("COLDSNAP_HYDRATION_SPEC", raising=False)
    plugin.register()  # must not even import SGLang
    import sys

    assert "sglang" not in sys.modules and plugin._DONE == []
