"""``coldsnap-reference-engine``: OpenAI-compatible serving plus a loopback control API.

Serving (rank 0 only): GET /health, GET /v1/models, POST /v1/completions and
POST /v1/chat/completions (stream or not; what of the OpenAI API is implemented and what is
refused is listed in :mod:`coldsnap_engines.reference.openai_api`). Every response closes its connection (HTTP/1.0), so no established socket
outlives a request — a snapshot never has to carry client connections.

Control (every rank, 127.0.0.1 only, bearer token from a 0600 file): the steps the
in-unit activation runtime drives — status, quiesce, export, release, resume,
finish-warm, sleep, wake — served by ``coldsnap_engines.common.control`` over the
shared ``Lifecycle`` and :class:`~coldsnap_engines.reference.control.ReferenceControl`,
exactly as the vLLM and SGLang integrations are.

With ``--engine-core-process`` the engine runs in two processes shaped like vLLM V1: this one
serves HTTP without CUDA (without torch), its child — the engine core — holds the model, the
CUDA context and the control API (:mod:`coldsnap_engines.reference.engine_core`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.cpulist import format_cpus, parse_cpus
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.engine_control import (
    ENV_COORDINATOR,
    ENV_RANK,
    ENV_SCOPE,
    ENV_TEMPLATE,
    ENV_WORLD_SIZE,
    READY,
)

from coldsnap_engines.common import control

LOG_PREFIX = "[reference-engine]"


def log(msg: str) -> None:
    print(f"{LOG_PREFIX} {msg}", file=sys.stderr, flush=True)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64


def _reply(handler: BaseHTTPRequestHandler, code: int, obj: dict) -> None:
    body = json.dumps(obj).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.send_header("Connection", "close")
    handler.end_headers()
    handler.wfile.write(body)


def _sse(handler: BaseHTTPRequestHandler, obj) -> None:
    data = b"[DONE]" if obj is None else json.dumps(obj).encode()
    handler.wfile.write(b"data: " + data + b"\n\n")
    handler.wfile.flush()


def make_serving_handler(engine, lifecycle):
    from coldsnap_engines.reference import openai_api as api
    from coldsnap_engines.reference.engine_core import ServingPaused

    routes = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}

    def not_serving(message: str) -> api.APIError:
        return api.APIError(503, message, type="service_unavailable")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"
        server_version = "coldsnap-reference"
        timeout = control.HANDLER_TIMEOUT  # an idle client, or a stream reader that stopped reading, lets go

        def log_message(self, fmt, *args):  # quiet access log
            pass

        def do_GET(self):
            if self.path == "/health":
                ok = lifecycle.state == READY
                _reply(self, 200 if ok else 503, {"status": "ok" if ok else lifecycle.state})
            elif self.path == "/v1/models":
                _reply(self, 200, {"object": "list", "data": [
                    {"id": engine.served_model_name, "object": "model", "created": 0, "owned_by": "coldsnap"}]})
            else:
                _reply(self, 404, api.error_body(f"no route {self.path}", code="not_found"))

        def do_POST(self):
            kind = routes.get(self.path)
            if kind is None:
                _reply(self, 404, api.error_body(f"no route {self.path}", code="not_found"))
                return
            try:
                if lifecycle.state != READY:
                    raise not_serving(f"engine is {lifecycle.state}")
                try:
                    body = control.read_json_body(self, 1 << 20)
                except (ValueError, json.JSONDecodeError) as exc:
                    raise api.APIError(400, f"invalid request body: {exc}") from exc
                r = api.parse(kind, body, engine.served_model_name)
                prompt_tokens = api.check_context(r, engine.config.max_seq)
                if engine.paused:
                    raise not_serving("the engine is not serving (paused by its control plane)")
                if r.stream:
                    self._stream(r, prompt_tokens)
                    return
                out = api.Responder(r)
                choices, completion_tokens = [], 0
                for i, prompt in enumerate(r.prompts):
                    scan, lps = self._generate(prompt, r)
                    for j in range(r.n):
                        choices.append(out.choice(i * r.n + j, scan.text, scan.finish_reason,
                                                  lps.doc if lps else None))
                        completion_tokens += scan.tokens
                _reply(self, 200, out.response(choices, sum(prompt_tokens), completion_tokens))
            except api.APIError as exc:
                _reply(self, exc.status, exc.body())
            except ServingPaused as exc:
                _reply(self, 503, not_serving(str(exc)).body())
            except ValueError as exc:
                _reply(self, 400, api.error_body(str(exc)))
            except Exception as exc:
                log(f"{self.path} failed: {exc!r}")
                _reply(self, 500, api.error_body(f"generation failed: {exc}", type="server_error"))

        def _generate(self, prompt: str, r, on_text=None):
            """Decode one prompt through a stop scanner; ``on_text(text, logprobs)`` gets the
            releasable text (with ``logprobs``, each token's own object: no stop scanner then).
            Returns the scanner and the choice's logprobs collector (None without logprobs)."""
            scan = api.StopScanner(r.stop)
            lps = api.LogprobsCollector() if r.logprobs is not None else None
            failed: list[BaseException] = []

            def emit(piece: str, lp=None) -> bool:
                text = scan.feed(piece)
                one = lps.add(piece, lp) if lps is not None else None
                if (text or one) and on_text is not None:
                    try:
                        on_text(text, one)
                    except Exception as exc:  # e.g. the client left: end the generation cleanly
                        failed.append(exc)   # (with followers, the engine finishes its steps)
                        return True
                return scan.stopped

            engine.generate(prompt, r.max_tokens, emit=emit, logprobs=r.logprobs)
            if failed:
                raise failed[0]
            rest = scan.flush()
            if rest and on_text is not None:
                on_text(rest, None)
            return scan, lps

        def _stream(self, r, prompt_tokens: list[int]) -> None:
            out = api.Responder(r)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            try:
                try:
                    completion_tokens = 0
                    for i, prompt in enumerate(r.prompts):
                        indices = range(i * r.n, (i + 1) * r.n)
                        if r.kind == "chat":
                            for k in indices:
                                _sse(self, out.chunk(k, "", role=True))

                        def on_text(text: str, one: dict | None, indices=indices) -> None:
                            for k in indices:
                                _sse(self, out.chunk(k, text, logprobs=one))

                        scan, _lps = self._generate(prompt, r, on_text)
                        for k in indices:
                            _sse(self, out.chunk(k, None, scan.finish_reason))
                        completion_tokens += scan.tokens * r.n
                    if r.include_usage:
                        _sse(self, out.usage_chunk(sum(prompt_tokens), completion_tokens))
                except (BrokenPipeError, ConnectionResetError):
                    raise
                except Exception as exc:  # headers are out: report in the stream, never end it silently
                    if isinstance(exc, ServingPaused):
                        err = not_serving(str(exc)).body()
                    elif isinstance(exc, ValueError):
                        err = api.error_body(str(exc))
                    else:
                        log(f"{self.path} failed while streaming: {exc!r}")
                        err = api.error_body(f"generation failed: {exc}", type="server_error")
                    _sse(self, err)
                _sse(self, None)
            except (BrokenPipeError, ConnectionResetError):
                pass

    return Handler


def pick_device(requested: str, *, template: bool = False) -> str:
    if requested != "auto":
        return requested
    if template:  # asking torch would initialise the CUDA driver: the unit's visible devices say it
        return "cuda:0" if os.environ.get("CUDA_VISIBLE_DEVICES", "").strip() else "cpu"
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def serve_api(args: argparse.Namespace) -> int:
    """The API server of ``--engine-core-process``: HTTP here, the engine in a child."""
    from coldsnap_engines.reference.engine_core import core_command, start_core

    t0 = time.monotonic()
    if int(os.environ.get(ENV_WORLD_SIZE, "1")) > 1:
        raise SystemExit(f"{LOG_PREFIX} --engine-core-process serves one rank (world size 1); run tensor-parallel "
                         "ranks without it")
    core = start_core(core_command(args.argv), log)
    httpd = _Server((args.host, args.port), make_serving_handler(core, core))
    log(f"serving {core.served_model_name} on http://{args.host}:{args.port} from an engine-core process "
        f"(ready in {time.monotonic() - t0:.2f}s)")
    httpd.serve_forever()
    return 0


def serve(args: argparse.Namespace) -> int:
    if args.engine_core_process:
        return serve_api(args)
    if args.bind_cpus:
        # As vLLM's CPU worker pins its OpenMP threads: this thread and every thread it starts (torch's
        # pool, the serving threads) run on these CPUs only. A restore must give them back.
        allowed = os.sched_getaffinity(0)
        if not args.bind_cpus <= allowed:
            raise SystemExit(f"{LOG_PREFIX} --bind-cpus {format_cpus(args.bind_cpus)}: this process may only "
                             f"run on CPUs {format_cpus(allowed)}; name CPUs among those")
        os.sched_setaffinity(0, args.bind_cpus)
    import torch

    from coldsnap_engines.common.lifecycle import Lifecycle
    from coldsnap_engines.reference.control import ReferenceControl
    from coldsnap_engines.reference.engine import Engine
    from coldsnap_engines.reference.transport import Transport

    t0 = time.monotonic()
    rank = int(os.environ.get(ENV_RANK, "0"))
    world = int(os.environ.get(ENV_WORLD_SIZE, "1"))
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    template = os.environ.get(ENV_TEMPLATE) == "1"
    device = pick_device(args.device, template=template)
    engine = Engine(Path(args.model), device=device, rank=rank, world=world,
                    served_model_name=args.served_model_name or Path(args.model).name, max_seq=args.max_seq,
                    compile=args.compile)
    # The loopback control API the activation runtime drives (shared by every integration).
    lifecycle = Lifecycle(ReferenceControl(engine))
    control.start_from_env(lifecycle)
    transport = Transport(rank=rank, world=world, device=device,
                          endpoint_file=os.environ.get(ENV_COORDINATOR),
                          scope=os.environ.get(ENV_SCOPE, "local"))
    if template:
        # Snapshot driver n580: stop before CUDA, weights and transport until the activation says how on.
        def restore(spec: dict, hydrate) -> None:
            lifecycle.control.relocatable = True  # the arenas are new: same ids and sizes, other addresses
            engine.start_from_template(transport, spec, hydrate)

        lifecycle.mark_template(start=lambda: engine.start(transport), restore=restore)
        log(f"rank {rank}/{world} waiting as a template for {args.model} on {device} "
            f"({time.monotonic() - t0:.2f}s)")
        lifecycle.started.wait()
    else:
        log(f"rank {rank}/{world} loading {args.model} on {device}")
        engine.start(transport)
        lifecycle.mark_ready()
    if args.engine_core_fd is not None:
        from coldsnap_engines.reference.engine_core import serve_core

        log(f"engine core ready in {time.monotonic() - t0:.2f}s")
        serve_core(engine, lifecycle, args.engine_core_fd)
        return 0
    if rank == 0:
        httpd = _Server((args.host, args.port), make_serving_handler(engine, lifecycle))
        threading.Thread(target=httpd.serve_forever, name="coldsnap-serving", daemon=True).start()
        log(f"serving {engine.served_model_name} on http://{args.host}:{args.port} "
            f"(ready in {time.monotonic() - t0:.2f}s)")
        threading.Event().wait()
    else:
        log(f"rank {rank} ready in {time.monotonic() - t0:.2f}s")
        engine.worker_loop()
    return 0


def make_model_cmd(args: argparse.Namespace) -> int:
    from coldsnap_engines.reference.config import PRESETS
    from coldsnap_engines.reference.weights import make_model

    cfg = PRESETS[args.preset]
    ident = make_model(Path(args.out), cfg, model_id=args.model_id or f"coldsnap/reference-{args.preset}", seed=args.seed)
    print(json.dumps(ident, indent=2))
    return 0


def _cpu_list(text: str) -> frozenset[int]:
    try:
        return parse_cpus(text, what="CPU list")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("serve", "make-model", "-h", "--help"):
        argv = ["serve", *argv]
    from coldsnap_engines.reference.config import PRESETS

    p = argparse.ArgumentParser(prog="coldsnap-reference-engine", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve a model (default)")
    s.add_argument("--model", required=True, help="directory with config.json and safetensors")
    s.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--max-seq", type=int, default=None)
    s.add_argument("--compile", action="store_true",
                   help="compile the decoder with TorchInductor during start-up (as production engines do); "
                        "slower cold start, faster steps, kept across a snapshot")
    s.add_argument("--engine-core-process", action="store_true",
                   help="run the model in a child engine-core process (it holds CUDA and the control API); "
                        "this process serves HTTP without CUDA, as vLLM V1's API server does")
    s.add_argument("--bind-cpus", default=None, metavar="LIST", type=_cpu_list,
                   help="pin the process that runs the model to these CPUs (e.g. 1 or 0-3,8), as vLLM's CPU worker "
                        "pins its threads")
    s.add_argument("--engine-core-fd", type=int, default=None, help=argparse.SUPPRESS)
    s.set_defaults(func=serve)
    m = sub.add_parser("make-model", help="generate deterministic weights as safetensors")
    m.add_argument("--out", required=True)
    m.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    m.add_argument("--model-id", default=None)
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=make_model_cmd)
    args = p.parse_args(argv)
    args.argv = argv
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
