"""The engine lifecycle's less travelled paths. The template state (snapshot driver n580): an engine
stops before CUDA, weights and transport; ``/start`` runs its own cold start, ``/resume`` builds it
from a hydration; nothing else is accepted there, and it never becomes a template again. And the
give-back after a failed in-place capture (below)."""

from __future__ import annotations

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import engine_control as ec
from coldsnap_engines.common.lifecycle import EngineStateError, Lifecycle

STEPS = ("pause_serving", "release_transport", "discard_kv", "release_weights", "recreate_memory",
         "rebuild_transport", "zero_kv", "resume_serving")
BODY = {"provider": "native", "manifest": "/m.json", "residual": "/w.blob", "replay": "/r.json"}


class Control:
    """Records what the lifecycle asks of the integration."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def describe(self) -> dict:
        return {}

    def allocations(self) -> dict:
        return {}

    def hydrate(self, spec: dict) -> dict:
        self.calls.append(f"hydrate:{spec['provider']}")
        return {"bytes": 4096}

    def __getattr__(self, name: str):
        """The integration's other steps: recorded by name."""
        if name not in STEPS:
            raise AttributeError(name)
        return lambda *_args: self.calls.append(name)


def template(calls: list[str]) -> Lifecycle:
    life = Lifecycle(Control())

    def restore(spec, hydrate):
        calls.append("arenas")
        hydrate()
        calls.append("warm-up")

    life.mark_template(start=lambda: calls.append("cold start"), restore=restore)
    return life


def test_start_runs_the_cold_start_once():
    calls: list[str] = []
    life = template(calls)
    assert life.state == ec.TEMPLATE and not life.started.is_set()
    assert life.status()["state"] == ec.TEMPLATE
    out = life.start({})
    assert calls == ["cold start"] and life.state == ec.READY and life.started.is_set()
    assert [s["name"] for s in out["spans"]] == ["engine.start"]
    with pytest.raises(EngineStateError, match="'ready'"):
        life.start({})
    with pytest.raises(EngineStateError):
        life.mark_template(start=lambda: None, restore=lambda s, h: None)


def test_resume_builds_the_engine_from_the_hydration(capsys):
    calls: list[str] = []
    life = template(calls)
    out = life.resume(BODY)
    assert calls == ["arenas", "warm-up"] and life.control.calls == ["hydrate:native"]
    assert life.state == ec.READY and life.started.is_set() and out["hydration"]["bytes"] == 4096
    assert {"engine.template.build", "engine.hydrate"} <= {s["name"] for s in out["spans"]}
    assert '"template": true' in capsys.readouterr().err  # the restore-boundary marker says so


@pytest.mark.parametrize(("route", "body", "error"), [
    ("resume", {**BODY, "warm": True}, EngineStateError),
    ("quiesce", None, EngineStateError),
    ("sleep", None, EngineStateError),
    ("start", {"unexpected": 1}, ValueError),
])
def test_a_template_refuses_everything_else(route, body, error):
    calls: list[str] = []
    life = template(calls)
    with pytest.raises(error):
        getattr(life, route)(body)
    assert life.state == ec.TEMPLATE and not calls


def test_a_failed_start_leaves_the_engine_loading_not_a_template():
    life = Lifecycle(Control())

    def broken():
        raise RuntimeError("CUDA init failed")

    life.mark_template(start=broken, restore=lambda s, h: None)
    with pytest.raises(RuntimeError, match="CUDA init failed"):
        life.start({})
    assert life.state == ec.LOADING and not life.started.is_set()
    with pytest.raises(EngineStateError):
        life.resume(BODY)


# An engine a failed in-place capture left quiesced is given back without a hydration; one it left
# released is hydrated again (the activation's give-back sends /resume either way).

def _ready() -> tuple[Lifecycle, Control]:
    control = Control()
    life = Lifecycle(control)
    life.mark_ready()
    return life, control


def test_a_quiesced_engine_serves_again_without_a_hydration():
    life, control = _ready()
    life.quiesce({})
    control.calls.clear()
    out = life.resume(BODY)
    assert life.state == ec.READY
    assert control.calls == ["rebuild_transport", "zero_kv", "resume_serving"]
    assert [s["name"] for s in out["spans"]] == ["engine.transport.rebuild", "engine.kv.zero",
                                                 "engine.serving.resume"]


def test_a_released_engine_is_hydrated_again():
    life, control = _ready()
    life.quiesce({})
    life.release({})
    control.calls.clear()
    life.resume(BODY)
    assert life.state == ec.READY
    assert control.calls == ["recreate_memory", "rebuild_transport", "hydrate:native", "zero_kv", "resume_serving"]
