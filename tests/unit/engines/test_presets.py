"""The reference engine's model presets: each is a valid decoder for TP1 and TP2 and as large as its name says."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")

from coldsnap_engines.reference.config import PRESETS


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_validates_for_tp1_and_tp2(name):
    cfg = PRESETS[name]
    cfg.validate(1)
    cfg.validate(2)


@pytest.mark.parametrize("name", sorted(n for n in PRESETS if re.match(r"\d+g", n)))
def test_sized_presets_hold_about_their_gigabytes(name):
    cfg = PRESETS[name]
    gb = cfg.param_count() * cfg.bytes_per_param() / 1e9
    assert abs(gb - int(name.split("g")[0])) / int(name.split("g")[0]) < 0.15, f"{name} holds {gb:.2f} GB"
