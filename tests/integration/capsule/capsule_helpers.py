"""Real infrastructure for the capsule tests: the runtime image build, Debian's docker-registry, a corrupting proxy.

A uniquely named module (not conftest.py) so tests can import it by name.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from netports import free_port  # pylint: disable=unused-import

REPO = Path(__file__).resolve().parents[3]
REGISTRY_BIN = "/usr/bin/docker-registry"


def build_runtime_image(*, base_only: bool = False) -> dict:
    """Run runtime_image/build.py (its cache makes a repeat instant) and return its JSON result."""
    cmd = [sys.executable, str(REPO / "runtime_image" / "build.py")] + (["--base-only"] if base_only else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"runtime image build failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout)


@contextmanager
def docker_registry(root: Path, *, readonly: bool = False) -> Iterator[str]:
    """Debian's docker-registry on 127.0.0.1:<free port> with filesystem storage in ``root``; yields host:port."""
    root.mkdir(parents=True, exist_ok=True)
    for _attempt in range(5):
        port = free_port()
        config = root / "config.yml"
        config.write_text(
            "version: 0.1\n"
            "log:\n  level: error\n  accesslog:\n    disabled: true\n"
            "storage:\n"
            f"  filesystem:\n    rootdirectory: {root / 'data'}\n"
            "  delete:\n    enabled: true\n"
            f"  maintenance:\n    readonly:\n      enabled: {'true' if readonly else 'false'}\n"
            f"http:\n  addr: 127.0.0.1:{port}\n  secret: coldsnap-test-only\n")
        log = open(root / "registry.log", "ab")
        proc = subprocess.Popen([REGISTRY_BIN, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
        try:
            if _wait_http(f"http://127.0.0.1:{port}/v2/", proc):
                yield f"127.0.0.1:{port}"
                return
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
    raise RuntimeError(f"docker-registry did not start; see {root / 'registry.log'}")


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                return resp.status == 200
        except OSError:
            time.sleep(0.1)
    return False


class CorruptingProxy:
    """An HTTP proxy in front of a registry that flips one byte in every blob it serves (of ``min_bytes`` or more).

    Everything else (the /v2/ ping, manifests, headers such as
    Docker-Content-Digest) passes through unchanged, so the client only notices
    when it hashes what it received.
    """

    def __init__(self, upstream: str, *, min_bytes: int = 0) -> None:
        self.upstream = upstream
        self.min_bytes = min_bytes  # leave blobs smaller than this alone (e.g. the image config)
        self.corrupted: list[str] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read() if self.command != "HEAD" else b""
                if self.command == "GET" and "/blobs/sha256:" in self.path and data and len(data) >= proxy.min_bytes:
                    mid = len(data) // 2
                    data = data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:]
                    proxy.corrupted.append(self.path)
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                length_out = resp.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length_out or "0")
                self.end_headers()
                if data:
                    self.wfile.write(data)
                conn.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_PATCH = do_DELETE = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> CorruptingProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def make_state(root: Path) -> Path:
    """A unit state directory shaped like a capture: CRIU images, residual, manifests, logs and a model pack."""
    state = root / "state"
    (state / "criu").mkdir(parents=True)
    (state / "criu" / "pages-1.img").write_bytes(os.urandom(64 * 1024))
    (state / "criu" / "inventory.img").write_bytes(b"\x01\x02inventory")
    (state / "weights.blob").write_bytes(os.urandom(32 * 1024))
    (state / "native-manifest.json").write_text('{"format": 1}\n')
    (state / "replay-plan.json").write_text('{"format": 1}\n')
    (state / "capture.log").write_text("captured\n")
    (state / "tool.sh").write_text("#!/bin/sh\n")
    os.chmod(state / "tool.sh", 0o4755)
    (state / ("a" * 64 + ".pack")).write_bytes(b"MODEL" * 1000)
    return state


def ansible_env() -> dict:
    """Environment for ad-hoc ``ansible`` runs of this checkout's collection, JSON output."""
    venv_bin = Path(sys.executable).parent
    env = dict(os.environ)
    env["ANSIBLE_COLLECTIONS_PATH"] = str(REPO / ".venv" / "collections")
    env["ANSIBLE_LOCALHOST_WARNING"] = "false"
    env["ANSIBLE_INVENTORY_UNPARSED_WARNING"] = "false"
    env["ANSIBLE_LOAD_CALLBACK_PLUGINS"] = "true"
    env["ANSIBLE_STDOUT_CALLBACK"] = "ansible.builtin.json"
    env["ANSIBLE_PYTHON_INTERPRETER"] = sys.executable
    env["PATH"] = f"{venv_bin}:{env.get('PATH', '')}"
    return env


def run_module(module: str, args: dict, *extra: str) -> tuple[dict, str]:
    """``ansible localhost -m coldsnap.fleet.<module>``: (the task result, the whole output)."""
    ansible = str(Path(sys.executable).parent / "ansible")
    proc = subprocess.run([ansible, "localhost", "-m", f"coldsnap.fleet.{module}", "-a", json.dumps(args), *extra],
                          capture_output=True, text=True, env=ansible_env(), timeout=300, check=False)
    text = proc.stdout
    start = 0 if text.startswith("{") else text.index("\n{") + 1  # -vvv prints a preamble first
    doc = json.loads(text[start:])
    return doc["plays"][0]["tasks"][0]["hosts"]["localhost"], proc.stdout + proc.stderr
