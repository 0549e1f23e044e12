"""ColdSnap's vLLM integration, written to vLLM 0.33.0's plugin APIs.

* ``plugin.register`` (entry point ``vllm.general_plugins: coldsnap``, loaded in
  every vLLM process) registers the ``coldsnap`` load format, the observing
  wrappers of the safetensors-backed load formats (only under ColdSnap) and the
  ``coldsnap`` sleep-mode backend;
* ``worker.ColdSnapWorkerExtension`` (``--worker-extension-cls``) adds the
  worker-side collective-RPC methods (export, arm, load-format switch);
* ``endpoint.ColdSnapEndpointPlugin`` (entry point ``vllm.endpoint_plugins:
  coldsnap``, allow-listed by ``VLLM_PLUGINS``) starts the loopback control API in
  the API-server process and drives the engine through its ``EngineClient``.

Importing this package imports nothing from vLLM.
"""
