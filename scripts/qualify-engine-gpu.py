"""Qualify a ColdSnap engine integration (vLLM or SGLang) on a GPU host, engine side.

Starts the engine with the flags the engine registry requires, under a private
COLDSNAP_CONTROL_FILE, and drives the same control API the activation runtime
drives: greedy reply -> quiesce -> export (pack + residual + manifest) ->
release (GPU memory must drop) -> resume with the native pack -> the exact same
reply -> resume path again with recovery -> sleep -> wake -> same reply.
No CRIU here: this proves the in-process half (observer, allocation table,
release at kept addresses, hydration, KV re-zero, control API) before the
full ``coldsnap capture`` / ``coldsnap restore`` run described in docs/engines.md.

Usage (see docs/engines.md for the environment):
  python scripts/qualify-engine-gpu.py vllm   --model /models/Qwen2.5-0.5B-Instruct --revision <40-hex> --out /tmp/q
  python scripts/qualify-engine-gpu.py sglang --model /models/Qwen2.5-0.5B-Instruct --revision <40-hex> --out /tmp/q
Exit status 0 and a JSON report on stdout when every step passed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

COMMANDS = {
    "vllm": lambda a: ["vllm", "serve", a.model, "--port", str(a.port), "--enforce-eager", "--max-model-len", "512",
                       "--gpu-memory-utilization", "0.5", "--enable-sleep-mode", "--sleep-mode-backend", "coldsnap",
                       "--worker-extension-cls", "coldsnap_engines.vllm.worker.ColdSnapWorkerExtension",
                       "--served-model-name", "m"],
    "sglang": lambda a: [sys.executable, "-m", "sglang.launch_server", "--model-path", a.model, "--port", str(a.port),
                         "--enable-memory-saver", "--mem-fraction-static", "0.5", "--served-model-name", "m"],
}
ENV = {"vllm": {"VLLM_PLUGINS": "coldsnap"}, "sglang": {"SGLANG_PLUGINS": "coldsnap"}}


def http(method: str, url: str, body: dict | None = None, token: str | None = None, timeout: float = 1800) -> dict:
    req = urllib.request.Request(url, method=method, data=json.dumps(body or {}).encode() if method == "POST" else None,
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"{}")


def gpu_used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("engine", choices=sorted(COMMANDS))
    p.add_argument("--model", required=True, help="local directory of a safetensors model")
    p.add_argument("--revision", required=True, help="the model's immutable 40-hex revision")
    p.add_argument("--model-id", default="qualify/model")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--prompt", default="The capital of France is")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    control_file = a.out / "control.json"
    control_file.unlink(missing_ok=True)
    env = {**os.environ, **ENV[a.engine], "COLDSNAP_CONTROL_FILE": str(control_file)}
    log = open(a.out / "engine.log", "wb")
    proc = subprocess.Popen(COMMANDS[a.engine](a), env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    report: dict = {"engine": a.engine, "steps": []}

    def step(name, fn):
        t0 = time.monotonic()
        out = fn()
        report["steps"].append({"step": name, "seconds": round(time.monotonic() - t0, 3)})
        return out

    def reply() -> str:
        r = http("POST", f"http://127.0.0.1:{a.port}/v1/completions",
                 {"model": "m", "prompt": a.prompt, "max_tokens": 16, "temperature": 0})
        return r["choices"][0]["text"]

    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"{a.engine} exited ({proc.returncode}); see {a.out / 'engine.log'}")
            try:
                ctl = json.loads(control_file.read_text())
                if http("GET", f"http://127.0.0.1:{ctl['port']}/status", token=ctl["token"], timeout=10)["state"] == "ready":
                    urllib.request.urlopen(f"http://127.0.0.1:{a.port}/v1/models", timeout=10)
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(1)
        else:
            raise SystemExit("engine did not become ready in 900 s")
        base, tok = f"http://127.0.0.1:{ctl['port']}", ctl["token"]

        def call(path: str, body: dict | None = None) -> dict:
            return http("POST", base + path, body, tok)

        expected = step("cold-reply", reply)
        step("quiesce", lambda: call("/quiesce"))
        wdir = a.out / "worker-0"
        export_body = {"out_dir": str(wdir), "export_pack": True, "state_root": str(a.out / "state"),
                       "model": {"id": a.model_id, "revision": a.revision}}
        exp = step("export", lambda: call("/export", export_body))["payload"]
        report["payload"] = exp
        used_before = gpu_used_mib()
        step("release", lambda: call("/release"))
        report["gpu_mib_released"] = used_before - gpu_used_mib()
        spec = {"manifest": str(wdir / "native-manifest.json"), "residual": str(wdir / "weights.blob"),
                "replay": str(wdir / "replay-plan.json"), "model_dir": a.model, "state_root": str(a.out / "state"),
                "pack": {"path": str(a.out / "state" / exp["pack"]["path"]), "sha256": exp["pack"]["sha256"],
                         "size": exp["pack"]["size"]}, "generation": "q1", "materialize": "off"}
        report["resume_native"] = step("resume-native", lambda: call("/resume", {**spec, "provider": "native"}))["hydration"]
        got = step("native-reply", reply)
        assert got == expected, f"native restore replied {got!r}, the cold engine {expected!r}"
        step("sleep", lambda: call("/sleep"))
        step("wake", lambda: call("/wake", {**spec, "provider": "recovery"}))
        got = step("wake-reply", reply)
        assert got == expected, f"after wake: {got!r} != {expected!r}"
        report["ok"] = True
        print(json.dumps(report, indent=2))
        return 0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
