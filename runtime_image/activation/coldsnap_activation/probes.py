"""Readiness evidence measured from unit start: TTR port-open, TTR HTTP-ready and
startup TTFT (first non-empty streamed token of the exact validation request), and what the
acceptance compares: the reply, and a digest of its per-token log-probabilities together with a
fingerprint of the numerics that computed them."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import platform
import shutil
import socket
import subprocess
import threading
import time
from typing import NamedTuple

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
            attempt = min(deadline, time.monotonic() + 5)  # a server that trickles is cut off, not waited for
            with engine_request(host, port, "GET", path, timeout=5, deadline=attempt) as resp:
                status = resp.status
            if status == 200:
                return time.monotonic_ns()
        except (OSError, http.client.HTTPException):
            pass
        if not alive():
            raise RuntimeError("the engine exited before it became ready")
        time.sleep(0.005)
    raise TimeoutError(f"{path} on {host}:{port} did not answer 200 within {timeout:.0f}s")


class Completion(NamedTuple):
    """A streamed validation completion."""

    text: str
    first_ns: int  # monotonic ns of the first non-empty token
    logprobs: list[dict] | None = None  # per token: {"token", "logprob", "top": [[text, value], ...]}


def stream_completion(address: str, port: int, *, model: str, prompt: str, max_tokens: int,
                      timeout: float = 300, logprobs: int | None = None) -> Completion:
    """POST a streamed temperature-0 completion (with ``logprobs``: the OpenAI completions field,
    whose per-token objects are collected)."""
    host = "127.0.0.1" if address in ("0.0.0.0", "") else address
    req = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if logprobs is not None:
        req["logprobs"] = logprobs
    body = json.dumps(req).encode()
    try:
        return _read_stream(host, port, body, timeout=timeout, logprobs=logprobs)
    except (http.client.HTTPException, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise RuntimeError(f"the validation stream is not an OpenAI completions stream "
                           f"({type(exc).__name__}: {exc})") from None


def _read_stream(host: str, port: int, body: bytes, *, timeout: float, logprobs: int | None) -> Completion:
    """The first choice's text of a streamed completion, which must end with its ``finish_reason`` and
    ``[DONE]``: a stream cut short (the engine died) is never taken for the reply."""
    first_ns = None
    parts: list[str] = []
    tokens: list[dict] | None = [] if logprobs is not None else None
    done = finished = False
    with engine_request(host, port, "POST", "/v1/completions", timeout=timeout, body=body,
                        headers={"Content-Type": "application/json"}, deadline=time.monotonic() + timeout) as resp:
        if resp.status != 200:
            raise RuntimeError(f"validation request answered HTTP {resp.status}: {resp.read()[:300]!r}")
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if not isinstance(chunk, dict):
                raise RuntimeError(f"the validation stream sent {data[:80]!r}, not an object")
            if "error" in chunk:
                raise RuntimeError(f"validation stream reported an error: {chunk['error']}")
            for choice in chunk.get("choices") or []:  # a usage-only chunk has none
                if choice.get("index", 0) != 0:
                    continue
                text = choice.get("text") or ""
                if not isinstance(text, str):
                    raise RuntimeError(f"the validation stream sent text {text!r}")
                if text and first_ns is None:
                    first_ns = time.monotonic_ns()
                parts.append(text)
                if tokens is not None and choice.get("logprobs"):
                    tokens.extend(_token_logprobs(choice["logprobs"]))
                finished = finished or choice.get("finish_reason") is not None
    if not done or not finished:
        raise RuntimeError("the validation stream ended before " + ("its finish_reason" if done else "[DONE]")
                           + " (the engine closed it early, or the time limit cut it)")
    if first_ns is None:
        raise RuntimeError("validation request streamed no token")
    if tokens is not None and not tokens:
        raise RuntimeError(f"validation request asked for logprobs={logprobs} and the engine returned none")
    return Completion("".join(parts), first_ns, tokens)


def _token_logprobs(lp: dict) -> list[dict]:
    """A completions ``logprobs`` object as one record per token (top entries sorted by text)."""
    try:
        return [{"token": tok, "logprob": value, "top": sorted([k, v] for k, v in (top or {}).items())}
                for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)]
    except (KeyError, TypeError, ValueError) as exc:
        raise RuntimeError(f"the engine's logprobs object is not the OpenAI completions shape: {exc}") from None


def reply_digest(reply: str) -> str:
    return "sha256:" + hashlib.sha256(reply.encode()).hexdigest()


def logprobs_digest(tokens: list[dict]) -> str:
    """SHA-256 of the per-token log-probabilities as canonical JSON (floats as their shortest
    round-trip text, so equal digests mean bit-identical values)."""
    canon = json.dumps(tokens, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return "sha256:" + hashlib.sha256(canon.encode()).hexdigest()


DIFFERS = "differs"


def logprobs_verdict(expected: dict | None, got: dict) -> str:
    """How a validation's log-probabilities (``{"top", "sha256", "numerics"}``) compare with the
    accepted ones: ``"identical"``, :data:`DIFFERS` (the same numerics computed other values),
    ``"recorded"`` (nothing accepted yet) or ``"not compared: ..."`` (other numerics, or another
    number of top entries: a difference there would prove nothing)."""
    if not expected:
        return "recorded"
    if expected["top"] != got["top"]:
        return f"not compared: accepted with top {expected['top']}, validated with top {got['top']}"
    if expected["numerics"] != got["numerics"]:
        return "not compared: other numerics (CPU, CPU count, GPU or driver) than at acceptance"
    return "identical" if expected["sha256"] == got["sha256"] else DIFFERS


def numerics(gpu: bool) -> dict:
    """What decides the floating-point results of a step: the CPU model and the CPUs this process
    may run on, and with GPUs their models and the driver."""
    cpu_model = ""
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8", errors="replace"):
            if line.startswith(("model name", "Model")):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out = {"arch": platform.machine(), "cpu_model": cpu_model, "cpus": len(os.sched_getaffinity(0))}
    smi = shutil.which("nvidia-smi") if gpu else None
    if smi:
        r = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"], check=False,
                           capture_output=True, text=True, timeout=30)
        out["gpus"] = sorted(line.strip() for line in r.stdout.splitlines() if line.strip())
    return out


def numerics_digest(doc: dict) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
