"""The reference engine's ``--compile``: TorchInductor graphs built during start-up give the
same greedy tokens as the eager engine and serve every later request without a recompile
(what a restored process relies on: it never compiles again)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from coldsnap_engines.reference.config import PRESETS
from coldsnap_engines.reference.engine import Engine
from coldsnap_engines.reference.transport import Transport
from coldsnap_engines.reference.weights import make_model

PROMPTS = ["", "a", "ColdSnap says:", "x" * 100]  # decode-only, shortest prefill, typical, long


def _engine(model_dir, *, compile: bool) -> Engine:
    engine = Engine(model_dir, device="cpu", rank=0, world=1, served_model_name="tiny", compile=compile)
    engine.start(Transport(rank=0, world=1, device="cpu", endpoint_file=None, scope="local"))
    return engine


def test_compiled_engine_matches_eager_and_never_recompiles_after_warmup(tmp_path, monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model_dir = tmp_path / "model"
    make_model(model_dir, PRESETS["tiny"], model_id="coldsnap/reference-tiny")
    eager = [_engine(model_dir, compile=False).generate(p, 6) for p in PROMPTS]

    before = counters["stats"]["unique_graphs"]
    engine = _engine(model_dir, compile=True)
    compiled_at_start = counters["stats"]["unique_graphs"] - before
    assert compiled_at_start >= 2, "start-up compiled nothing"  # prefill and decode graphs
    assert [engine.generate(p, 6) for p in PROMPTS] == eager
    assert counters["stats"]["unique_graphs"] - before == compiled_at_start, "a request recompiled"


def test_eager_engine_compiles_nothing(tmp_path):
    from torch._dynamo.utils import counters

    model_dir = tmp_path / "model"
    make_model(model_dir, PRESETS["tiny"], model_id="coldsnap/reference-tiny")
    before = counters["stats"]["unique_graphs"]
    engine = _engine(model_dir, compile=False)
    engine.generate("ColdSnap says:", 4)
    assert counters["stats"]["unique_graphs"] == before
    assert engine.decoder.qkv == engine.decoder._qkv


@pytest.mark.parametrize(("missing", "fix"), [("compiler", "apt-get install g++"),
                                              ("headers", "apt-get install python3-dev")])
def test_compile_on_cpu_without_its_build_tools_fails_at_once_with_the_fix(tmp_path, monkeypatch, missing, fix):
    import sysconfig

    model_dir = tmp_path / "model"
    make_model(model_dir, PRESETS["tiny"], model_id="coldsnap/reference-tiny")
    if missing == "compiler":
        monkeypatch.setenv("CXX", "no-such-c++-compiler")
    else:
        monkeypatch.setattr(sysconfig, "get_paths", lambda: {"include": str(tmp_path / "no-headers")})
    with pytest.raises(ValueError, match=fix):
        Engine(model_dir, device="cpu", rank=0, world=1, served_model_name="tiny", compile=True)


def test_dropped_graphs_leave_the_process_and_are_recreated_from_the_plan(tmp_path, monkeypatch):
    """graph_policy 'recreate-from-plan': before a dump the compiled graphs go (eager, TorchDynamo reset);
    after the restore they are compiled again on the first request, with the same tokens."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model_dir = tmp_path / "model"
    make_model(model_dir, PRESETS["tiny"], model_id="coldsnap/reference-tiny")
    engine = _engine(model_dir, compile=True)
    before = [engine.generate(p, 6) for p in PROMPTS]
    assert engine.drop_graphs() == 2
    assert engine.decoder.qkv == engine.decoder._qkv and not engine.decoder.compiled
    assert engine.drop_graphs() == 0, "nothing left to drop"
    graphs = counters["stats"]["unique_graphs"]
    assert engine.recreate_graphs() == 2 and engine.decoder.compiled
    assert [engine.generate(p, 6) for p in PROMPTS] == before
    assert counters["stats"]["unique_graphs"] > graphs, "the graphs were built again"
    assert engine._compile_settled, "the compile workers of the rebuild were stopped"
    eager = _engine(model_dir, compile=False)
    assert eager.drop_graphs() == 0 and eager.recreate_graphs() == 0, "an eager engine has no graphs"
