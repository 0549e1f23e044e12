"""ColdSnap's SGLang integration, written to SGLang 0.5.23's plugin framework.

``plugin.register`` (entry point ``sglang.srt.plugins: coldsnap``) registers
hooks through SGLang's ``HookRegistry``: observation of the normal safetensors
iterators and ``DefaultModelLoader.load_model``, the ``coldsnap`` template-restore
loader, and the control API inside each scheduler process, whose steps run in
the scheduler thread between iterations. Weights, KV cache and CUDA graphs
are torch_memory_saver regions (``--enable-memory-saver``), paused and resumed at
the same virtual addresses. Materialization stays off (no canonical writer).

Importing this package imports nothing from SGLang.
"""
