"""Integration code shared by the engine integrations (vLLM, SGLang; the reference engine
keeps its own explicit loader but speaks the same control protocol).

* ``observer``: classify model bytes from the loader's checkpoint-to-destination
  writes (a torch dispatch mode), never from parameter names;
* ``allocations``: the live stable-allocation table and its readers/sinks;
* ``worker``: export (residual + manifest + replay plan + pack), hydration
  (native or recovery) and materialization over that table;
* ``lifecycle``: the engine state machine behind the control API;
* ``local``: an ``EngineControl`` template for a worker in the control server's process;
* ``control``: the loopback control server (``COLDSNAP_CONTROL_FILE``);
* ``distinfo``: entry-point metadata for images that carry this package as plain files.

Nothing here imports an engine; torch is imported lazily where a function needs it.
"""
