"""The reference engine in two processes, shaped like vLLM V1 (``--engine-core-process``).

The process the unit starts is the API server: it serves HTTP and never touches CUDA (it does
not even import torch). It starts the engine core as its child, which loads the model, holds
the CUDA context, serves the loopback control API the activation runtime drives, and decodes.
They talk over a socket pair the parent creates before it starts the child (inherited, never a
path or a port, so a snapshot carries it with the tree and a restore needs nothing free for it).

The protocol is one JSON object per line, one generation at a time:

* API -> core ``{"op": "state"}``; core -> ``{"state": <lifecycle state>, "paused": bool}``.
* API -> core ``{"op": "generate", "prompt", "max_tokens", "logprobs"}``; the core answers
  ``{"token": text, "lp": [logprob, [[text, value], ...]] | null}`` per generated token and waits
  for ``{"stop": bool}`` (a stop string ends the generation), then ``{"done": text}`` or
  ``{"error": message, "kind": "paused" | "value" | "other"}``.
* The core says ``{"served_model_name", "max_seq"}`` once its engine is ready.

If either process dies the other exits: the API server's watch of its child, the core's end of
file on the socket.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from typing import NamedTuple


class ServingPaused(RuntimeError):
    """Generation was asked for while the control plane holds serving paused (HTTP 503)."""


class TokenLogprobs(NamedTuple):
    """One generated token's log-probability and the most likely tokens of its step (text, value)."""

    logprob: float
    top: list[tuple[str, float]]


class _Channel:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.rfile = sock.makefile("rb")

    def send(self, obj: dict) -> None:
        self.sock.sendall(json.dumps(obj).encode() + b"\n")

    def recv(self) -> dict | None:
        line = self.rfile.readline()
        return json.loads(line) if line else None


# ---------------------------------------------------------------------- the engine core (child)
def serve_core(engine, lifecycle, fd: int) -> None:
    """Answer the API server on the inherited socket ``fd`` until it closes; then exit."""
    ch = _Channel(socket.socket(fileno=fd))
    ch.send({"served_model_name": engine.served_model_name, "max_seq": engine.config.max_seq})
    while True:
        msg = ch.recv()
        if msg is None:  # the API server is gone: so is the unit
            os._exit(0)
        if msg.get("op") == "state":
            ch.send({"state": lifecycle.state, "paused": engine.paused})
        elif msg.get("op") == "generate":
            _core_generate(engine, ch, msg)
        else:
            ch.send({"error": f"unknown op {msg.get('op')!r}", "kind": "other"})


def _core_generate(engine, ch: _Channel, msg: dict) -> None:
    def emit(piece: str, lp: TokenLogprobs | None = None) -> bool:
        ch.send({"token": piece, "lp": [lp.logprob, [list(t) for t in lp.top]] if lp is not None else None})
        answer = ch.recv()
        if answer is None:
            os._exit(0)
        return bool(answer.get("stop"))

    try:
        text = engine.generate(msg["prompt"], msg["max_tokens"], emit=emit, logprobs=msg.get("logprobs"))
    except ServingPaused as exc:
        ch.send({"error": str(exc), "kind": "paused"})
    except ValueError as exc:
        ch.send({"error": str(exc), "kind": "value"})
    except Exception as exc:
        ch.send({"error": f"{type(exc).__name__}: {exc}", "kind": "other"})
    else:
        ch.send({"done": text})


# ---------------------------------------------------------------------- the API server (parent)
class _Config(NamedTuple):
    max_seq: int


class CoreClient:
    """What the serving handler needs of an engine and its lifecycle, answered by the core."""

    def __init__(self, sock: socket.socket) -> None:
        self.ch = _Channel(sock)
        self.lock = threading.Lock()
        hello = self.ch.recv()
        if hello is None:
            raise RuntimeError("the engine core exited before it was ready")
        self.served_model_name = hello["served_model_name"]
        self.config = _Config(hello["max_seq"])

    def _state(self) -> dict:
        with self.lock:
            self.ch.send({"op": "state"})
            return self._recv()

    def _recv(self) -> dict:
        msg = self.ch.recv()
        if msg is None:
            raise RuntimeError("the engine core is gone")
        return msg

    @property
    def state(self) -> str:
        return self._state()["state"]

    @property
    def paused(self) -> bool:
        return self._state()["paused"]

    def generate(self, prompt: str, max_tokens: int, emit=None, logprobs: int | None = None) -> str:
        with self.lock:
            self.ch.send({"op": "generate", "prompt": prompt, "max_tokens": max_tokens, "logprobs": logprobs})
            failed: BaseException | None = None
            while True:
                msg = self._recv()
                if "token" in msg:
                    stop = failed is not None
                    if emit is not None and failed is None:
                        try:
                            if msg["lp"] is None:
                                stop = bool(emit(msg["token"]))
                            else:
                                lp = TokenLogprobs(msg["lp"][0], [tuple(t) for t in msg["lp"][1]])
                                stop = bool(emit(msg["token"], lp))
                        except BaseException as exc:  # finish the protocol, then raise
                            failed, stop = exc, True
                    self.ch.send({"stop": stop})
                elif "done" in msg:
                    if failed is not None:
                        raise failed
                    return msg["done"]
                else:
                    if failed is not None:
                        raise failed
                    kind = msg.get("kind")
                    raise (ServingPaused if kind == "paused" else ValueError if kind == "value"
                           else RuntimeError)(msg["error"])


def start_core(core_argv: list[str], log) -> CoreClient:
    """Start the engine core (``core_argv`` + the socket's fd) as our child; wait until it is
    ready; exit this process if the child ever exits."""
    ours, theirs = socket.socketpair()
    child = subprocess.Popen([*core_argv, "--engine-core-fd", str(theirs.fileno())], pass_fds=[theirs.fileno()])
    theirs.close()

    def watch() -> None:
        code = child.wait()
        log(f"the engine core (pid {child.pid}) exited with status {code}: the API server exits too")
        os._exit(1)

    threading.Thread(target=watch, name="coldsnap-core-watch", daemon=True).start()
    log(f"engine core started as pid {child.pid}")
    return CoreClient(ours)


def core_command(argv: list[str]) -> list[str]:
    """The engine core's command: this server's own, without ``--engine-core-process``."""
    return [sys.executable, "-m", "coldsnap_engines.reference.server",
            *[a for a in argv if a != "--engine-core-process"]]
