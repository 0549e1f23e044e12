"""The reference engine's model side: load the weights into stable arenas, join the
transport, warm up, and decode greedily (rank 0) or follow rank 0 (ranks > 0).

It has no state machine of its own: the control plane is the shared
:class:`~coldsnap_engines.common.lifecycle.Lifecycle` over
:class:`~coldsnap_engines.reference.control.ReferenceControl`, the same one vLLM
and SGLang run under.
"""

from __future__ import annotations

import os
import shutil
import sysconfig
import threading
from pathlib import Path

import torch

from coldsnap_engines.common.arena import free_host_memory
from coldsnap_engines.common.lifecycle import Timing
from coldsnap_engines.reference import loader, tokenizer
from coldsnap_engines.reference.config import ModelConfig
from coldsnap_engines.reference.engine_core import ServingPaused, TokenLogprobs
from coldsnap_engines.reference.model import Decoder

OP_GENERATE, OP_PARK = 1, 2  # OP_PARK: stop taking commands until woken (before a sleep or a quiesce)


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


def token_logprobs(logits: torch.Tensor, chosen: int, k: int) -> TokenLogprobs:
    """The float32 log-softmax of one step's logits: the chosen token's value and the ``k`` best
    (ties in index order, as ``torch.topk`` returns them)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top: list[tuple[str, float]] = []
    if k > 0:
        values, indices = torch.topk(lp, min(k, lp.shape[-1]))
        top = [(tokenizer.decode([int(i)]), float(v)) for v, i in zip(values.tolist(), indices.tolist(), strict=True)]
    return TokenLogprobs(float(lp[chosen].item()), top)


class Engine:
    """One worker (rank) of the reference engine: weights, transport, KV cache, decoding."""

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
        self.gen_lock = threading.Lock()
        self.paused = False
        self.transport_ready = threading.Event()
        self.loop_idle = threading.Event()
        self.loaded: loader.LoadedWeights | None = None
        self.decoder: Decoder | None = None
        self.kv = None
        self.transport = None
        self.timing = Timing()
        self.blocked = torch.tensor(tokenizer.blocked_ids(), dtype=torch.long)
        self.last_error: str | None = None

    # ------------------------------------------------------------------ start
    def start(self, transport) -> None:
        """Cold start: load weights, join the transport, warm up."""
        with self.timing.span("engine.load"):
            self.loaded = loader.load(self.model_dir, self.config, rank=self.rank, world=self.world, device=self.device)
        self.transport = transport
        with self.timing.span("engine.transport.init"):
            transport.init(generation=0)
        self._finish_start()

    def start_from_template(self, transport, spec: dict, hydrate) -> None:
        """A restored template's start (snapshot driver n580): the arenas are created here, on this
        host's driver, laid out from the checkpoint's headers, and filled by ``hydrate()`` (pack or
        recovery, with the residual) instead of the loader; then the transport of the restore's
        coordinator and the usual warm-up."""
        with self.timing.span("engine.arenas.create"):
            self.loaded = loader.load(self.model_dir, self.config, rank=self.rank, world=self.world,
                                      device=self.device, read=False)
        hydrate()
        self.transport = transport
        with self.timing.span("engine.transport.init"):
            self.rebuild_transport(spec, 0)
        self._finish_start()

    def _finish_start(self) -> None:
        self.decoder = Decoder(self.config, self.loaded.weights, self.loaded.rope, world=self.world,
                               all_reduce=self.transport.all_reduce)
        with self.timing.span("engine.kv.alloc"):
            self.new_kv()
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

    def _compiled(self) -> None:
        """After this rank's first forward passes (the warm-up; ranks > 0 run theirs in the
        worker loop): the graphs exist, so stop the compile workers before any capture."""
        if not self._compile_settled:
            _stop_compile_workers()
            self._compile_settled = True

    def drop_graphs(self) -> int:
        """policy.process.graph_policy 'recreate-from-plan', before a dump: the compiled graphs leave the
        process (the image holds no compiled code); the number dropped (0 without --compile)."""
        if self.decoder is None:
            return 0
        dropped = self.decoder.decompile()
        if dropped:
            free_host_memory()
        return dropped

    def recreate_graphs(self) -> int:
        """After a restore of a capture that dropped its graphs: compile again from the plan (the
        --compile settings; TorchInductor's cache, which policy.cache.paths carries in the capsule). The
        graphs are built on the first forward passes — the validation request — and the compile workers
        that builds starts are stopped after it, as at start-up."""
        if not self.compile or self.decoder is None or self.decoder.compiled:
            return 0
        self.decoder.compile()
        self._compile_settled = False
        return 2

    def new_kv(self) -> None:
        """A fresh, zeroed KV cache."""
        self.kv = self.decoder.new_kv(self.device)
        if self.device != "cpu":
            torch.cuda.synchronize()

    def drop_kv(self) -> None:
        """Discard the KV cache and give its memory back (a snapshot must not carry it)."""
        self.kv = None
        free_host_memory()

    # ------------------------------------------------------------ generation
    def generate(self, prompt: str, max_tokens: int, emit=None, logprobs: int | None = None) -> str:
        """Greedy decoding; ``emit(text)`` is called per token (streaming). Rank 0 only.

        ``emit`` returning true ends the generation (a stop string): at once on one rank; with
        followers the remaining steps still run, unemitted, so every rank takes the same
        collectives. With ``logprobs`` (0..vocabulary) ``emit`` is called as
        ``emit(text, TokenLogprobs)``: the chosen token's log-probability and the ``logprobs`` most
        likely tokens of that step, from the float32 log-softmax of the step's logits."""
        ids = tokenizer.encode(prompt)
        if len(ids) + max_tokens > self.config.max_seq:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                             f"({self.config.max_seq})")
        with self.gen_lock:
            if self.paused:
                raise ServingPaused("the engine is not serving (paused by its control plane)")
            if self.world > 1:
                self.transport.broadcast_command(OP_GENERATE, ids, max_tokens)
            text = self._generate(ids, max_tokens, emit, logprobs)
            if self.rank == 0 and self.decoder.compiled:
                self._compiled()  # graphs re-created after a restore: their compile workers go too
            return text

    @torch.inference_mode()
    def _generate(self, ids: list[int], max_tokens: int, emit=None, logprobs: int | None = None) -> str:
        dev = self.device
        out: list[int] = []
        tokens = torch.tensor(ids, dtype=torch.long, device=dev)
        pos = 0
        emitting = emit is not None
        for _i in range(max_tokens):
            logits = self.decoder.forward(tokens, pos, self.kv)
            logits[self.blocked] = float("-inf")
            nxt = int(torch.argmax(logits).item())
            pos += tokens.shape[0]
            out.append(nxt)
            piece = tokenizer.decode([nxt])
            if emitting and logprobs is not None:
                stop = emit(piece, token_logprobs(logits, nxt, logprobs))
            else:
                stop = emitting and emit(piece)
            if emitting and stop:
                emitting = False
                if self.world == 1:
                    break
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
            elif op == OP_PARK:
                self.transport_ready.clear()
                self.loop_idle.set()

    # ------------------------------------------------------------- serving gate
    def pause(self) -> None:
        """Stop admitting generations; waits for the one in flight to finish."""
        with self.gen_lock:
            self.paused = True

    def unpause(self) -> None:
        with self.gen_lock:
            self.paused = False

    def park_followers(self, timeout: float = 120) -> None:
        """Before a sleep releases memory or a quiesce tears the transport down: rank 0 (paused)
        tells the followers to park; a follower waits until it has (its generation in flight
        finished, no command taken until woken). A follower never frees weights a collective of
        rank 0's may still read."""
        if self.world == 1:
            return
        if self.rank == 0:
            self.transport.broadcast_command(OP_PARK, [], 0)
        elif not self.loop_idle.wait(timeout=timeout):
            raise RuntimeError(f"rank {self.rank} was not parked by rank 0 within {timeout:.0f} s: rank 0's "
                               "engine must sleep (or quiesce) too: act on every unit of the workload")

    # ------------------------------------------------------------- transport
    def release_transport(self) -> None:
        """Tear down torch.distributed (the followers parked first)."""
        if self.world > 1:
            self.park_followers()
            self.transport.release()
        self.transport_ready.clear()

    def rebuild_transport(self, spec: dict, generation) -> None:
        """Join the restore activation's transport (fresh endpoints from its coordinator)."""
        if self.world > 1:
            self.transport.rebind(spec["coordinator_endpoint"], spec.get("transport_env") or {})
        self.transport.init(generation=spec.get("generation") or generation)

    def open_transport(self) -> None:
        """Let the followers' loop run again (after the KV cache exists). Not idle from here on: a
        sleep that follows at once waits for rank 0's park, not for the last one's."""
        self.loop_idle.clear()
        self.transport_ready.set()
