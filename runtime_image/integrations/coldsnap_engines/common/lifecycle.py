"""The engine lifecycle behind the control API, for engines ColdSnap does not own.

States (the same names the reference engine reports, so the activation runtime
stays engine-neutral):

    loading -> ready -> quiesced -> released -> [snapshot] -> (warm ->) ready
    ready <-> sleeping
    loading -> template -> [snapshot] -> ready   (snapshot driver n580: /start or /resume)

``quiesce`` stops serving, releases the distributed transport and discards
the KV cache; ``export`` writes the worker payloads while the weights are
resident; ``release`` frees the weight memory (addresses kept) and switches the
live load config to the ``coldsnap`` loader; ``resume`` re-creates memory at the
captured addresses, rebuilds the transport from the restore activation's
coordinator and (unless warm) hydrates weights and re-zeros the KV cache.

A *template* (:meth:`Lifecycle.mark_template`) is an engine that stopped before any CUDA,
weight or transport work: its snapshot is context-free, so it restores under any NVIDIA
driver. ``/start`` runs the engine's own cold start from there (a capture continues that
way to its validation), ``/resume`` builds the engine from a hydration instead (the
allocations are created fresh at new addresses, then filled from the pack or recovery).

Engine specifics sit behind :class:`EngineControl`; an engine may run its
workers in other processes (vLLM's collective RPC, SGLang's scheduler loop).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import engine_control as ec

from coldsnap_engines.common import cpu_state


class EngineStateError(RuntimeError):
    """The engine is not in a state that allows the requested transition (HTTP 409)."""


class EngineControl(Protocol):
    """What an engine integration provides to the lifecycle (all calls are blocking)."""

    def describe(self) -> dict: ...
    def pause_serving(self) -> None: ...
    def resume_serving(self) -> None: ...
    def release_transport(self) -> None: ...
    def rebuild_transport(self, spec: dict) -> None: ...
    def discard_kv(self) -> None: ...
    def export(self, body: dict) -> dict: ...
    def release_weights(self) -> None: ...
    def recreate_memory(self) -> None: ...
    def hydrate(self, spec: dict) -> dict: ...
    def zero_kv(self) -> None: ...
    def materialize(self, spec: dict) -> dict: ...
    def sleep(self) -> None: ...
    def wake(self, spec: dict) -> dict: ...
    def allocations(self) -> dict: ...


class Timing:
    """Spans on this host's monotonic clock, returned to the activation runtime."""

    def __init__(self) -> None:
        self.spans: list[dict] = []

    def span(self, name: str):
        rec = {"name": name, "start_ns": time.monotonic_ns(), "end_ns": None, "attrs": {}}
        self.spans.append(rec)

        class _Ctx:
            def __enter__(self):
                return rec

            def __exit__(self, *exc):
                rec["end_ns"] = time.monotonic_ns()
                return False

        return _Ctx()


