"""Capture and restore of one launch unit, phase by phase.

Capture: start the engine -> ready -> exact validation -> quiesce (transport down,
KV discarded) -> export residual/manifest/replay (+ pack) -> release the weights
-> CUDA checkpoint (GPU) -> CRIU dump.
Restore: ports/pids free -> CRIU restore (stopped) -> CUDA restore -> release ->
resume (arenas at the same addresses, fresh transport from the coordinator,
hydration, zeroed KV) -> exact validation.
Every cross-unit step is a coordinator phase; any unit can fail the activation.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError, UnitError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import atomic_write_json
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.timing import SpanRecorder
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.versions import (
    EVIDENCE_FORMAT,
    EVIDENCE_KIND,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.snapshot import criu as criu_mod
from ansible_collections.coldsnap.fleet.plugins.module_utils.snapshot import cuda as cuda_mod
from ansible_collections.coldsnap.fleet.plugins.module_utils.snapshot import ports

from coldsnap_activation import keeper
from coldsnap_activation.engine_handle import EngineHandle
from coldsnap_activation.probes import PortProbe, reply_digest, stream_completion, wait_http_ready
from coldsnap_activation.spec import UnitSpec
from coldsnap_activation.sync import Phases

EVIDENCE_FILE = "evidence.json"


def _engine_env(spec: UnitSpec, worker: dict) -> dict[str, str]:
    bindir = os.path.dirname(spec.python)
    env = {
        "PATH": f"{bindir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
    }
    env.update(spec.unit.get("environment", {}))
    env.update(spec.transport_env)
    env.update({
        "COLDSNAP_RANK": str(worker["rank"]),
        "COLDSNAP_WORLD_SIZE": str(spec.world_size),
        "COLDSNAP_UNIT": spec.unit_id,
        "COLDSNAP_WORKER": worker["id"],
        "COLDSNAP_SCOPE": spec.operation_id,
    })
    if spec.coordinator:
        env["COLDSNAP_COORDINATOR"] = spec.coordinator["endpoint_file"]
    devices = spec.unit.get("devices", [])
    if worker.get("device_slot") is not None and devices:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # ordinals as NVML and host_facts number them
        env["CUDA_VISIBLE_DEVICES"] = str(devices[worker["device_slot"]])
    elif not devices:
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
    return env


def gpu_placement(spec: UnitSpec, worker: dict) -> tuple[list[str], list[str]]:
    """UUIDs of the GPU(s) a worker of this unit uses (from the unit's device ordinals) and of
    every GPU of this host: CUDA restore pairs all of them once a worker moves."""
    host = cuda_mod.device_uuids()
    devices = spec.unit.get("devices", [])
    if worker.get("device_slot") is None or not devices:
        return [], host
    return [host[devices[worker["device_slot"]]]], host


def process_memory(pid: int) -> dict:
    """What a snapshot of ``pid`` is about to carry: anonymous RSS and GPU memory in use."""
    out: dict = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                key, value = line.split(":", 1)
                out[key.lower() + "_kib"] = int(value.split()[0])
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        import subprocess

        r = subprocess.run([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           check=False, capture_output=True, text=True, timeout=30)
        for line in r.stdout.splitlines():
            parts = [x.strip() for x in line.split(",")]
            if len(parts) == 2 and parts[0] == str(pid):
                out["gpu_used_mib"] = int(parts[1])
    return out


def _import_engine_spans(rec: SpanRecorder, reply: dict, worker: str) -> None:
    """Adopt the engine's spans on the unit clock, shifted by the engine's clock offset."""
    shift = int(reply.get("clock_offset_ns", 0))
    for s in reply.get("spans", []):
        if s.get("end_ns"):
            rec.add_span(s["name"], s["start_ns"] + shift, s["end_ns"] + shift, worker=worker, **s.get("attrs", {}))


def _parallel(handles: list[EngineHandle], fn) -> list:
    """Run ``fn(handle)`` for every worker at once (collective engine steps need that)."""
    results: list = [None] * len(handles)
    errors: list = []

    def run(i: int, h: EngineHandle) -> None:
        try:
            results[i] = fn(h)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, h)) for i, h in enumerate(handles)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


class Activation:
    """One unit's capture or restore run."""

    def __init__(self, spec: UnitSpec) -> None:
        self.spec = spec
        self.t0 = spec.t0_ns or time.monotonic_ns()
        self.rec = SpanRecorder(f"unit:{spec.unit_id}", host=spec.host, unit=spec.unit_id)
        self.phases = Phases(spec.coordinator["endpoint_file"] if spec.coordinator else None,
                             rank=spec.index, world=spec.unit_count, unit=spec.unit_id)
        self.unit_dir = Path(spec.unit_dir)
        self.workload_dir = Path(spec.workload_dir)
        self.handles = [EngineHandle(unit=spec.unit_id, worker=w, workload_dir=self.workload_dir)
                        for w in spec.workers]
        self.readiness: dict | None = None
        self.reply: str | None = None

    # ------------------------------------------------------------- helpers
    def _since_t0(self, t_ns: int | None) -> float | None:
        return None if t_ns is None else round((t_ns - self.t0) / 1e9, 6)

    def _validate(self, probe: PortProbe | None, *, expected: str | None) -> None:
        svc = self.spec.service
        val = self.spec.validation
        if not svc:
            return

        def alive() -> bool:
            return all(h.alive() for h in self.handles)

        with self.rec.span("unit.http.ready"):
            try:
                ready_ns = wait_http_ready(svc["address"], svc["port"], val["health_path"],
                                           timeout=self.spec.timeout("ready", 900), alive=alive)
            except (RuntimeError, TimeoutError) as exc:
                raise self.handles[0].failure(str(exc)) from None
        with self.rec.span("unit.validate") as sp:
            try:
                reply, first_ns = stream_completion(svc["address"], svc["port"], model=val.get("model", ""),
                                                    prompt=val["prompt"], max_tokens=val["max_tokens"])
            except (OSError, RuntimeError, ValueError) as exc:
                raise self.handles[0].failure(f"validation request failed: {exc}") from None
            sp["attrs"]["reply_sha256"] = reply_digest(reply)
        if probe is not None:
            probe.stop()
        self.readiness = {
            "ttr_port_open_s": self._since_t0(probe.open_ns if probe else None),
            "ttr_http_ready_s": self._since_t0(ready_ns),
            "ttft_s": self._since_t0(first_ns),
        }
        self.rec.mark("first_token", seconds=self.readiness["ttft_s"])
        self.reply = reply
        if expected is not None and reply != expected:
            raise UnitError(f"unit {self.spec.unit_id}: validation reply differs from the accepted one: "
                            f"got {reply!r}, expected {expected!r}",
                            fix="the restored engine does not reproduce its capture; recapture, or check the "
                                "weights provider (payload digest / safetensors revision)")

    def _evidence(self, workers: list[dict], extra: dict | None = None) -> dict:
        return {
            "format": EVIDENCE_FORMAT, "kind": EVIDENCE_KIND, "operation": self.spec.operation,
            "operation_id": self.spec.operation_id, "capture_id": self.spec.capture_id, "unit": self.spec.unit_id,
            "host": self.spec.host, "workers": workers, "readiness": self.readiness, "reply": self.reply,
            "reply_sha256": reply_digest(self.reply) if self.reply is not None else None,
            "timing": {"spans": self.rec.spans, "marks": self.rec.marks, "t0_ns": self.t0},
            **(extra or {}),
        }

    def _fail(self, exc: BaseException) -> None:
        self.phases.abort(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)

    # ------------------------------------------------------------- capture
    def capture(self) -> dict:
        spec = self.spec
        if len(self.handles) != 1:
            raise UnitError(f"unit {spec.unit_id}: the engine runs one worker per unit, got {len(self.handles)}",
                            fix="declare one worker per launch unit (use more units for tensor parallelism)")
        criu = criu_mod.find_criu(spec.criu_binary)
        self.unit_dir.mkdir(parents=True, exist_ok=True)
        self.workload_dir.mkdir(parents=True, exist_ok=True)
        (self.workload_dir / "target.log").write_bytes(b"")
        probe = None
        try:
            if spec.service:
                probe = PortProbe(spec.service["address"], spec.service["port"], self.t0).start()
            with self.rec.span("unit.engine.start"):
                for h in self.handles:
                    h.spawn(list(spec.unit["command"]), _engine_env(spec, h.worker))
                for h in self.handles:
                    h.wait_control(spec.timeout("start", 900))
                for h in self.handles:
                    h.wait_state(("ready",), spec.timeout("ready", 900))
            self._validate(probe, expected=(spec.validation or {}).get("expected"))
            self.phases.wait("capture/validated", spec.timeout("phase", 600))
            if self.reply is not None:
                self.phases.publish("capture/reply", self.reply.encode())
            with self.rec.span("unit.quiesce"):
                for h, r in zip(self.handles, _parallel(self.handles, lambda h: h.call("POST", "/quiesce")),
                                strict=True):
                    _import_engine_spans(self.rec, r, h.worker["id"])
            self.phases.wait("capture/quiesced", spec.timeout("phase", 600))
            payloads = {}
            with self.rec.span("unit.export"):
                for h in self.handles:
                    out = self.unit_dir / "workers" / h.worker["id"]
                    r = h.call("POST", "/export", {
                        "out_dir": str(out), "export_pack": bool(spec.weights.get("export_pack", True)),
                        "state_root": spec.state_root, "model": spec.model})
                    payloads[h.worker["id"]] = r["payload"]
            with self.rec.span("unit.release"):
                for h in self.handles:
                    h.call("POST", "/release")
                logs = self.unit_dir / "logs"
                logs.mkdir(exist_ok=True)
                shutil.copyfile(self.workload_dir / "target.log", logs / "capture.log")
                # The workload log starts empty for every activation; CRIU records this size.
                os.truncate(self.workload_dir / "target.log", 0)
            self.phases.wait("capture/released", spec.timeout("phase", 600))
            cuda_used = {}
            memory = {h.worker["id"]: process_memory(h.pid) for h in self.handles}
            with self.rec.span("unit.cuda.checkpoint"):
                for h in self.handles:
                    cuda_used[h.worker["id"]] = cuda_mod.uses_cuda(h.pid)
                    if cuda_used[h.worker["id"]]:
                        cuda_mod.checkpoint(h.pid, lock_timeout_ms=int(spec.timeout("cuda_lock", 30) * 1000))
            self.phases.wait("capture/cuda", spec.timeout("phase", 600))
            workers = []
            for h in self.handles:
                wid = h.worker["id"]
                tids = ports.tids_of(h.pid)
                listeners = ports.listeners_of(h.pid)
                with self.rec.span("unit.criu.dump", worker=wid) as sp:
                    res = criu_mod.dump(criu, h.pid, self.unit_dir / "criu" / wid)
                    sp["attrs"]["bytes"] = res.bytes
                h.reap(60)
                ctl_dir = self.unit_dir / "control"
                ctl_dir.mkdir(mode=0o700, exist_ok=True)
                atomic_write_json(ctl_dir / f"{wid}.json", h.control_info(), mode=0o600)
                gpu_uuids, host_gpus = gpu_placement(spec, h.worker) if cuda_used[wid] else ([], [])
                workers.append({"worker": wid, "rank": h.worker["rank"], "pid": h.pid, "tids": tids,
                                "gpu_uuids": gpu_uuids, "host_gpu_uuids": host_gpus,
                                "listeners": [list(x) for x in listeners], "cuda": cuda_used[wid],
                                "memory_at_checkpoint": memory[wid],
                                "payload": payloads[wid], "criu": {"bytes": res.bytes, "dump_seconds": res.seconds}})
            self.phases.wait("capture/dumped", spec.timeout("phase", 600))
            acceptance = self.reply
            if acceptance is None and spec.coordinator:
                acceptance = (self.phases.fetch("capture/reply", 60) or b"").decode()
            ev = self._evidence(workers, {"criu_version": criu.version, "acceptance_reply": acceptance})
            atomic_write_json(self.unit_dir / EVIDENCE_FILE, ev)
            return ev
        except BaseException as exc:
            self._fail(exc)
            for h in self.handles:
                h.kill()
            raise
        finally:
            if probe is not None:
                probe.stop()

    # ----------------------------------------------- capture in place (overlay)
    def capture_running(self) -> dict:
        """Capture the unit's running (restored) engine in place: a target-local overlay.

        Nothing is started: the running engine is adopted and validated, then
        quiesced, exported (its pack converges on the object already in the node
        cache), released, and dumped with CRIU leaving it running. The same
        engine is then resumed in place (native hydration from the now-present
        pack) and validated again, so the workload keeps serving. The workload
        log is reset before the dump, as at capture, so the resumed engine's
        restore-boundary marker is its first line.
        """
        spec = self.spec
        criu = criu_mod.find_criu(spec.criu_binary)
        handles = self._running_handles()
        states = [h.call("GET", "/status", timeout=30)["state"] for h in handles]
        if any(s != "ready" for s in states):
            raise UnitError(f"unit {spec.unit_id}: engines are {states}; an overlay is captured from a ready engine",
                            fix="wake or restore the workload first")
        self.unit_dir.mkdir(parents=True, exist_ok=True)
        expected = (spec.validation or {}).get("expected")
        try:
            self._validate(None, expected=expected)
            self.phases.wait("overlay/validated", spec.timeout("phase", 600))
            with self.rec.span("unit.quiesce"):
                for h, r in zip(handles, _parallel(handles, lambda h: h.call("POST", "/quiesce")), strict=True):
                    _import_engine_spans(self.rec, r, h.worker["id"])
            self.phases.wait("overlay/quiesced", spec.timeout("phase", 600))
            payloads = {}
            with self.rec.span("unit.export"):
                for h in handles:
                    r = h.call("POST", "/export", {
                        "out_dir": str(self.unit_dir / "workers" / h.worker["id"]), "export_pack": True,
                        "state_root": spec.state_root, "model": spec.model})
                    payloads[h.worker["id"]] = r["payload"]
            with self.rec.span("unit.release"):
                for h in handles:
                    h.call("POST", "/release")
                logs = self.unit_dir / "logs"
                logs.mkdir(exist_ok=True)
                shutil.copyfile(self.workload_dir / "target.log", logs / "capture.log")
                os.truncate(self.workload_dir / "target.log", 0)
            self.phases.wait("overlay/released", spec.timeout("phase", 600))
            workers = []
            for h in handles:
                wid = h.worker["id"]
                cuda = cuda_mod.uses_cuda(h.pid)
                memory = process_memory(h.pid)
                if cuda:
                    cuda_mod.checkpoint(h.pid, lock_timeout_ms=int(spec.timeout("cuda_lock", 30) * 1000))
                tids, listeners = ports.tids_of(h.pid), ports.listeners_of(h.pid)
                with self.rec.span("unit.criu.dump", worker=wid, leave_running=True) as sp:
                    res = criu_mod.dump(criu, h.pid, self.unit_dir / "criu" / wid, leave_running=True)
                    sp["attrs"]["bytes"] = res.bytes
                if cuda:
                    cuda_mod.restore(h.pid)
                    cuda_mod.unlock(h.pid)
                ctl_dir = self.unit_dir / "control"
                ctl_dir.mkdir(mode=0o700, exist_ok=True)
                atomic_write_json(ctl_dir / f"{wid}.json", h.control_info(), mode=0o600)
                gpu_uuids, host_gpus = gpu_placement(spec, h.worker) if cuda else ([], [])
                workers.append({"worker": wid, "rank": h.worker["rank"], "pid": h.pid, "tids": tids,
                                "gpu_uuids": gpu_uuids, "host_gpu_uuids": host_gpus,
                                "listeners": [list(x) for x in listeners], "cuda": cuda,
                                "memory_at_checkpoint": memory, "payload": payloads[wid],
                                "criu": {"bytes": res.bytes, "dump_seconds": res.seconds}})
            self.phases.wait("overlay/dumped", spec.timeout("phase", 600))
            with self.rec.span("unit.resume"):
                def resume(h: EngineHandle) -> dict:
                    wid = h.worker["id"]
                    wdir = self.unit_dir / "workers" / wid
                    w = spec.weights.get("workers", {}).get(wid, {})
                    return h.call("POST", "/resume", {
                        "operation_id": spec.operation_id,
                        "coordinator_endpoint": spec.coordinator["endpoint_file"] if spec.coordinator else None,
                        "generation": f"{spec.operation_id}.overlay", "transport_env": spec.transport_env,
                        "provider": w.get("provider", "native"), "manifest": str(wdir / "native-manifest.json"),
                        "residual": str(wdir / "weights.blob"), "replay": str(wdir / "replay-plan.json"),
                        "pack": w.get("pack"), "model_dir": spec.weights.get("model_dir"),
                        "state_root": spec.state_root, "materialize": "off", "warm": False})
                for h, r in zip(handles, _parallel(handles, resume), strict=True):
                    _import_engine_spans(self.rec, r, h.worker["id"])
            self.phases.wait("overlay/resumed", spec.timeout("phase", 600))
            self._validate(None, expected=expected)
            self.phases.wait("overlay/validated-again", spec.timeout("phase", 600))
            ev = self._evidence(workers, {"criu_version": criu.version, "acceptance_reply": self.reply,
                                          "in_place": True})
            atomic_write_json(self.unit_dir / EVIDENCE_FILE, ev)
            return ev
        except BaseException as exc:
            self._fail(exc)
            raise

    # ------------------------------------------------------------- restore
    def restore(self) -> dict:
        spec = self.spec
        captured = json.loads((self.unit_dir / EVIDENCE_FILE).read_text())
        by_worker = {w["worker"]: w for w in captured["workers"]}
        criu = criu_mod.find_criu(spec.criu_binary)
        restored: list[EngineHandle] = []
        probe = None
        try:
            with self.rec.span("unit.admission"):
                for h in self.handles:
                    cw = by_worker[h.worker["id"]]
                    ports.require_ports_free([tuple(x) for x in cw["listeners"]], unit=spec.unit_id)
                    ports.require_pids_free([cw["pid"], *cw["tids"]], unit=spec.unit_id)
            self.workload_dir.mkdir(parents=True, exist_ok=True)
            (self.workload_dir / "target.log").write_bytes(b"")
            if spec.service:
                probe = PortProbe(spec.service["address"], spec.service["port"], self.t0).start()
            with self.rec.span("unit.criu.restore"):
                for h in self.handles:
                    wid = h.worker["id"]
                    cw = by_worker[wid]
                    control = json.loads((self.unit_dir / "control" / f"{wid}.json").read_text())
                    atomic_write_json(h.control_file, control, mode=0o600)
                    images = self.unit_dir / "criu" / wid
                    if spec.supervise:  # we are the container's PID 1: the tree becomes our child
                        pid = criu_mod.restore(criu, images, leave_stopped=True, sibling=True).pid
                    else:
                        kept = keeper.start(images, leave_stopped=True, criu_binary=criu.binary,
                                            log_path=self.workload_dir / "keeper.log")
                        if not kept["ok"]:
                            raise UnitError(f"unit {spec.unit_id}: {kept['error']}")
                        pid = kept["pid"]
                    h.adopt(pid, control)
                    restored.append(h)
                    if pid != cw["pid"]:
                        raise UnitError(f"unit {spec.unit_id}: CRIU restored pid {pid}, captured {cw['pid']}")
            self.phases.wait("restore/criu", spec.timeout("phase", 600))
            with self.rec.span("unit.cuda.restore"):
                for h in self.handles:
                    os.kill(h.pid, signal.SIGCONT)
                    cw = by_worker[h.worker["id"]]
                    if cw["cuda"]:
                        # The unit may run on other GPUs than at capture (placement): remap by UUID.
                        now, host_gpus = gpu_placement(spec, h.worker)
                        remap = cuda_mod.restore_map(cw.get("gpu_uuids") or now, now, cw.get("host_gpu_uuids"),
                                                     host_gpus)
                        cuda_mod.restore(h.pid, remap=remap)
                        cuda_mod.unlock(h.pid)
            self.phases.wait("restore/released", spec.timeout("phase", 600))
            with self.rec.span("unit.resume"):
                def resume(h: EngineHandle) -> dict:
                    wid = h.worker["id"]
                    wdir = self.unit_dir / "workers" / wid
                    w = spec.weights.get("workers", {}).get(wid, {})
                    return h.call("POST", "/resume", {
                        "operation_id": spec.operation_id,
                        "coordinator_endpoint": spec.coordinator["endpoint_file"] if spec.coordinator else None,
                        "generation": spec.operation_id, "transport_env": spec.transport_env,
                        "provider": w.get("provider", spec.weights.get("provider", "recovery")),
                        "manifest": str(wdir / "native-manifest.json"), "residual": str(wdir / "weights.blob"),
                        "replay": str(wdir / "replay-plan.json"), "pack": w.get("pack"),
                        "model_dir": spec.weights.get("model_dir"), "state_root": spec.state_root,
                        "materialize": spec.weights.get("materialize", "off"), "warm": spec.warm})
                for h, r in zip(self.handles, _parallel(self.handles, resume), strict=True):
                    _import_engine_spans(self.rec, r, h.worker["id"])
            self.phases.wait("restore/resumed", spec.timeout("phase", 600))
            if not spec.warm:
                self._validate(probe, expected=(spec.validation or {}).get("expected"))
                self.phases.wait("restore/validated", spec.timeout("phase", 600))
            workers = [{"worker": h.worker["id"], "rank": h.worker["rank"], "pid": h.pid} for h in self.handles]
            ev = self._evidence(workers, {"warm": spec.warm})
            return ev
        except BaseException as exc:
            self._fail(exc)
            for h in restored:  # never leave a half-restored process tree behind
                h.kill()
            raise
        finally:
            if probe is not None:
                probe.stop()

    # ----------------------------------------------------------- lifecycle
    def _running_handles(self) -> list[EngineHandle]:
        for h in self.handles:
            info = json.loads(h.control_file.read_text())
            h.adopt(info["pid"], info)
            if not h.alive():
                raise UnitError(f"unit {self.spec.unit_id}: worker {h.worker['id']} (pid {info['pid']}) is not running",
                                fix="restore the workload first")
        return self.handles

    def lifecycle(self, action: str) -> dict:
        """status / sleep / wake / finish-warm of a running unit (convergent)."""
        spec = self.spec
        try:
            handles = self._running_handles()
        except FileNotFoundError:
            return self._evidence([], {"state": "absent"})
        states = [h.call("GET", "/status", timeout=30)["state"] for h in handles]
        changed = False
        if action == "sleep" and any(s == "ready" for s in states):
            with self.rec.span("unit.sleep"):
                for h in handles:
                    _import_engine_spans(self.rec, h.call("POST", "/sleep"), h.worker["id"])
            changed = True
        elif action in ("wake", "finish-warm") and any(s in ("sleeping", "warm") for s in states):
            path = "/wake" if "sleeping" in states else "/finish-warm"
            with self.rec.span(f"unit.{action}"):
                def wake(h: EngineHandle) -> dict:
                    wid = h.worker["id"]
                    wdir = self.unit_dir / "workers" / wid
                    w = spec.weights.get("workers", {}).get(wid, {})
                    return h.call("POST", path, {
                        "provider": w.get("provider", spec.weights.get("provider", "recovery")),
                        "manifest": str(wdir / "native-manifest.json"), "residual": str(wdir / "weights.blob"),
                        "replay": str(wdir / "replay-plan.json"), "pack": w.get("pack"),
                        "model_dir": spec.weights.get("model_dir"), "state_root": spec.state_root,
                        "materialize": spec.weights.get("materialize", "off")})
                for h, r in zip(handles, _parallel(handles, wake), strict=True):
                    _import_engine_spans(self.rec, r, h.worker["id"])
            if spec.service and spec.validation:
                self._validate(None, expected=spec.validation.get("expected"))
            changed = True
        final = [h.call("GET", "/status", timeout=30)["state"] for h in handles]
        return self._evidence([{"worker": h.worker["id"], "pid": h.pid, "state": s}
                               for h, s in zip(handles, final, strict=True)],
                              {"state": final[0] if len(set(final)) == 1 else "mixed", "changed": changed})

    def supervise(self) -> int:
        """Stay as the unit's supervisor (container PID 1) until the engine exits."""
        while any(h.alive() for h in self.handles):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(-1, os.WNOHANG)
            time.sleep(0.5)
        return 0


def main_run(spec: UnitSpec, evidence_out: Path | None) -> int:
    """Run the spec's operation, write evidence (or the error) as JSON, return the exit status."""
    act = Activation(spec)
    try:
        if spec.operation == "capture":
            ev = act.capture()
        elif spec.operation == "capture-running":
            ev = act.capture_running()
        elif spec.operation in ("restore", "warm"):
            ev = act.restore()
        elif spec.operation in ("sleep", "wake", "status", "finish-warm"):
            ev = act.lifecycle(spec.operation)
        else:
            raise ColdSnapError(f"unknown unit operation {spec.operation!r}")
        ev["ok"] = True
        code = 0
    except ColdSnapError as exc:
        ev = {"ok": False, "error": str(exc), "unit": spec.unit_id,
              "timing": {"spans": act.rec.spans, "marks": act.rec.marks, "t0_ns": act.t0}}
        code = 1
    except Exception as exc:  # report, never hang the play
        import traceback

        ev = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:],
              "unit": spec.unit_id, "timing": {"spans": act.rec.spans, "marks": act.rec.marks, "t0_ns": act.t0}}
        code = 1
    if evidence_out is not None:
        atomic_write_json(evidence_out, ev)
    else:
        json.dump(ev, sys.stdout)
        sys.stdout.write("\n")
    if code == 0 and spec.supervise and spec.operation in ("restore", "warm"):
        sys.stdout.flush()
        return act.supervise()
    return code
