"""Every module of the action group takes the options the group shares, so that
``module_defaults: {group/coldsnap.fleet.coldsnap: {state_root: ...}}`` works for all of them."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import STATE_ROOT_ARG

REPO = Path(__file__).resolve().parents[2]
GROUP = yaml.safe_load((REPO / "meta" / "runtime.yml").read_text())["action_groups"]["coldsnap"]
MODULES = sorted(p.stem for p in (REPO / "plugins" / "modules").glob("*.py"))


class _Captured(Exception):
    pass


def argument_spec(name: str) -> dict:
    """The module's argument_spec, taken from its AnsibleModule call without running it."""
    mod = importlib.import_module(f"ansible_collections.coldsnap.fleet.plugins.modules.{name}")
    captured: dict = {}

    def fake_module(*_args, **kwargs):
        captured.update(kwargs)
        raise _Captured

    mod.AnsibleModule = fake_module
    with pytest.raises(_Captured):
        mod.main()
    return captured["argument_spec"]


def test_the_group_lists_every_module() -> None:
    assert sorted(GROUP) == MODULES


@pytest.mark.parametrize("name", MODULES)
def test_module_accepts_the_shared_options(name: str) -> None:
    assert argument_spec(name)["state_root"] == STATE_ROOT_ARG
    doc = yaml.safe_load(importlib.import_module(
        f"ansible_collections.coldsnap.fleet.plugins.modules.{name}").DOCUMENTATION)
    fragments = doc["extends_documentation_fragment"]
    assert {"coldsnap.fleet.attributes", "coldsnap.fleet.attributes.ACTION_GROUP"} <= set(fragments)
    # Documented once, by the shared fragment: used, or accepted and unused.
    assert ("coldsnap.fleet.state" in fragments) != ("coldsnap.fleet.state.UNUSED" in fragments)
    assert "state_root" not in doc.get("options", {})
