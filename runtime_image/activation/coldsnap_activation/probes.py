"""Readiness evidence measured from unit start: TTR port-open, TTR HTTP-ready and
startup TTFT (first non-empty streamed token of the exact validation request)."""

from __future__ import annotations

import hashlib
import http.client
import json
import socket
import threading
import time

from ansible_collections.coldsnap.fleet.plugins.module_utils.process.engine_client import engine_request


class PortProbe:
    """Polls a TCP port from unit start and records when it first accepts."""

    def __init__(self, address: str, port: int, t0_ns: int) -> None:
        self.address = "127.0.0.1" if address in ("0.0.0.0", "") else ("::1" if address == "::" else address)
        self.port = port
        self.t0_ns = t0_ns
        self.open_ns: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="coldsnap-port-probe", daemon=True)

    def start(self) -> PortProbe:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with socket.create_connection((self.address, self.port), timeout=0.5):
                    self.open_ns = time.monotonic_ns()
                    return
            except OSError:
                time.sleep(0.002)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def wait_http_ready(address: str, port: int, path: str, *, timeout: float, alive) -> int:
    """Poll GET ``path`` until 200; return the monotonic time it first succeeded."""
    host = "127.0.0.1" if address in ("0.0.0.0", "") else address
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with engine_request(host, port, "GET", path, timeout=5) as resp:
                status = resp.status
            if status == 200:
                return time.monotonic_ns()
        except (OSError, http.client.HTTPException):
            pass
        if not alive():
            raise RuntimeError("the engine exited before it became ready")
        time.sleep(0.005)
    raise TimeoutError(f"{path} on {host}:{port} did not answer 200 within {timeout:.0f}s")


def stream_completion(address: str, port: int, *, model: str, prompt: str, max_tokens: int,
                      timeout: float = 300) -> tuple[str, int]:
    """POST a streamed temperature-0 completion; (full text, monotonic ns of the first non-empty token)."""
    host = "127.0.0.1" if address in ("0.0.0.0", "") else address
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True}).encode()
    first_ns = None
    parts: list[str] = []
    with engine_request(host, port, "POST", "/v1/completions", timeout=timeout, body=body,
                        headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"validation request answered HTTP {resp.status}: {resp.read()[:300]!r}")
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            text = chunk["choices"][0].get("text", "")
            if text and first_ns is None:
                first_ns = time.monotonic_ns()
            parts.append(text)
    if first_ns is None:
        raise RuntimeError("validation request streamed no token")
    return "".join(parts), first_ns


def reply_digest(reply: str) -> str:
    return "sha256:" + hashlib.sha256(reply.encode()).hexdigest()