class Lifecycle:
    """The control-plane state machine of one engine instance (one control endpoint)."""

    def __init__(self, control: EngineControl, *, materialize_modes: tuple[str, ...] = ("off", "async", "required"),
                 log=None) -> None:
        self.control = control
        self.materialize_modes = materialize_modes
        self.state = ec.LOADING
        self.lock = threading.RLock()
        self.timing = Timing()
        self.restores = 0
        self.last_error: str | None = None
        self.materialized: dict | None = None
        self._materializer: threading.Thread | None = None
        self.graphs_released = False  # /release dropped the graphs (recreate-from-plan); /resume re-creates them
        self._log = log or (lambda msg: print(f"[coldsnap] {msg}", file=sys.stderr, flush=True))
        # A template's two ways on: the engine's cold start, and its build from a hydration.
        self._template: tuple[Callable[[], None], Callable[[dict, Callable[[], None]], None]] | None = None
        self.started = threading.Event()  # left the template (or never was one) and serving

    def mark_template(self, *, start: Callable[[], None],
                      restore: Callable[[dict, Callable[[], None]], None]) -> None:
        """The engine stops here, before CUDA, weights and transport, until ``/start`` (``start()``:
        its cold start) or ``/resume`` (``restore(spec, hydrate)``: create the allocations, call
        ``hydrate()``, finish the start). The integration's main thread waits on :attr:`started`."""
        with self.lock:
            if self.state != ec.LOADING:
                raise EngineStateError(f"engine is {self.state!r}; only a loading engine becomes a template")
            self._template = (start, restore)
            self.state = ec.TEMPLATE

    def mark_ready(self) -> None:
        """The engine finished its own start-up (called once by the integration)."""
        with self.lock:
            if self.state == ec.LOADING:
                self.state = ec.READY
                self.started.set()

    def start(self, body: dict | None = None) -> dict:
        """``/start``: a template runs the engine's own cold start (weights from the checkpoint)."""
        if body:
            raise ValueError(f"/start takes no body fields, got {sorted(body)}")
        with self.lock:
            self._expect(ec.TEMPLATE)
            start, _restore = self._template
            self.timing = Timing()
            self.state = ec.LOADING  # a failure leaves it loading: the engine cannot go back to a template
            self._template = None
            with self.timing.span("engine.start"):
                start()
            self.state = ec.READY
            self.started.set()
            return {"spans": self.timing.spans}

    def _resume_template(self, spec: dict) -> dict:
        """``/resume`` of a restored template: build the engine from the hydration."""
        _start, restore = self._template
        self.state = ec.LOADING
        self._template = None
        stats: dict = {}

        def hydrate() -> None:
            with self.timing.span("engine.hydrate") as sp:
                stats.update(self.control.hydrate(spec))
                sp["attrs"].update({k: v for k, v in stats.items() if isinstance(v, (int, float, str))})

        with self.timing.span("engine.template.build"):
            restore(spec, hydrate)
        self.state = ec.READY
        self.started.set()
        self._materialize_after(spec, stats)
        return {"spans": self.timing.spans, "hydration": stats}

    def _expect(self, *states: str) -> None:
        if self.state not in states:
            raise EngineStateError(f"engine is {self.state!r}; this step needs {' or '.join(states)}")

    def status(self) -> dict:
        out = {"state": self.state, **self.control.describe(), "arenas": self.control.allocations(),
               "restores": self.restores, "last_error": self.last_error}
        hydration = getattr(self.control, "hydration", None)  # bytes of the running (or last) hydration
        if hydration is not None:
            out["hydration"] = dict(hydration)
        return out

    # --------------------------------------------------------------- capture
    def quiesce(self, body: dict | None = None) -> dict:
        with self.lock:
            self._expect(ec.READY)
            self.timing = Timing()
            cpu_state.remember()  # before any dump: what a restore must ask the kernel for again (AMX)
            self.state = ec.QUIESCING
            try:
                with self.timing.span("engine.serving.pause"):
                    self.control.pause_serving()
                with self.timing.span("engine.transport.release"):
                    self.control.release_transport()
                with self.timing.span("engine.kv.discard"):
                    self.control.discard_kv()
            except BaseException:
                self.state = ec.READY
                raise
            self.state = ec.QUIESCED
            return {"spans": self.timing.spans}

    def export(self, body: dict) -> dict:
        request = ec.ExportBody.from_json(body)
        request.check_paths(os.environ.get(ec.ENV_STATE_ROOT))
        with self.lock:
            self._expect(ec.QUIESCED)
            with self.timing.span("engine.payload.export") as sp:
                payload = self.control.export(request.to_json())
                sp["attrs"]["model_bytes"] = payload.get("model_bytes")
            return {"payload": payload, "spans": self.timing.spans}

    def release(self, body: dict | None = None) -> dict:
        request = ec.ReleaseBody.from_json(body)
        with self.lock:
            self._expect(ec.QUIESCED)
            graphs = {"policy": request.graphs or "preserve", "released": 0}
            if request.graphs == "recreate-from-plan":
                release_graphs = getattr(self.control, "release_graphs", None)
                if release_graphs is None:
                    raise EngineStateError("this engine integration cannot re-create its graphs on restore "
                                           "(policy.process.graph_policy 'recreate-from-plan'); use 'preserve'")
                with self.timing.span("engine.graphs.release") as sp:
                    graphs["released"] = int(release_graphs())
                    sp["attrs"]["graphs"] = graphs["released"]
                self.graphs_released = graphs["released"] > 0
            self._await_materialize()
            with self.timing.span("engine.weights.release"):
                self.control.release_weights()
            self.state = ec.RELEASED
            return {"spans": self.timing.spans, "arenas": self.control.allocations(), "graphs": graphs}

    # --------------------------------------------------------------- restore
    def resume(self, body: dict) -> dict:
        spec = ec.HydrationBody.from_json(body).to_json()
        with self.lock:
            self._expect(ec.RELEASED, ec.TEMPLATE, ec.QUIESCED)
            if self.state == ec.TEMPLATE and spec.get("warm"):
                raise EngineStateError("a template has no warm boundary (snapshot driver n580): restore it fully")
            self._check_materialize(spec)
            self.timing = Timing()
            cpu_state.regrant()  # before any kernel runs: CRIU does not restore the AMX permission
            if self.state == ec.QUIESCED:
                # A capture that stopped before the release gives the engine back: its weights are
                # still resident, only the transport and the KV cache are rebuilt.
                with self.timing.span("engine.transport.rebuild"):
                    self.control.rebuild_transport(spec)
                self._zero_kv_and_serve()
                return {"spans": self.timing.spans}
            self.restores += 1
            # The workload log was reset before CRIU ran: this marker is its first line.
            print(json.dumps({"coldsnap": "restore-boundary", "operation_id": spec.get("operation_id"),
                              "restores": self.restores, "provider": spec.get("provider"),
                              "warm": bool(spec.get("warm")), "wall_unix": time.time(),
                              **({"template": True} if self.state == ec.TEMPLATE else {})}),
                  file=sys.stderr, flush=True)
            if self.state == ec.TEMPLATE:
                return self._resume_template(spec)
            with self.timing.span("engine.arenas.recreate"):
                self.control.recreate_memory()
            with self.timing.span("engine.transport.rebuild"):
                self.control.rebuild_transport(spec)
            if self.graphs_released:  # the capture dropped them: re-created from the plan (on first use)
                with self.timing.span("engine.graphs.recreate") as sp:
                    sp["attrs"]["graphs"] = int(self.control.recreate_graphs())
                self.graphs_released = False
            if spec.get("warm"):
                self.state = ec.WARM
                return {"spans": self.timing.spans}
            return self._hydrate_and_open(spec)

    def finish_warm(self, body: dict) -> dict:
        spec = ec.HydrationBody.from_json(body).to_json()
        with self.lock:
            self._expect(ec.WARM)
            self._check_materialize(spec)
            self.timing = Timing()
            return self._hydrate_and_open(spec)

    def _check_materialize(self, spec: dict) -> None:
        mat = spec.get("materialize", "off")
        if mat not in self.materialize_modes:
            raise EngineStateError(f"materialize={mat!r} is not supported by this engine integration "
                                   f"(supported: {', '.join(self.materialize_modes)})")

    def _zero_kv_and_serve(self) -> None:
        """The end of every path back to serving: KV zeroed, requests admitted again."""
        with self.timing.span("engine.kv.zero"):
            self.control.zero_kv()
        with self.timing.span("engine.serving.resume"):
            self.control.resume_serving()
        self.state = ec.READY

    def _hydrate_and_open(self, spec: dict) -> dict:
        with self.timing.span("engine.hydrate") as sp:
            stats = self.control.hydrate(spec)
            sp["attrs"].update({k: v for k, v in stats.items() if isinstance(v, (int, float, str))})
        self._zero_kv_and_serve()
        self._materialize_after(spec, stats)
        return {"spans": self.timing.spans, "hydration": stats}

    def _materialize_after(self, spec: dict, stats: dict) -> None:
        """After a recovery hydration: write the native payload now (required) or in the background (async)."""
        mat = spec.get("materialize", "off")
        if spec.get("provider") == "recovery" and mat in ("async", "required"):
            if mat == "required":
                with self.timing.span("engine.materialize"):
                    stats["materialized"] = self.control.materialize(spec)
            else:
                self._materializer = threading.Thread(target=self._materialize_bg, args=(spec,), daemon=True,
                                                      name="coldsnap-materialize")
                self._materializer.start()

    def _await_materialize(self) -> None:
        """A background materialize reads the resident weights: memory is released only after it."""
        if self._materializer is not None:
            with self.timing.span("engine.materialize.wait"):
                self._materializer.join()
            self._materializer = None

    def _materialize_bg(self, spec: dict) -> None:
        try:
            self.materialized = self.control.materialize(spec)
        except Exception as exc:
            self.last_error = f"materialize: {exc}"
            self._log(self.last_error)

    # ------------------------------------------------------------ sleep/wake
    def sleep(self, body: dict | None = None) -> dict:
        """Level-1 sleep: KV discarded, weight memory released; process and transport stay."""
        with self.lock:
            self._expect(ec.READY)
            self.timing = Timing()
            self._await_materialize()
            with self.timing.span("engine.sleep"):
                self.control.sleep()
            self.state = ec.SLEEPING
            return {"spans": self.timing.spans}

    def wake(self, body: dict) -> dict:
        """Re-create memory, restore weights (the engine's wake, or hydration), zero KV, serve."""
        spec = ec.HydrationBody.from_json(body).to_json()
        with self.lock:
            self._expect(ec.SLEEPING)
            self.timing = Timing()
            with self.timing.span("engine.wake") as sp:
                stats = self.control.wake(spec)
                sp["attrs"].update({k: v for k, v in stats.items() if isinstance(v, (int, float, str))})
            self._zero_kv_and_serve()
            return {"spans": self.timing.spans, "hydration": stats}
