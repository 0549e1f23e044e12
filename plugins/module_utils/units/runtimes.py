"""Choosing a request's unit runtime, once (``launch.runtime``: ``host`` or ``docker``)."""

from __future__ import annotations

from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.units.docker_runtime import DockerRuntime
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.host_runtime import HostRuntime
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.runtime import UnitRuntime

RUNTIMES: dict[str, type[UnitRuntime]] = {"host": HostRuntime, "docker": DockerRuntime}


def runtime_for(request: dict, **kwargs: Any) -> UnitRuntime:
    """The unit runtime of ``request`` on one host (see :class:`UnitRuntime` for the arguments)."""
    return RUNTIMES[request["launch"]["runtime"]](request, **kwargs)
