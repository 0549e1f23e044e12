"""Restore-to-first-token vs cold-start-to-first-token of the reference engine on this host.

Runs the real controller path (strict requests, the collection's playbooks through
ansible-runner, CRIU) on localhost: one capture (whose launch is the cold start, measured
from unit start), then ``--restores`` native restores and one recovery restore of the same
artifact. Prints JSON with the readiness figures, the ratios against the cold start
measured in the same run, the per-phase breakdown of the best restore, which hydration fill
ran (``map``: the pack mapped over the CPU arenas; ``python``: copied), and capsule bytes vs
model bytes. Usage: ``python bench/bench_snapshot.py --preset 1g [--tp 1] [--restores 2]
[--copy-weights] [--env KEY=VALUE]`` (``--copy-weights``: the engine runs with
``COLDSNAP_CPU_MAP=0``, so every restore copies the weights, as before the mapping fill; ``--env``
adds to the engine's environment, e.g. ``COLDSNAP_HUGE_PAGES=off`` to restore without huge-page
advice).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="1g")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--restores", type=int, default=2)
    ap.add_argument("--state-root", default="/var/tmp/coldsnap-bench")
    ap.add_argument("--port", type=int, default=18300)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--copy-weights", action="store_true", help="COLDSNAP_CPU_MAP=0: hydrate by copying")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment of the engine unit (repeatable)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_snapshot import env_arg

    extra_env = env_arg(ap, args.env)

    from ansible_collections.coldsnap.fleet.plugins.module_utils.units import environment
    from coldsnap_engines.reference.config import PRESETS
    from coldsnap_engines.reference.weights import make_model

    import coldsnap  # noqa: F401  # pylint: disable=unused-import
    from coldsnap.demo import reference_request
    from coldsnap.runner import operation_extravars, run_playbook

    root = Path(args.state_root).absolute()
    model_dir = root / "models" / f"reference-{args.preset}"
    ident = make_model(model_dir, PRESETS[args.preset], model_id=f"coldsnap/reference-{args.preset}")
    env = environment.compute()
    stamp = time.strftime("%Y%m%d%H%M%S")
    recipe = f"bench-{args.preset}-tp{args.tp}" + ("-copy" if args.copy_weights else "") + ("-env" if extra_env else "")

    def request(op: str, n: int, **kw) -> dict:
        req = reference_request(operation=op, op_id=f"bench-{op}-{stamp}-{n}", model_dir=model_dir, model=ident,
                                port=args.port, state_root=root, env_digest=env, tp=args.tp, threads=args.threads,
                                **kw)
        req["workload"]["recipe"] = recipe
        for u in req["launch"]["units"]:
            u["environment"].update(extra_env)
            if args.copy_weights:
                u["environment"]["COLDSNAP_CPU_MAP"] = "0"
        return req

    def run(req: dict):
        res = run_playbook(operation=req["operation"], request=req, playbook=f"coldsnap.fleet.{req['operation']}",
                           extravars=operation_extravars(req, state_root=root), inventory=None, state_root=root)
        if not res.succeeded:
            raise SystemExit(f"{req['operation']} failed: {res.receipt['error']}")
        return res.receipt

    def stop() -> None:
        for f in (root / "workloads" / recipe).glob("*/control-*.json"):
            try:
                os.kill(json.loads(f.read_text())["pid"], signal.SIGKILL)
            except (OSError, ValueError):
                pass
        time.sleep(1)

    stop()
    cap = run(request("capture", 0, artifact_dir=root / "artifacts" / f"bench-{stamp}"))
    artifact = Path(cap["result"]["operation"]["artifact"])
    art = json.loads(artifact.read_text())
    cold = art["acceptance"]["evidence"]["unit-0"]["readiness"]
    restores = []
    for i, mode in enumerate(["native"] * args.restores + ["recovery"], start=1):
        req = request("restore", i, artifact=artifact)
        req["policy"]["weights"]["mode"] = mode
        rec = run(req)
        unit0 = next(u for u in rec["result"]["operation"]["units"] if u["unit"] == "unit-0")
        spans = {}
        hydration = {}
        for s in rec["timing"]["spans"]:
            if s["clock"] == "unit:unit-0" and s.get("end_ns"):
                spans[s["name"]] = round((s["end_ns"] - s["start_ns"]) / 1e9, 4)
            if s["name"] == "engine.hydrate":
                hydration = {k: s["attrs"].get(k) for k in ("fill", "mapped_bytes", "seconds", "map_fallback")}
        restores.append({"mode": mode, "readiness": unit0["readiness"], "reply_ok": unit0["reply"] ==
                         art["acceptance"]["reply"], "phases": spans, "hydration": hydration,
                         "operation_s": rec["duration_seconds"]})
    stop()
    best = min((r for r in restores if r["mode"] == "native"), key=lambda r: r["readiness"]["ttft_s"])
    model_bytes = sum(w["model_bytes"] for w in art["weights"]["workers"])
    capsule_bytes = sum(c["bytes"] for c in art["capsule"]["units"])
    out = {
        "preset": args.preset, "tp": args.tp, "env": args.env, "cpus": os.cpu_count(), "model_bytes": model_bytes,
        "capsule_bytes": capsule_bytes, "capsule_over_model": round(capsule_bytes / model_bytes, 3),
        "cold": cold, "capture_operation_s": cap["duration_seconds"], "restores": restores,
        "ratios": {k: round(best["readiness"][k] / cold[k], 3)
                   for k in ("ttr_port_open_s", "ttr_http_ready_s", "ttft_s")},
        "recovery_over_native_ttft": round(restores[-1]["readiness"]["ttft_s"] / best["readiness"]["ttft_s"], 3),
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
