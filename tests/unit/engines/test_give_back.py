"""An engine a failed in-place capture left quiesced is given back without a hydration; one it
left released is hydrated again (the activation's give-back sends /resume either way)."""

from __future__ import annotations

from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import engine_control as ec
from coldsnap_engines.common.lifecycle import Lifecycle

BODY = {"provider": "native", "manifest": "/m.json", "residual": "/w.blob", "replay": "/r.json"}


class Control:
    """Records what the lifecycle asks of the integration."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def describe(self) -> dict:
        return {}

    def allocations(self) -> dict:
        return {}

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)

        def record(*_args):
            self.calls.append(name)
            return {"bytes": 4096} if name == "hydrate" else None
        return record


def ready() -> tuple[Lifecycle, Control]:
    control = Control()
    life = Lifecycle(control)
    life.mark_ready()
    return life, control


def test_a_quiesced_engine_serves_again_without_a_hydration():
    life, control = ready()
    life.quiesce({})
    control.calls.clear()
    out = life.resume(BODY)
    assert life.state == ec.READY
    assert control.calls == ["rebuild_transport", "zero_kv", "resume_serving"]
    assert [s["name"] for s in out["spans"]] == ["engine.transport.rebuild", "engine.kv.zero",
                                                 "engine.serving.resume"]


def test_a_released_engine_is_hydrated_again():
    life, control = ready()
    life.quiesce({})
    life.release({})
    control.calls.clear()
    life.resume(BODY)
    assert life.state == ec.READY
    assert control.calls == ["recreate_memory", "rebuild_transport", "hydrate", "zero_kv", "resume_serving"]
