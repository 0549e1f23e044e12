"""``sglang.srt.plugins`` entry point ``coldsnap = coldsnap_engines.sglang.plugin:register``.

SGLang runs general plugins early in every process and then applies the hooks
registered with ``HookRegistry``. Outside ColdSnap (no ``COLDSNAP_CONTROL_FILE``
and no ``COLDSNAP_HYDRATION_SPEC``) nothing is registered.
"""

from __future__ import annotations

import os

from coldsnap_engines.common.control import CONTROL_ENV

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
HOOK_TARGETS = {
    "iterators": [f"sglang.srt.model_loader.weight_utils.{name}" for name in (
        "safetensors_weights_iterator", "fastsafetensors_weights_iterator", "instanttensor_weights_iterator")],
    "load_model": "sglang.srt.model_loader.loader.DefaultModelLoader.load_model",
    "get_model_loader": "sglang.srt.model_loader.loader.get_model_loader",
    "scheduler_init": f"{SCHEDULER}.__init__",
    "scheduler_pump": f"{SCHEDULER}.ingest_requests",
}
_DONE: list[bool] = []


def start_control(result, scheduler, *args, **kwargs):
    """AFTER ``Scheduler.__init__``: serve the control API of this scheduler (TP rank)."""
    from coldsnap_engines.common.control import start_from_env
    from coldsnap_engines.common.lifecycle import Lifecycle
    from coldsnap_engines.sglang.control import SglangControl
    from coldsnap_engines.sglang.state import STATE

    control = SglangControl(scheduler)
    lifecycle = Lifecycle(control, materialize_modes=("off",))
    control.lifecycle = lifecycle
    control.server = start_from_env(lifecycle, rank=control.rank, local_ranks=control.world,
                                    extra_status={"engine": "sglang"})
    STATE.control = control
    return result


def pump(result, scheduler, *args, **kwargs):
    """AFTER ``Scheduler.ingest_requests``: run queued control steps in the scheduler thread."""
    from coldsnap_engines.sglang.state import STATE

    control = STATE.control
    if control is not None and getattr(control, "scheduler", None) is scheduler:
        control.pump()
    return result


def register() -> None:
    """Register ColdSnap's hooks with SGLang's plugin framework (idempotent)."""
    if _DONE:
        return
    under_coldsnap = bool(os.environ.get(CONTROL_ENV))
    template = bool(os.environ.get("COLDSNAP_HYDRATION_SPEC"))
    if not (under_coldsnap or template):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from coldsnap_engines.sglang import loader

    if template:
        HookRegistry.register(HOOK_TARGETS["get_model_loader"], loader.select_loader, HookType.AROUND)
    if under_coldsnap:
        for target in HOOK_TARGETS["iterators"]:
            HookRegistry.register(target, loader.observe_iterator, HookType.AROUND)
        HookRegistry.register(HOOK_TARGETS["load_model"], loader.observe_load_model, HookType.AROUND)
        HookRegistry.register(HOOK_TARGETS["scheduler_init"], start_control, HookType.AFTER)
        HookRegistry.register(HOOK_TARGETS["scheduler_pump"], pump, HookType.AFTER)
    _DONE.append(True)
