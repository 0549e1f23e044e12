"""``vllm.general_plugins`` entry point ``coldsnap = coldsnap_engines.vllm.plugin:register``.

vLLM calls ``register`` in every process it starts (API server, engine core,
workers), possibly more than once; it is idempotent. It registers:

* load format ``coldsnap`` -> :class:`ColdSnapModelLoader` (always: a restored
  or template-started engine must find it);
* under ColdSnap only (``COLDSNAP_CONTROL_FILE`` set): the observing wrapper of
  vLLM's default loader for the safetensors-backed formats (auto, safetensors,
  fastsafetensors, instanttensor), so capture classifies model bytes from the
  loader's own writes;
* sleep-mode backend ``coldsnap`` (``--sleep-mode-backend coldsnap``) where vLLM has one;
* under ColdSnap, in the API-server process: asyncio's own event loop instead of uvloop's. uvloop's
  bundled libuv creates an io_uring instance, which CRIU cannot dump ("Unknown ... io_uring");
  vLLM offers no option for the loop, and the general plugins load while the server parses its
  arguments, before it calls ``uvloop.run``.
"""

from __future__ import annotations

import logging
import os

from coldsnap_engines.common.control import CONTROL_ENV

LOG = logging.getLogger("coldsnap.vllm")
_REGISTERED: set[str] = set()


def register() -> None:
    """Register ColdSnap's loaders and sleep backend with vLLM (idempotent)."""
    from vllm.model_executor.model_loader import register_model_loader

    from coldsnap_engines.vllm.loader import LOAD_FORMAT, OBSERVED_FORMATS, loader_classes

    coldsnap_loader, observing_loader = loader_classes()
    if "loader" not in _REGISTERED:
        register_model_loader(LOAD_FORMAT)(coldsnap_loader)
        _REGISTERED.add("loader")
    if os.environ.get(CONTROL_ENV) and "observer" not in _REGISTERED:
        for fmt in OBSERVED_FORMATS:
            register_model_loader(fmt)(observing_loader)
        _REGISTERED.add("observer")
    if os.environ.get(CONTROL_ENV) and "loop" not in _REGISTERED:
        use_asyncio_loop()
        _REGISTERED.add("loop")
    if "backend" not in _REGISTERED:
        _REGISTERED.add("backend")
        try:
            from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
        except ImportError:  # a vLLM without pluggable sleep backends (its CPU build has no sleep mode)
            return
        from coldsnap_engines.vllm.backend_name import BACKEND_CLASS, BACKEND_MODULE, BACKEND_NAME

        try:
            SleepModeBackendFactory.register_backend(BACKEND_NAME, BACKEND_MODULE, BACKEND_CLASS)
        except ValueError:
            pass  # already registered in this process (plugins may load more than once)


def use_asyncio_loop() -> None:
    """Make ``uvloop.run`` run its coroutine on asyncio's own loop (no io_uring in the process)."""
    import asyncio

    try:
        import uvloop
    except ImportError:
        return

    def run(main, *, debug=None, **_kwargs):
        return asyncio.run(main, debug=debug)

    uvloop.run = run
