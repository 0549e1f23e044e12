"""``coldsnap coordinator serve|health|get|set``: run or talk to an activation's CSKV coordinator.

Nothing here prints the token: ``serve`` prints the public endpoint (address,
port, scope, endpoint file) once it listens; the token stays in the 0600 file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.client import CoordinatorClient
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.serve import (
    add_serve_arguments,
    limits_from,
    run_server_process,
)


def register(sub) -> None:
    p = sub.add_parser("coordinator", help="run or query the activation-scoped CSKV coordinator")
    csub = p.add_subparsers(dest="coordinator_command", metavar="ACTION", required=True)

    serve = csub.add_parser("serve", help="serve in the foreground until SIGTERM/SIGINT")
    add_serve_arguments(serve)  # the daemon's own options: one definition
    serve.set_defaults(func=run_serve)

    health = csub.add_parser("health", help="exit 0 when the coordinator answers ok")
    _endpoint_arg(health)
    health.add_argument("--wait", type=float, default=0.0,
                        help="keep retrying a refused connection for this many seconds")
    health.set_defaults(func=run_health)

    get = csub.add_parser("get", help="print a key's value (raw bytes) on stdout")
    _endpoint_arg(get)
    get.add_argument("key")
    get.add_argument("--timeout-ms", type=int, default=0,
                     help="wait up to this long for the key to appear (default 0: do not wait)")
    get.set_defaults(func=run_get)

    setp = csub.add_parser("set", help="store a value (from the argument, or stdin when omitted or '-')")
    _endpoint_arg(setp)
    setp.add_argument("key")
    setp.add_argument("value", nargs="?", default="-")
    setp.set_defaults(func=run_set)


def _endpoint_arg(parser) -> None:
    parser.add_argument("--endpoint-file", required=True, type=Path, help="the coordinator's 0600 descriptor")


def run_serve(args) -> int:
    """Foreground server; prints the public endpoint as one JSON line when ready."""
    limits = limits_from(args)

    def ready(descriptor) -> None:
        print(json.dumps({**descriptor.public(), "endpoint_file": str(args.endpoint_file.absolute())}),
              flush=True)

    return run_server_process(
        args.endpoint_file,
        scope=args.scope,
        address=args.address,
        port=args.port,
        pid_file=args.pid_file,
        limits=limits,
        on_ready=ready,
    )


def run_health(args) -> int:
    """Exit 0 (and print the public endpoint) when the server answers health ok."""
    client = CoordinatorClient.from_file(args.endpoint_file)
    client.health(wait_s=args.wait)
    print(json.dumps({"healthy": True, **client.endpoint.public()}))
    return 0


def run_get(args) -> int:
    """Write the raw value to stdout; not-found / timeout exit 2 with a message."""
    if args.timeout_ms < 0:
        raise ColdSnapError(f"--timeout-ms {args.timeout_ms} is negative", fix="give milliseconds >= 0")
    client = CoordinatorClient.from_file(args.endpoint_file)
    value = client.get(args.key, timeout=args.timeout_ms / 1000.0)
    sys.stdout.buffer.write(value)
    sys.stdout.buffer.flush()
    return 0


def run_set(args) -> int:
    """Store the value from the argument, or from stdin for '-'."""
    value = sys.stdin.buffer.read() if args.value == "-" else args.value.encode("utf-8")
    CoordinatorClient.from_file(args.endpoint_file).set(args.key, value)
    return 0
