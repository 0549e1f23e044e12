"""``coldsnap-reference-engine``: OpenAI-compatible serving plus a loopback control API.

Serving (rank 0 only): GET /health, GET /v1/models, POST /v1/completions (stream or
not). Every response closes its connection (HTTP/1.0), so no established socket
outlives a request — a snapshot never has to carry client connections.

Control (every rank, 127.0.0.1 only, bearer token from a 0600 file): the steps the
in-unit activation runtime drives — status, quiesce, export, release, resume,
finish-warm, sleep, wake — served by ``coldsnap_engines.common.control`` over the
shared ``Lifecycle`` and :class:`~coldsnap_engines.reference.control.ReferenceControl`,
exactly as the vLLM and SGLang integrations are.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.engine_control import (
    ENV_COORDINATOR,
    ENV_RANK,
    ENV_SCOPE,
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


def _json_body(handler: BaseHTTPRequestHandler) -> dict:
    length = int(handler.headers.get("Content-Length") or 0)
    if length > 1 << 20:
        raise ValueError("request body too large")
    raw = handler.rfile.read(length) if length else b"{}"
    data = json.loads(raw or b"{}")
    if not isinstance(data, dict):
        raise ValueError("request body must be a JSON object")
    return data


def _reply(handler: BaseHTTPRequestHandler, code: int, obj: dict) -> None:
    body = json.dumps(obj).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.send_header("Connection", "close")
    handler.end_headers()
    handler.wfile.write(body)


def make_serving_handler(engine, lifecycle):
    from coldsnap_engines.reference.engine import ServingPaused

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"
        server_version = "coldsnap-reference"

        def log_message(self, fmt, *args):  # quiet access log
            pass

        def do_GET(self):
            if self.path == "/health":
                ok = lifecycle.state == READY
                _reply(self, 200 if ok else 503, {"status": "ok" if ok else lifecycle.state})
            elif self.path == "/v1/models":
                _reply(self, 200, {"object": "list", "data": [
                    {"id": engine.served_model_name, "object": "model", "owned_by": "coldsnap"}]})
            else:
                _reply(self, 404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            if self.path != "/v1/completions":
                _reply(self, 404, {"error": {"message": f"no route {self.path}"}})
                return
            if lifecycle.state != READY:
                _reply(self, 503, {"error": {"message": f"engine is {lifecycle.state}"}})
                return
            try:
                req = _json_body(self)
                prompt = req.get("prompt", "")
                if isinstance(prompt, list):
                    prompt = prompt[0] if prompt else ""
                if not isinstance(prompt, str):
                    raise ValueError("prompt must be a string")
                max_tokens = int(req.get("max_tokens", 16))
                if not 1 <= max_tokens <= 4096:
                    raise ValueError("max_tokens must be 1..4096")
            except (ValueError, json.JSONDecodeError) as exc:
                _reply(self, 400, {"error": {"message": str(exc), "type": "invalid_request_error"}})
                return
            cid = f"cmpl-{uuid.uuid4().hex[:16]}"
            created = int(time.time())
            model = req.get("model") or engine.served_model_name
            if req.get("stream"):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()

                def emit(text: str) -> None:
                    chunk = {"id": cid, "object": "text_completion", "created": created, "model": model,
                             "choices": [{"text": text, "index": 0, "finish_reason": None, "logprobs": None}]}
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    self.wfile.flush()

                try:
                    try:
                        engine.generate(prompt, max_tokens, emit=emit)
                        end = {"id": cid, "object": "text_completion", "created": created, "model": model,
                               "choices": [{"text": "", "index": 0, "finish_reason": "length", "logprobs": None}]}
                    except (ValueError, ServingPaused) as exc:  # headers are out: report in the stream
                        end = {"error": {"message": str(exc), "type": "invalid_request_error"
                                         if isinstance(exc, ValueError) else "service_unavailable"}}
                    self.wfile.write(b"data: " + json.dumps(end).encode() + b"\n\ndata: [DONE]\n\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass
                return
            try:
                text = engine.generate(prompt, max_tokens)
            except ValueError as exc:
                _reply(self, 400, {"error": {"message": str(exc), "type": "invalid_request_error"}})
                return
            except ServingPaused as exc:
                _reply(self, 503, {"error": {"message": str(exc)}})
                return
            ntok = len(prompt.encode()) + 1
            _reply(self, 200, {"id": cid, "object": "text_completion", "created": created, "model": model,
                               "choices": [{"text": text, "index": 0, "finish_reason": "length", "logprobs": None}],
                               "usage": {"prompt_tokens": ntok, "completion_tokens": max_tokens,
                                         "total_tokens": ntok + max_tokens}})

    return Handler


def pick_device(requested: str) -> str:
    if requested != "auto":
        return requested
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def serve(args: argparse.Namespace) -> int:
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
    device = pick_device(args.device)
    engine = Engine(Path(args.model), device=device, rank=rank, world=world,
                    served_model_name=args.served_model_name or Path(args.model).name, max_seq=args.max_seq,
                    compile=args.compile)
    # The loopback control API the activation runtime drives (shared by every integration).
    lifecycle = Lifecycle(ReferenceControl(engine))
    control.start_from_env(lifecycle)
    transport = Transport(rank=rank, world=world, device=device,
                          endpoint_file=os.environ.get(ENV_COORDINATOR),
                          scope=os.environ.get(ENV_SCOPE, "local"))
    log(f"rank {rank}/{world} loading {args.model} on {device}")
    engine.start(transport)
    lifecycle.mark_ready()
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
    s.set_defaults(func=serve)
    m = sub.add_parser("make-model", help="generate deterministic weights as safetensors")
    m.add_argument("--out", required=True)
    m.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    m.add_argument("--model-id", default=None)
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=make_model_cmd)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
