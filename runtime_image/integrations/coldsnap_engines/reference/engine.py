"""Engine lifecycle: load -> ready -> quiesced -> released -> (snapshot) -> resumed -> ready,
plus live sleep/wake. Everything the in-unit activation runtime asks of the engine
goes through these methods (exposed on the loopback control server).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import shutil
import sys
import sysconfig
import threading
import time
from pathlib import Path

import torch

from coldsnap_engines.common import gpu_context
from coldsnap_engines.common.lifecycle import EngineStateError, Timing
from coldsnap_engines.reference import loader, tokenizer
from coldsnap_engines.reference.config import ModelConfig
from coldsnap_engines.reference.model import Decoder

OP_GENERATE, OP_QUIESCE = 1, 2


def _malloc_trim() -> None:
    """Give freed host (and cached GPU) memory back so the snapshot does not carry it."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def require_cpu_compiler() -> None:
    """Fail at once, with the fix, where TorchInductor could not build CPU kernels: it compiles
    C++ (``$CXX``, default g++) that includes Python.h. Without this the engine would die in its
    warm-up with a compiler traceback."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise ValueError(f"--compile on CPU needs a C++ compiler ({cxx!r} is not on PATH): install g++ "
                         "(Debian: apt-get install g++) or drop --compile")
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not header.is_file():
        raise ValueError(f"--compile on CPU needs the Python headers ({header} is missing): install them "
                         "(Debian: apt-get install python3-dev) or drop --compile")


def _stop_compile_workers() -> None:
    """Stop TorchInductor's compile worker processes once the graphs exist.

    They are children of the engine, so a CRIU dump of its process tree would carry them;
    a compile after a restore starts them again.
    """
    try:
        from torch._inductor import async_compile
    except ImportError:
        return
    stop = getattr(async_compile, "shutdown_compile_workers", None)
    if stop is not None:
        stop()


class Engine:
    """One worker (rank) of the reference engine."""

    def __init__(self, model_dir: Path, *, device: str, rank: int, world: int, served_model_name: str,
                 max_seq: int | None = None, compile: bool = False) -> None:
        self.model_dir = Path(model_dir)
        cfg = ModelConfig.load(self.model_dir)
        if max_seq:
            cfg = ModelConfig.from_json({**cfg.to_json(), "max_seq": max_seq})
        cfg.validate(world)
        self.config = cfg
        self.device = device
        self.rank = rank
        self.world = world
        self.served_model_name = served_model_name
        if compile and device == "cpu":
            require_cpu_compiler()
        self.compile = compile
        self._compile_settled = not compile  # graphs built and compile workers stopped
        self.state = "loading"
        self.state_lock = threading.RLock()
        self.gen_lock = threading.Lock()
        self.transport_ready = threading.Event()
        self.loop_idle = threading.Event()
        self.loaded: loader.LoadedWeights | None = None
        self.decoder: Decoder | None = None
        self.kv = None
        self.timing = Timing()
        self.blocked = torch.tensor(tokenizer.blocked_ids(), dtype=torch.long)
        self.restores = 0
        self.last_error: str | None = None
        self._shrunk: gpu_context.Shrunk | None = None  # what release() took from the CUDA context

    # ------------------------------------------------------------------ start
    def start(self, transport) -> None:
        """Cold start: load weights, join the transport, warm up."""
        with self.timing.span("engine.load"):
            self.loaded = loader.load(self.model_dir, self.config, rank=self.rank, world=self.world, device=self.device)
        self.transport = transport
        with self.timing.span("engine.transport.init"):
            transport.init(generation=0)
        self.decoder = Decoder(self.config, self.loaded.weights, self.loaded.rope, world=self.world,
                               all_reduce=transport.all_reduce)
        with self.timing.span("engine.kv.alloc"):
            self.kv = self.decoder.new_kv(self.device)
        if self.device != "cpu":
            self.blocked = self.blocked.to(self.device)
        if self.compile:
            self.decoder.compile()
        self.transport_ready.set()
        with self.timing.span("engine.warmup"):  # with --compile: where the graphs are built
            if self.rank == 0:
                self.generate("warm-up", 2)
        if self.rank == 0:
            self._compiled()
        self.state = "ready"

    def _compiled(self) -> None:
        """After this rank's first forward passes (the warm-up; ranks > 0 run theirs in the
        worker loop): the graphs exist, so stop the compile workers before any capture."""
        if not self._compile_settled:
            _stop_compile_workers()
            self._compile_settled = True

    # ------------------------------------------------------------ generation
    def generate(self, prompt: str, max_tokens: int, emit=None) -> str:
        """Greedy decoding; ``emit(text)`` is called per token (streaming). Rank 0 only."""
        ids = tokenizer.encode(prompt)
        if len(ids) + max_tokens > self.config.max_seq:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                             f"({self.config.max_seq})")
        with self.gen_lock:
            if self.world > 1:
                self.transport.broadcast_command(OP_GENERATE, ids, max_tokens)
            return self._generate(ids, max_tokens, emit)

    @torch.inference_mode()
    def _generate(self, ids: list[int], max_tokens: int, emit=None) -> str:
        dev = self.device
        out: list[int] = []
        tokens = torch.tensor(ids, dtype=torch.long, device=dev)
        pos = 0
        for _i in range(max_tokens):
            logits = self.decoder.forward(tokens, pos, self.kv)
            logits[self.blocked] = float("-inf")
            nxt = int(torch.argmax(logits).item())
            pos += tokens.shape[0]
            out.append(nxt)
            if emit is not None:
                emit(tokenizer.decode([nxt]))
            tokens = torch.tensor([nxt], dtype=torch.long, device=dev)
        return tokenizer.decode(out)

    def worker_loop(self) -> None:
        """Ranks > 0: follow rank 0's commands; park while the transport is released."""
        while True:
            self.transport_ready.wait()
            self.loop_idle.clear()
            try:
                op, ids, max_tokens = self.transport.recv_command()
            except Exception as exc:  # transport torn down under us: wait for the next generation
                self.last_error = f"worker loop: {exc}"
                self.transport_ready.clear()
                self.loop_idle.set()
                continue
            if op == OP_GENERATE:
                self._generate(ids, max_tokens)
                self._compiled()
            elif op == OP_QUIESCE:
                self.transport_ready.clear()
                self.loop_idle.set()

    # ------------------------------------------------------------- lifecycle
    def status(self) -> dict:
        arenas = {}
        if self.loaded:
            for a in self.loaded.arenas.values():
                arenas[a.id] = {"address": a.address, "size": a.size, "resident": a.resident, "device": a.device}
        return {"state": self.state, "rank": self.rank, "world": self.world, "device": self.device,
                "arenas": arenas, "restores": self.restores, "last_error": self.last_error,
                "config": self.config.to_json()}

    def _expect(self, *states: str) -> None:
        if self.state not in states:
            raise EngineStateError(f"engine is {self.state!r}; this step needs {' or '.join(states)}")

    def quiesce(self, body: dict | None = None) -> dict:
        """Stop serving, tear down the distributed transport, discard the KV cache."""
        with self.state_lock:
            self._expect("ready")
            self.timing = Timing()
            with self.gen_lock:
                self.state = "quiescing"
                with self.timing.span("engine.transport.release"):
                    if self.world > 1:
                        if self.rank == 0:
                            self.transport.broadcast_command(OP_QUIESCE, [], 0)
                        else:
                            self.loop_idle.wait(timeout=120)
                        self.transport.release()
                    self.transport_ready.clear()
                with self.timing.span("engine.kv.discard"):
                    self.kv = None
                    gc.collect()
                    _malloc_trim()
            self.state = "quiesced"
            return {"spans": self.timing.spans}

    def export(self, body: dict) -> dict:
        """Write residual + manifest + replay plan (+ the model pack) from resident arenas.

        ``body``: ``out_dir``, ``export_pack`` (default true), ``state_root``, ``model``.
        """
        out_dir, export_pack = body["out_dir"], bool(body.get("export_pack", True))
        state_root, model = body.get("state_root"), body["model"]
        from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
        from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.pack import write_worker_payload

        from coldsnap_engines.reference import hydration

        with self.state_lock:
            self._expect("quiesced")
            cache = NodeCache(Path(state_root)) if (export_pack and state_root) else None
            with self.timing.span("engine.payload.export") as sp:
                rd = hydration.reader(self.loaded)
                try:
                    result = write_worker_payload(Path(out_dir), self.loaded.allocations(), self.loaded.extents,
                                                  rd, export_pack=export_pack, cache=cache, model=model,
                                                  safetensors_dir=self.model_dir)
                finally:
                    if rd is not self.loaded:
                        hydration.close(rd)
                sp["attrs"]["model_bytes"] = result.model_bytes
            return {"payload": _payload_json(result), "spans": self.timing.spans}

    def release(self, body: dict | None = None) -> dict:
        """Free the weight memory (arenas keep their addresses) so the snapshot omits it."""
        with self.state_lock:
            self._expect("quiesced")
            with self.timing.span("engine.weights.release"):
                for a in self.loaded.arenas.values():
                    a.release()
                self.loaded.extents = list(self.loaded.extents)
                gc.collect()
                _malloc_trim()
                if self.device != "cpu":
                    self._shrunk = gpu_context.shrink(torch.device(self.device).index or 0)
            self.state = "released"
            return {"spans": self.timing.spans, "arenas": self.status()["arenas"]}

    def resume(self, spec: dict) -> dict:
        """After restore: re-create arenas at their addresses, rebuild the transport,
        hydrate (unless warm), re-create a zeroed KV cache."""
        with self.state_lock:
            self._expect("released")
            self.timing = Timing()
            gpu_context.restore(self._shrunk)
            self._shrunk = None
            self.restores += 1
            # The workload log was reset before CRIU ran: this marker is its first line.
            print(json.dumps({"coldsnap": "restore-boundary", "operation_id": spec.get("operation_id"),
                              "restores": self.restores, "provider": spec.get("provider"),
                              "warm": bool(spec.get("warm")), "wall_unix": time.time()}),
                  file=sys.stderr, flush=True)
            with self.timing.span("engine.arenas.recreate"):
                for a in self.loaded.arenas.values():
                    a.recreate()
                    if a.current_address() != a.address:
                        raise EngineStateError(f"arena {a.id} moved from {a.address:#x} to {a.current_address():#x}")
            with self.timing.span("engine.transport.rebuild"):
                if self.world > 1:
                    self.transport.rebind(spec["coordinator_endpoint"], spec.get("transport_env", {}))
                self.transport.init(generation=spec.get("generation", self.restores))
            if spec.get("warm"):
                self.state = "warm"
                return {"spans": self.timing.spans}
            return self._hydrate_and_open(spec)

    def _hydrate_and_open(self, spec: dict) -> dict:
        from coldsnap_engines.reference import hydration

        with self.timing.span("engine.hydrate") as sp:
            stats = hydration.hydrate(self.loaded, spec)
            sp["attrs"].update(stats)
        with self.timing.span("engine.kv.alloc"):
            self.kv = self.decoder.new_kv(self.device)
        if self.device != "cpu":
            torch.cuda.synchronize()
        self.transport_ready.set()
        self.state = "ready"
        mat = spec.get("materialize", "off")
        if spec.get("provider") == "recovery" and mat in ("async", "required"):
            from coldsnap_engines.reference import hydration

            if mat == "required":
                with self.timing.span("engine.materialize"):
                    stats["materialized"] = hydration.materialize(self.loaded, spec)
            else:
                threading.Thread(target=self._materialize_bg, args=(spec,), daemon=True).start()
        return {"spans": self.timing.spans, "hydration": stats}

    def _materialize_bg(self, spec: dict) -> None:
        from coldsnap_engines.reference import hydration

        try:
            self.materialized = hydration.materialize(self.loaded, spec)
        except Exception as exc:
            self.last_error = f"materialize: {exc}"

    def finish_warm(self, spec: dict) -> dict:
        """Complete a warm restore: hydrate and open."""
        with self.state_lock:
            self._expect("warm")
            self.timing = Timing()
            return self._hydrate_and_open(spec)

    def sleep(self, body: dict | None = None) -> dict:
        """Level-1 sleep: discard KV and release weights; process and transport stay."""
        with self.state_lock:
            self._expect("ready")
            self.timing = Timing()
            with self.gen_lock, self.timing.span("engine.sleep"):
                self.state = "sleeping"
                self.kv = None
                for a in self.loaded.arenas.values():
                    a.release()
                gc.collect()
                _malloc_trim()
            return {"spans": self.timing.spans}

    def wake(self, spec: dict) -> dict:
        """Re-create weights from the payload (or safetensors), zero KV, serve again."""
        with self.state_lock:
            self._expect("sleeping")
            self.timing = Timing()
            for a in self.loaded.arenas.values():
                a.recreate()
            return self._hydrate_and_open(spec)


def _payload_json(result) -> dict:
    def ref(r):
        if r is None:
            return None
        return {k: getattr(r, k) for k in ("path", "size", "sha256") if hasattr(r, k)}

    return {
        "pack": ref(result.pack),
        "residual": ref(result.residual),
        "manifest": ref(result.manifest),
        "replay": ref(result.replay),
        "model_bytes": result.model_bytes,
        "residual_bytes": result.residual_bytes,
        "allocations": len(result.allocations) if hasattr(result.allocations, "__len__") else result.allocations,
    }
