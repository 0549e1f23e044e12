"""Engine integrations that run inside a launch unit: reference (ours), vllm, sglang.

The controller, the request (``launch.engine``) and the in-unit runtime select an
integration by name through ``module_utils.formats.engines.ENGINES``.
"""
