"""Capture and restore of one launch unit, phase by phase.

Capture: start the engine (every worker of the unit) -> ready -> exact validation -> quiesce
(transport down, KV discarded) -> export residual/manifest/replay (+ pack) -> release the
weights -> CUDA checkpoint of every CUDA process of the unit (all locked first) -> CRIU dump.
Under snapshot driver n580, for an engine that can stop as a template: start -> template ->
CRIU dump (left running) -> /start -> ready -> validation, quiesce, export -> the engines end.
Restore: ports/pids free -> CRIU restore (stopped) -> CUDA restore (all restored, then all
unlocked) -> resume (arenas at the same addresses, or built afresh by a template; fresh
transport from the coordinator, hydration, zeroed KV) -> exact validation.
Every cross-unit step is a coordinator phase; any unit can fail the activation.

Why one ~760-line unit: capture, capture in place, restore and the lifecycle verbs are one
sequence of shared steps (engine control steps, export + release, dump, hydration bodies)
and coordinator phases; the steps are methods here so every operation uses the same ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common import fsutil, proctree
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError, UnitError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import atomic_write_json
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.progress import ProgressWriter
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import engine_control as ec
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.timing import SpanRecorder
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import (
    CONTROL_DIR,
    EVIDENCE_FILE,
    UnitSpec,
    huge_pages_wanted,
    new_evidence,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import (
    affinity,
    criu_images,
    placement,
    ports,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import criu as criu_mod
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import cuda_checkpoint as cuda_mod
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import files as files_mod
from ansible_collections.coldsnap.fleet.plugins.module_utils.process.gpu_memory import gpu_memory

from coldsnap_activation import keeper
from coldsnap_activation.engine_handle import EngineHandle
from coldsnap_activation.probes import DIFFERS as LOGPROBS_DIFFER
from coldsnap_activation.probes import (
    PortProbe,
    logprobs_digest,
    logprobs_verdict,
    numerics,
    numerics_digest,
    reply_digest,
    stream_completion,
    wait_http_ready,
)
from coldsnap_activation.sync import Phases

PREVIOUS_LOG_SUFFIX = ".previous"  # the evicted engine's log, kept beside the restored one's


def is_template(spec: UnitSpec) -> bool:
    """Snapshot driver n580 with an engine that can stop as a context-free template: the capture
    dumps the engine there (before CUDA, weights and transport), not after its start."""
    return (spec.driver or {}).get("id") == "n580" and bool((spec.launcher or {}).get("template"))


def _engine_env(spec: UnitSpec, worker: dict) -> dict[str, str]:
    env = {
        "PATH": ec.engine_search_path(spec.python),
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
    }
    env.update(spec.launcher.get("environment") or {})  # what the engine's integration needs (the registry)
    env.update(spec.unit.get("environment", {}))
    env.update(spec.transport_env)
    env.update({
        ec.ENV_RANK: str(worker["rank"]),
        ec.ENV_WORLD_SIZE: str(spec.world_size),
        ec.ENV_UNIT: spec.unit_id,
        ec.ENV_WORKER: worker["id"],
        ec.ENV_SCOPE: spec.operation_id,
        ec.ENV_STATE_ROOT: spec.state_root,
    })
    if spec.coordinator:
        env[ec.ENV_COORDINATOR] = spec.coordinator["endpoint_file"]
    if is_template(spec):
        env[ec.ENV_TEMPLATE] = "1"
    if "TORCHINDUCTOR_CACHE_DIR" not in env:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(_inductor_cache(env))
    devices = spec.unit.get("devices", [])
    if worker.get("device_slot") is not None and devices:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # ordinals as NVML and host_facts number them
        env["CUDA_VISIBLE_DEVICES"] = str(devices[worker["device_slot"]])
    elif not devices:
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
    return env


def _inductor_cache(env: dict[str, str]) -> Path:
    """TorchInductor's default cache (``<tmp>/torchinductor_<user>``), where an engine that compiles
    writes the code it then loads, made this user's own first: in ``/tmp`` another user could have
    made it before and would run code as this one."""
    tmp = env.get("TMPDIR") or ""
    if not os.path.isdir(tmp):
        tmp = "/tmp"  # where Python's tempfile (and so torch) falls back to
    try:
        user = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:  # a uid without a passwd entry (in a container)
        user = str(os.geteuid())
    return fsutil.own_directory(
        Path(tmp) / f"torchinductor_{user}", what="TorchInductor's cache directory",
        fix="remove it (a directory another user made), or set TORCHINDUCTOR_CACHE_DIR in the unit's environment "
            "to a directory of this user's")


def _fresh_log(log: Path) -> None:
    """An empty engine log for the restored tree (CRIU re-opens it where the capture left it: empty). The
    log of whatever ran there before (the workload this restore evicted: its last lines say why it was
    what it was) is kept beside it as ``<log>.previous``, replacing an older one."""
    with contextlib.suppress(FileNotFoundError):
        if log.stat().st_size:
            os.replace(log, log.with_name(log.name + PREVIOUS_LOG_SUFFIX))
    log.write_bytes(b"")


def gpu_placement(spec: UnitSpec, worker: dict) -> tuple[list[str], list[str]]:
    """UUIDs of the GPU(s) a worker of this unit uses (from the unit's device ordinals) and of
    every GPU of this host: CUDA restore pairs all of them once a worker moves."""
    host = cuda_mod.device_uuids()
    devices = spec.unit.get("devices", [])
    if worker.get("device_slot") is None or not devices:
        return [], host
    return [host[devices[worker["device_slot"]]]], host


def process_memory(pid: int) -> dict:
    """What a snapshot of ``pid``'s process tree is about to carry: anonymous RSS and GPU memory
    in use, summed over its processes (a multi-process engine holds CUDA in a child)."""
    out: dict = {}
    tree = ports.process_tree(pid)
    for member in sorted(tree):
        try:
            for line in Path(f"/proc/{member}/status").read_text().splitlines():
                if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                    key, value = line.split(":", 1)
                    out[key.lower() + "_kib"] = out.get(key.lower() + "_kib", 0) + int(value.split()[0])
        except OSError:
            pass
    for gpu in gpu_memory().values():  # nvidia-smi, as restore's admission reads it
        for holder, mib in gpu["apps"].items():
            if holder in tree:
                out["gpu_used_mib"] = out.get("gpu_used_mib", 0) + mib
    if len(tree) > 1:
        out["processes"] = len(tree)
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


# The control steps during which an engine hydrates its weights (progress is watched through /status).
HYDRATING_ROUTES = (ec.RESUME, ec.FINISH_WARM, ec.WAKE)


def watch_hydration(handles: list[EngineHandle], writer: ProgressWriter, *, interval: float = 0.5):
    """While a step hydrates: the engines' byte counts (``GET /status`` -> ``hydration``), summed, to
    ``writer`` every ``interval`` seconds. An engine that does not report them (captured before they
    existed) shows none. Returns the function that ends the watch (and writes the final record)."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(interval):
            counts = [(st or {}).get("hydration") for st in (h.peek_status() for h in handles)]
            known = [c for c in counts if isinstance(c, dict) and isinstance(c.get("total"), int)
                     and isinstance(c.get("done"), int)]
            if known:
                writer(sum(c["done"] for c in known), sum(c["total"] for c in known))

    thread = threading.Thread(target=watch, name="coldsnap-hydration-progress", daemon=True)
    thread.start()

    def end() -> None:
        stop.set()
        thread.join(timeout=5)
        if writer.writes:
            writer.done()
    return end


class Activation:
    """One unit's capture or restore run."""

    def __init__(self, spec: UnitSpec, keepers: list[keeper.Prestarted] | None = None) -> None:
        self.spec = spec
        self.keepers = list(keepers or [])  # restore: waiting keepers, one per worker
        self.t0 = spec.t0_ns or time.monotonic_ns()
        # Live progress: each step this unit starts (unit.criu.restore, unit.resume = hydration...).
        self.progress = ProgressWriter(spec.progress_dir, f"unit-{spec.unit_id}", phase=f"unit {spec.unit_id}",
                                       unit="steps")
        self.rec = SpanRecorder(f"unit:{spec.unit_id}", host=spec.host, unit=spec.unit_id,
                                sink=self._progress_step if self.progress.enabled else None)
        self.phases = Phases(spec.coordinator["endpoint_file"] if spec.coordinator else None,
                             rank=spec.index, world=spec.unit_count, unit=spec.unit_id)
        self.unit_dir = Path(spec.unit_dir)
        self.workload_dir = Path(spec.workload_dir)
        self.handles = [EngineHandle(unit=spec.unit_id, worker=w, workload_dir=self.workload_dir)
                        for w in spec.workers]
        self.readiness: dict | None = None
        self.reply: str | None = None
        # The validation's log-probabilities ({"top", "sha256", "numerics"}) and how they compared.
        self.logprobs: dict | None = None
        self.logprobs_check: str | None = None
        self.graphs: dict[str, dict | None] = {}  # per worker: what /release did with its graphs
        # What the engine's process tree needs from CRIU (the registry says; the evidence records it).
        self.criu_options = criu_mod.CriuOptions(link_remap=bool(spec.launcher.get("criu_link_remap")),
                                                 mount_namespace=bool(spec.launcher.get("private_shm")),
                                                 shm_archive=bool(spec.launcher.get("shm_archive")))

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
        top = val.get("logprobs") or 0
        with self.rec.span("unit.validate") as sp:
            try:
                done = stream_completion(svc["address"], svc["port"], model=val.get("model", ""),
                                         prompt=val["prompt"], max_tokens=val["max_tokens"],
                                         logprobs=top or None)
            except (OSError, RuntimeError, ValueError) as exc:
                raise self.handles[0].failure(f"validation request failed: {exc}") from None
            reply, first_ns = done.text, done.first_ns
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
        if top:
            self._check_logprobs(top, done.logprobs, val.get("expected_logprobs"))

    def _check_logprobs(self, top: int, tokens: list[dict], expected: dict | None) -> None:
        """Compare the reply's log-probabilities with the accepted ones, exactly, where the same
        numerics computed both (another CPU or GPU model, driver or CPU count may round differently:
        then only the reply is compared, and the evidence says so)."""
        with self.rec.span("unit.validate.logprobs"):
            gpu = any(h.pid is not None and cuda_mod.cuda_pids(h.pid) for h in self.handles)
            got = {"top": top, "sha256": logprobs_digest(tokens), "numerics": numerics_digest(numerics(gpu))}
        self.logprobs = got
        self.logprobs_check = logprobs_verdict(expected, got)
        if self.logprobs_check == LOGPROBS_DIFFER:
            raise UnitError(f"unit {self.spec.unit_id}: the validation reply is the accepted one, but its "
                            f"log-probabilities differ (top {top}: {got['sha256']}, accepted "
                            f"{expected['sha256']}) on the same hardware: the engine computes with other "
                            "weights or state than at capture",
                            fix="restore again with weights from recovery (policy.weights.mode recovery) or a "
                                "re-staged payload, or recapture; do not serve this restore")

    def _evidence(self, workers: list[dict], extra: dict | None = None) -> dict:
        return new_evidence(
            operation=self.spec.operation, operation_id=self.spec.operation_id, capture_id=self.spec.capture_id,
            unit=self.spec.unit_id, host=self.spec.host, workers=workers, readiness=self.readiness, reply=self.reply,
            reply_sha256=reply_digest(self.reply) if self.reply is not None else None,
            logprobs=self.logprobs, logprobs_check=self.logprobs_check,
            timing={"spans": self.rec.spans, "marks": self.rec.marks, "t0_ns": self.t0}, **(extra or {}))

    # ---------------------------------------------- steps shared by the operations
    def _engine_step(self, handles: list[EngineHandle], span: str, route: str, body=None) -> list[dict]:
        """One control step on every worker at once (collective engine steps need that); the
        engines' spans join the unit's timeline."""
        watch = self._watch_hydration(handles) if route in HYDRATING_ROUTES and self.progress.enabled else None
        try:
            with self.rec.span(span):
                replies = _parallel(handles, lambda h: h.call("POST", route, body(h) if callable(body) else body))
                for h, r in zip(handles, replies, strict=True):
                    _import_engine_spans(self.rec, r, h.worker["id"])
        finally:
            if watch is not None:
                watch()
        return replies

    def _watch_hydration(self, handles: list[EngineHandle]):
        """This unit's hydration bytes as live progress while the engines hydrate (see watch_hydration)."""
        return watch_hydration(handles, ProgressWriter(self.spec.progress_dir, f"hydrate-{self.spec.unit_id}",
                                                       phase=f"unit {self.spec.unit_id} hydration"))

    def _progress_step(self, event: dict) -> None:
        if event.get("event") == "span-start":
            self.progress.note(f"{self.spec.operation}: {event.get('name')}")

    def _export_progress_dir(self) -> str | None:
        """The engine writes export progress only below ``<state_root>/runs`` (it refuses other paths)."""
        runs = os.path.realpath(os.path.join(self.spec.state_root, ec.RUNS_DIR))
        wanted = self.spec.progress_dir
        if wanted and os.path.commonpath([os.path.realpath(wanted), runs]) == runs:
            return wanted
        return None

    def _validate_and_quiesce(self, probe: PortProbe | None) -> None:
        """A capture's validation (the accepted reply, shared with the other units) and quiesce."""
        spec = self.spec
        self._validate(probe, expected=(spec.validation or {}).get("expected"))
        self.phases.wait("capture/validated", spec.timeout("phase", 600))
        if self.reply is not None:
            self.phases.publish("capture/reply", self.reply.encode())
        self._engine_step(self.handles, "unit.quiesce", ec.QUIESCE)
        self.phases.wait("capture/quiesced", spec.timeout("phase", 600))

    def _export(self, handles: list[EngineHandle], *, export_pack: bool) -> dict:
        """/export every worker's payload into the unit directory (and the pack into the node cache)."""
        payloads = {}
        with self.rec.span("unit.export"):
            for h in handles:
                body = ec.ExportBody(out_dir=str(self.spec.worker_files(h.worker["id"]).directory),
                                     model=self.spec.model, export_pack=export_pack, state_root=self.spec.state_root,
                                     progress_dir=self._export_progress_dir())
                payloads[h.worker["id"]] = h.call("POST", ec.EXPORT, body.to_json())["payload"]
        return payloads

    def _export_and_release(self, handles: list[EngineHandle], *, export_pack: bool) -> dict:
        """/export every worker's payload, /release the weights, keep the engine log of the capture
        and start the workload log afresh (CRIU records its size)."""
        payloads = self._export(handles, export_pack=export_pack)
        graph_policy = (self.spec.driver or {}).get("graph_policy")
        with self.rec.span("unit.release"):
            for h in handles:
                reply = h.call("POST", ec.RELEASE, ec.ReleaseBody(graphs=graph_policy).to_json())
                self.graphs[h.worker["id"]] = reply.get("graphs")
            self._keep_capture_log(truncate=True)
        return payloads

    def _keep_capture_log(self, *, truncate: bool) -> None:
        """Append the workload log so far to the capture's ``logs/capture.log``; ``truncate``: start it
        afresh (before a dump: CRIU records its size, and a restore starts with an empty log)."""
        logs = self.unit_dir / "logs"
        logs.mkdir(exist_ok=True)
        with open(self.workload_dir / ec.LOG_FILE_NAME, "rb") as src, open(logs / "capture.log", "ab") as dst:
            shutil.copyfileobj(src, dst)
        if truncate:
            os.truncate(self.workload_dir / ec.LOG_FILE_NAME, 0)

    def _capture_template(self, criu, probe: PortProbe | None) -> list[dict]:
        """Snapshot driver n580: dump every worker while it waits as a template (no CUDA context, no
        weights, no transport: the image restores under any driver), leave it running, then let it
        start for real (``/start``: its cold start from the checkpoint), validate it and export its
        payload as any capture does. The engines end with the capture; the templates are the state."""
        spec = self.spec
        self._keep_capture_log(truncate=True)
        workers = []
        for h in self.handles:
            if self._cuda_pids(h):  # the engine broke the template contract: never dump CUDA state here
                raise UnitError(f"unit {spec.unit_id}: worker {h.worker['id']} holds a CUDA context at its "
                                "template boundary", fix="the engine must not initialise CUDA before /start")
            workers.append(self._dump(h, criu, cuda=[], memory=process_memory(h.pid), payload=None,
                                      leave_running=True))
        self.phases.wait("capture/template", spec.timeout("phase", 600))
        with self.rec.span("unit.engine.load"):
            self._engine_step(self.handles, "unit.engine.template.start", ec.START, {})
            for h in self.handles:
                h.wait_state((ec.READY,), spec.timeout("ready", 900))
        self._validate_and_quiesce(probe)
        payloads = self._export(self.handles, export_pack=bool(spec.weights.get("export_pack", True)))
        for w in workers:
            w["payload"] = payloads[w["worker"]]
        with self.rec.span("unit.engine.stop"):
            for h in self.handles:
                h.kill()
                h.reap(60)
            keeper.reap_orphans(10)
        self._keep_capture_log(truncate=False)
        self.phases.wait("capture/dumped", spec.timeout("phase", 600))
        return workers

    def _dump(self, h: EngineHandle, criu, *, cuda: list[int], memory: dict, payload: dict,
              leave_running: bool) -> dict:
        """CRIU-dump one worker's process tree (the CUDA state of ``cuda``, the processes of it that
        hold a context, already checkpointed) and describe it."""
        wid = h.worker["id"]
        # The whole tree (an engine may run several processes): CRIU restores every pid, thread id and
        # listener of it, so a restore must find all of them free.
        tids, listeners = ports.tree_tids(h.pid), ports.tree_listeners(h.pid)
        # The threads the engine pinned to CPUs (CRIU restores none of that): the restore pins them again.
        pins = affinity.capture(tids)
        # The files it maps or holds open: a restore host must have them (checked in prepare).
        used = files_mod.tree_files(h.pid)
        options = self.criu_options
        with self.rec.span("unit.criu.dump", worker=wid, **({"leave_running": True} if leave_running else {})) as sp:
            res = criu_mod.dump(criu, h.pid, self.unit_dir / "criu" / wid, leave_running=leave_running,
                                options=options)
            sp["attrs"]["bytes"] = res.bytes
        # What CRIU took is what it restores: a thread or child started since the look above needs its id too.
        tids = sorted(set(tids) | set(criu_images.tree_ids(Path(res.images_dir))))
        # Where the engine listened for control, never its token: a restore writes a fresh one.
        info = h.control_info()
        ctl_dir = self.unit_dir / CONTROL_DIR
        ctl_dir.mkdir(mode=0o700, exist_ok=True)
        # The control file's path is in the engine's environment: a restore must write the same one.
        atomic_write_json(ctl_dir / f"{wid}.json", {"port": info.port, "pid": info.pid,
                                                    "control_file": str(h.control_file)}, mode=0o600)
        gpu_uuids, host_gpus = gpu_placement(self.spec, h.worker) if cuda else ([], [])
        return {"worker": wid, "rank": h.worker["rank"], "pid": h.pid, "tids": tids,
                "gpu_uuids": gpu_uuids, "host_gpu_uuids": host_gpus,
                "listeners": [list(x) for x in listeners], "affinity": pins, "files": used, "cuda": bool(cuda),
                "cuda_pids": cuda,
                "memory_at_checkpoint": memory, "payload": payload, "graphs": self.graphs.get(wid),
                "criu": {"bytes": res.bytes, "dump_seconds": res.seconds, "options": options.to_json()}}

    def _hydration(self, h: EngineHandle, *, generation: str, provider: str, materialize: str,
                   warm: bool = False) -> dict:
        """The /resume (or /wake, /finish-warm) body of one worker."""
        spec = self.spec
        wid = h.worker["id"]
        w = spec.weights.get("workers", {}).get(wid, {})
        return ec.HydrationBody.for_worker(
            spec.worker_files(wid), provider=w.get("provider", provider), pack=w.get("pack"),
            model_dir=spec.weights.get("model_dir"), state_root=spec.state_root, materialize=materialize,
            warm=warm, operation_id=spec.operation_id, generation=generation, transport_env=spec.transport_env,
            coordinator_endpoint=spec.coordinator["endpoint_file"] if spec.coordinator else None).to_json()

    def _cuda_pids(self, h: EngineHandle) -> list[int]:
        """The processes of the worker's tree that hold a CUDA context (checkpointed with the CUDA
        driver before the dump: an API server may have none while its engine core has one);
        policy.process.backend 'criu' promises there are none."""
        used = cuda_mod.cuda_pids(h.pid)
        if used and (self.spec.driver or {}).get("backend") == "criu":
            raise UnitError(f"unit {self.spec.unit_id}: worker {h.worker['id']} holds a CUDA context, but "
                            "policy.process.backend is 'criu' (plain CRIU cannot dump it)",
                            fix="use backend 'cuda-criu' (snapshot driver n610), or keep CUDA out of the process")
        return used

    def _checkpoint_cuda(self, handles: list[EngineHandle]) -> dict[str, list[int]]:
        """Checkpoint the GPU state of every process of the unit that holds a CUDA context, all
        workers at once: every process is locked before any is checkpointed (a worker's engine
        core and its peers in the same unit alike), and a failure gives every one back its GPU
        state and lock. Returns the processes per worker."""
        used = {h.worker["id"]: self._cuda_pids(h) for h in handles}
        every = [pid for h in handles for pid in used[h.worker["id"]]]
        if every:
            cuda_mod.checkpoint_tree(every, lock_timeout_ms=int(self.spec.timeout("cuda_lock", 30) * 1000))
        return used

    def _restore_cuda(self, restored: list[tuple[EngineHandle, dict]]) -> None:
        """Restore the GPU state of every CUDA process of the unit, then unlock them all (no worker
        runs CUDA before every peer has its state back). One GPU map for the whole unit: the unit
        may run on other GPUs than at capture (placement), matched by UUID in worker order."""
        before: list[str] = []
        now: list[str] = []
        pids: list[int] = []
        host_before: list[str] | None = None
        host_now: list[str] = []
        for h, cw in restored:
            if not cw["cuda"]:
                continue
            used_now, host_now = gpu_placement(self.spec, h.worker)
            before += cw.get("gpu_uuids") or used_now
            now += used_now
            host_before = host_before or cw.get("host_gpu_uuids")
            pids += cw.get("cuda_pids") or [h.pid]
        if pids:
            cuda_mod.restore_tree(pids, remap=cuda_mod.restore_map(before, now, host_before, host_now))

    def _fail(self, exc: BaseException) -> None:
        self.phases.abort(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)

    # ------------------------------------------------------------- capture
    def capture(self) -> dict:
        spec = self.spec
        criu = criu_mod.find_criu(spec.criu_binary)
        self.unit_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.workload_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        (self.workload_dir / ec.LOG_FILE_NAME).write_bytes(b"")
        # The dump ends the engine's tree; its processes whose parent dies first come to us to be
        # reaped (a zombie would keep its pid from the restore), whoever this host's init is.
        keeper.become_subreaper()
        probe = None
        try:
            if spec.service:
                probe = PortProbe(spec.service["address"], spec.service["port"], self.t0).start()
            with self.rec.span("unit.engine.start"):
                for h in self.handles:
                    h.spawn(list(spec.unit["command"]), _engine_env(spec, h.worker),
                            private_shm=self.criu_options.mount_namespace)
                for h in self.handles:
                    h.wait_control(spec.timeout("start", 900))
                template = is_template(spec)
                for h in self.handles:
                    h.wait_state((ec.TEMPLATE,) if template else (ec.READY,), spec.timeout("ready", 900))
            workers = self._capture_template(criu, probe) if template else self._capture_started(criu, probe)
            _forget_controls(h.control_file for h in self.handles)  # the engines ended with the dump: stopped
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
            keeper.reap_orphans(5)
            _forget_controls(h.control_file for h in self.handles)  # status says stopped, not crashed
            raise
        finally:
            if probe is not None:
                probe.stop()

    def _capture_started(self, criu, probe: PortProbe | None) -> list[dict]:
        """Snapshot driver n610 (and n580 where the engine has no template): validate the started
        engine, export its payload, release its weights, checkpoint its CUDA state, dump it."""
        spec = self.spec
        self._validate_and_quiesce(probe)
        # What the engine holds serving (weights included): what a restore's host must have room for.
        serving = {h.worker["id"]: process_memory(h.pid) for h in self.handles}
        payloads = self._export_and_release(self.handles, export_pack=bool(spec.weights.get("export_pack", True)))
        self.phases.wait("capture/released", spec.timeout("phase", 600))
        memory = {h.worker["id"]: process_memory(h.pid) for h in self.handles}
        with self.rec.span("unit.cuda.checkpoint"):
            cuda_used = self._checkpoint_cuda(self.handles)
        self.phases.wait("capture/cuda", spec.timeout("phase", 600))
        workers = []
        for h in self.handles:
            wid = h.worker["id"]
            workers.append({**self._dump(h, criu, cuda=cuda_used[wid], memory=memory[wid], payload=payloads[wid],
                                         leave_running=False), "memory_serving": serving[wid]})
            h.reap(60)
        keeper.reap_orphans(10)  # an engine's own children (e.g. its engine core), dumped with it
        self.phases.wait("capture/dumped", spec.timeout("phase", 600))
        return workers

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
        states = [h.call("GET", ec.STATUS, timeout=30)["state"] for h in handles]
        if any(s != ec.READY for s in states):
            raise UnitError(f"unit {spec.unit_id}: engines are {states}; an overlay is captured from a ready engine",
                            fix="wake or restore the workload first")
        self.unit_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        expected = (spec.validation or {}).get("expected")
        try:
            self._validate(None, expected=expected)
            self.phases.wait("overlay/validated", spec.timeout("phase", 600))
            self._engine_step(handles, "unit.quiesce", ec.QUIESCE)
            self.phases.wait("overlay/quiesced", spec.timeout("phase", 600))
            serving = {h.worker["id"]: process_memory(h.pid) for h in handles}  # as at capture (_capture_started)
            payloads = self._export_and_release(handles, export_pack=True)
            self.phases.wait("overlay/released", spec.timeout("phase", 600))
            memory = {h.worker["id"]: process_memory(h.pid) for h in handles}
            cuda = self._checkpoint_cuda(handles)
            workers = []
            unretired: list[str] = []
            try:
                for h in handles:
                    wid = h.worker["id"]
                    workers.append({**self._dump(h, criu, cuda=cuda[wid], memory=memory[wid], payload=payloads[wid],
                                                 leave_running=True), "memory_serving": serving[wid]})
            finally:
                every = [pid for h in handles for pid in cuda[h.worker["id"]]]
                try:
                    if every:  # the engines keep running: their GPU state comes back in place, first
                        cuda_mod.restore_tree(every)
                finally:
                    # The dump wrote each engine's live control token into the images (and so the capsule):
                    # the engines are told a new one, so the captured one opens nothing.
                    unretired = self._rotate_tokens(handles)
            if unretired:
                raise UnitError(f"unit {spec.unit_id}: the control token the dump captured could not be retired "
                                f"({'; '.join(unretired)}); the overlay is not kept",
                                fix="free space in the state root, then capture the overlay again")
            self.phases.wait("overlay/dumped", spec.timeout("phase", 600))
            generation = f"{spec.operation_id}.overlay"
            self._engine_step(handles, "unit.resume", ec.RESUME,
                              lambda h: self._hydration(h, generation=generation, provider="native", materialize="off"))
            self.phases.wait("overlay/resumed", spec.timeout("phase", 600))
            self._validate(None, expected=expected)
            self.phases.wait("overlay/validated-again", spec.timeout("phase", 600))
            ev = self._evidence(workers, {"criu_version": criu.version, "acceptance_reply": self.reply,
                                          "in_place": True})
            atomic_write_json(self.unit_dir / EVIDENCE_FILE, ev)
            return ev
        except BaseException as exc:
            self._fail(exc)
            outcome = self._give_back(handles, generation=f"{spec.operation_id}.overlay")
            if outcome and isinstance(exc, ColdSnapError):
                raise UnitError(f"{exc.problem} ({outcome})", fix=exc.fix, details=exc.details) from exc
            if outcome and isinstance(exc, Exception):
                raise UnitError(f"{type(exc).__name__}: {exc} ({outcome})") from exc
            raise

    @staticmethod
    def _rotate_tokens(handles: list[EngineHandle]) -> list[str]:
        """A fresh bearer token in every running engine's control file (the engine re-reads the file on
        its next request); the handles use it from now on. Never raises: returns what failed, per worker
        (that worker keeps its token)."""
        failed = []
        for h in handles:
            try:
                info = h.control_info()
                fresh = ec.ControlInfo(port=info.port, token=secrets.token_hex(32), pid=info.pid)
                atomic_write_json(h.control_file, fresh.to_json(), mode=0o600)
            except (OSError, ValueError) as exc:
                failed.append(f"worker {h.worker['id']}: {exc}")
                continue
            h.adopt(info.pid, fresh)
        return failed

    def _give_back(self, handles: list[EngineHandle], *, generation: str) -> str:
        """After an in-place capture failed: bring every engine it had quiesced or released back to
        serving (the workload must not be lost to a failed overlay). Returns what happened, for the error."""
        try:
            states = [h.call("GET", ec.STATUS, timeout=30)["state"] for h in handles]
        except Exception as exc:  # the engine itself is gone or unreachable: nothing to give back
            return f"its engine could not be asked for its state: {exc}"
        stopped = [h for h, st in zip(handles, states, strict=True) if st in (ec.QUIESCED, ec.RELEASED)]
        if not stopped:
            return ""
        try:
            self._engine_step(stopped, "unit.give-back", ec.RESUME,
                              lambda h: self._hydration(h, generation=generation, provider="native",
                                                        materialize="off"))
        except Exception as exc:
            return f"giving the engine back failed too ({exc}): restore the workload"
        return "the engine was given back and serves again"

    # ------------------------------------------------------------- restore
    def restore(self) -> dict:
        spec = self.spec
        captured = json.loads((self.unit_dir / EVIDENCE_FILE).read_text())
        by_worker = {w["worker"]: w for w in captured["workers"]}
        if any(w.get("cuda") for w in captured["workers"]):
            cuda_mod.preload()  # the driver's start-up overlaps the CRIU restore
        criu = criu_mod.find_criu(spec.criu_binary)
        huge = huge_pages_wanted(spec.unit.get("environment"), default=criu_mod.huge_pages_by_default())
        moved = placement.Placement.from_json(spec.placement)
        restored: list[EngineHandle] = []
        served: list[dict] = []
        written: list[Path] = []  # control files this restore wrote (never another workload's)
        parents: list[keeper.Prestarted] = []  # the keepers that parent the restored trees
        probe = None
        try:
            listeners: dict[str, list] = {}
            with self.rec.span("unit.admission"):
                for h in self.handles:
                    cw = by_worker[h.worker["id"]]
                    listeners[h.worker["id"]] = moved.listeners([(str(a), int(p)) for a, p in cw["listeners"]],
                                                                unit=spec.unit_id)
                    ports.require_ports_free(listeners[h.worker["id"]], unit=spec.unit_id)
                    ports.require_pids_free([cw["pid"], *cw["tids"]], unit=spec.unit_id)
                    affinity.records(cw.get("affinity"), where=f"unit {spec.unit_id} {h.worker['id']} affinity")
            self.workload_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            _fresh_log(self.workload_dir / ec.LOG_FILE_NAME)
            if spec.service:
                probe = PortProbe(spec.service["address"], spec.service["port"], self.t0).start()
            with self.rec.span("unit.criu.restore", huge_pages=huge) as sp:
                pinned = affinity.Applied()
                for h in self.handles:
                    wid = h.worker["id"]
                    cw = by_worker[wid]
                    # A fresh token, written before the process exists: the one in its memory (and in
                    # the capsule) opens nothing.
                    captured_ctl = json.loads((self.unit_dir / CONTROL_DIR / f"{wid}.json").read_text())
                    _addr, control_port = moved.apply(ec.CONTROL_HOST, int(captured_ctl["port"]), unit=spec.unit_id)
                    control = ec.ControlInfo(port=control_port, token=secrets.token_hex(32),
                                             pid=int(captured_ctl["pid"]))
                    atomic_write_json(h.control_file, control.to_json(), mode=0o600)
                    written.append(h.control_file)
                    work = self.workload_dir / f"criu-{wid}"
                    # Another serving port or address than at capture: CRIU restores a rebound copy of
                    # the images (the captured ones are never edited).
                    images, rebound = placement.rebind(self.unit_dir / "criu" / wid, work / "placed", moved,
                                                       unit=spec.unit_id)
                    served += [{"worker": wid, **m} for m in rebound]
                    options = criu_mod.CriuOptions.from_json((cw.get("criu") or {}).get("options"))
                    if spec.supervise:  # we are the container's PID 1: the tree becomes our child
                        try:
                            pid = criu_mod.restore(criu, images, work_dir=work, leave_stopped=True, sibling=True,
                                                   options=options, huge_pages=huge).pid
                        except ColdSnapError as exc:
                            _port_taken_since_admission(exc.problem, listeners[wid], spec.unit_id)
                            raise
                    else:
                        parents.append(self.keepers.pop(0) if self.keepers else keeper.Prestarted(criu.binary))
                        kept = parents[-1].go(images, work_dir=work, leave_stopped=True,
                                              log_path=self.workload_dir / "keeper.log", options=options.to_json(),
                                              huge_pages=huge)
                        if not kept["ok"]:
                            # What the keeper's CRIU got as far as restoring (stopped, at the captured pid, with
                            # this worker's control file in its environment) goes too.
                            _end_leftover(int(cw["pid"]), h.control_file)
                            _port_taken_since_admission(kept["error"], listeners[wid], spec.unit_id)
                            raise UnitError(f"unit {spec.unit_id}: {kept['error']}")
                        pid = kept["pid"]
                    h.adopt(pid, control, exit_record=None if spec.supervise else keeper.exit_record(work))
                    restored.append(h)
                    if pid != cw["pid"]:
                        raise UnitError(f"unit {spec.unit_id}: CRIU restored pid {pid}, captured {cw['pid']}")
                    # Still stopped: its pinned threads get their CPUs back before they run.
                    pinned += affinity.apply(cw.get("affinity"), tree=pid, where=f"unit {spec.unit_id} {wid} affinity")
                sp["attrs"]["affinity"] = pinned.to_json()
            self.phases.wait("restore/criu", spec.timeout("phase", 600))
            with self.rec.span("unit.cuda.restore"):
                for h in self.handles:
                    h.note_tree()
                    for pid in sorted(ports.process_tree(h.pid)):  # CRIU left the whole tree stopped
                        try:
                            os.kill(pid, signal.SIGCONT)
                        except ProcessLookupError:
                            if pid == h.pid or not h.alive():  # a thread or child that ended meanwhile is no news
                                raise h.failure(f"the engine (pid {h.pid}) died right after CRIU restored it") \
                                    from None
                self._restore_cuda([(h, by_worker[h.worker["id"]]) for h in self.handles])
            self.phases.wait("restore/released", spec.timeout("phase", 600))
            self._engine_step(self.handles, "unit.resume", ec.RESUME, lambda h: self._hydration(
                h, generation=spec.operation_id, provider=spec.weights.get("provider", "recovery"),
                materialize=spec.weights.get("materialize", "off"), warm=spec.warm))
            self.phases.wait("restore/resumed", spec.timeout("phase", 600))
            if not spec.warm:
                self._validate(probe, expected=(spec.validation or {}).get("expected"))
                self.phases.wait("restore/validated", spec.timeout("phase", 600))
            workers = [{"worker": h.worker["id"], "rank": h.worker["rank"], "pid": h.pid} for h in self.handles]
            extra: dict = {"warm": spec.warm, "listeners_moved": served}
            if spec.service:
                extra["served"] = {"address": spec.service["address"], "port": spec.service["port"]}
            return self._evidence(workers, extra)
        except BaseException as exc:
            self._fail(exc)
            for h in restored:  # never leave a half-restored process tree behind
                h.kill()
            # gone once its keeper has ended and reaped every process of it (a root that died first left the
            # rest to its keeper), so a retry finds the pids free; one deadline for all of them
            deadline = time.monotonic() + 30
            for k in parents:
                k.wait_ended(max(0.1, deadline - time.monotonic()))
            _forget_controls(written)  # nor a control file of an engine that is not there (status: crashed)
            raise
        finally:
            if probe is not None:
                probe.stop()

    # ----------------------------------------------------------- lifecycle
    def _running_handles(self) -> list[EngineHandle]:
        for h in self.handles:
            info = ec.ControlInfo.load(h.control_file)
            h.adopt(info.pid, info)
            if not h.alive():
                raise UnitError(f"unit {self.spec.unit_id}: worker {h.worker['id']} (pid {info.pid}) is not running",
                                fix="restore the workload first")
        return self.handles

    def lifecycle(self, action: str) -> dict:
        """status / sleep / wake / finish-warm of a running unit (convergent)."""
        spec = self.spec
        try:
            handles = self._running_handles()
        except FileNotFoundError:
            if action != "status":  # nothing to sleep or wake: stopped, or never restored on this host
                raise UnitError(f"unit {spec.unit_id}: no worker is running (the workload was stopped, or never "
                                f"restored here), so it cannot {action}",
                                fix="restore the workload first (coldsnap restore), then sleep or wake it") from None
            return self._evidence([], {"state": "absent"})
        states = [h.call("GET", ec.STATUS, timeout=30)["state"] for h in handles]
        changed = False
        if action != "status":
            ec.require_step_states(spec.unit_id, action, states)
        if action == "sleep" and any(s == ec.READY for s in states):
            self._engine_step(handles, "unit.sleep", ec.SLEEP)
            changed = True
        elif action in ("wake", "finish-warm") and any(s in (ec.SLEEPING, ec.WARM) for s in states):
            self._require_serving_port(handles)
            path = ec.WAKE if ec.SLEEPING in states else ec.FINISH_WARM
            provider = spec.weights.get("provider", "recovery")
            self._engine_step(handles, f"unit.{action}", path, lambda h: self._hydration(
                h, generation=spec.operation_id, provider=provider,
                materialize=spec.weights.get("materialize", "off")))
            if spec.service and spec.validation:
                self._validate(None, expected=spec.validation.get("expected"))
            changed = True
        final = [h.call("GET", ec.STATUS, timeout=30)["state"] for h in handles]
        return self._evidence([{"worker": h.worker["id"], "pid": h.pid, "state": s}
                               for h, s in zip(handles, final, strict=True)],
                              {"state": final[0] if len(set(final)) == 1 else "mixed", "changed": changed})

    def _require_serving_port(self, handles: list) -> None:
        """A wake checks readiness on the request's service port: one the engine does not listen on (a
        restore moved it to another) would be waited on until the ready timeout. Refused at once instead."""
        svc = self.spec.service
        if not svc:
            return
        # From the process the launcher started: an engine whose control API lives in an engine-core child
        # listens for requests in its parent (the API server).
        roots = {proctree.marked_root(h.pid, ec.ENV_CONTROL_FILE) for h in handles}
        listening = sorted({port for root in roots for _addr, port in ports.tree_listeners(root)})
        if listening and svc["port"] not in listening:
            raise UnitError(f"unit {self.spec.unit_id}: the engine does not listen on port {svc['port']} "
                            f"(the request's services[].port); it listens on {', '.join(map(str, listening))}",
                            fix="name the port the workload was restored onto in launch.execution.services[].port "
                                "(and the command's port option)")

    def supervise(self) -> int:
        """Stay as the unit's supervisor (container PID 1) until the engine exits."""
        while any(h.alive() for h in self.handles):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(-1, os.WNOHANG)
            time.sleep(0.5)
        return 0


def _port_taken_since_admission(error: str, listeners: list, unit: str) -> None:
    """CRIU could not bind a listener that was free at admission: someone took the port in between (a
    supervisor restarting the evicted server, say). Raise an error that names the port and its holder
    instead of CRIU's socket id; return when the error is something else. (What was evicted, and that it
    is not running, the restore step that knows it adds: units/restore.py.)"""
    if "Address already in use" not in error:
        return
    ports.require_ports_free(listeners, unit=unit, time_wait_grace=0.0, connection_grace=0.0, what="listening port",
                             fix="stop what took the port since the restore began (a supervisor restarting the "
                                 "replaced server?) and restore again, or restore onto another port")
    raise UnitError(f"unit {unit}: a listening port was taken after admission, before CRIU could restore it ({error})",
                    fix="find what binds the unit's ports and restore again")


def _forget_controls(paths) -> None:
    """Remove the control files of engines that ended (a control file without its engine reads as a
    crash to ``status``)."""
    for path in paths:
        with contextlib.suppress(OSError):
            Path(path).unlink(missing_ok=True)


def _end_leftover(pid: int, control_file: Path) -> None:
    """Kill the process tree at ``pid`` when it is this worker's engine (its environment names
    ``control_file``): a restore cut short must not leave it holding the captured pids and ports."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.process.engine_client import started_for

    if not started_for(pid, control_file):
        return
    for p in sorted(ports.process_tree(pid)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def _stop_on_sigterm(signum: int, _frame) -> None:
    """The controller's time limit ran out (or the operator stopped the play): end like a failure, so
    the clean-up runs (no half-restored tree stays) and the evidence says why."""
    raise UnitError(f"the activation runtime was stopped (signal {signum}): the operation ran past its time limit "
                    "or was cancelled", fix="see the unit's log for the step it was in; raise the timeouts if it "
                                            "was only slow")


def main_run(spec: UnitSpec, evidence_out: Path | None, keepers: list[keeper.Prestarted] | None = None) -> int:
    """Run the spec's operation, write evidence (or the error) as JSON, return the exit status.
    ``keepers``: started ahead for a restore; those it did not use are told to exit (they also
    exit when this process does: their end of input)."""
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    act = Activation(spec, keepers)
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
    for k in act.keepers:
        k.cancel()
    if evidence_out is not None:
        atomic_write_json(evidence_out, ev)
    else:
        json.dump(ev, sys.stdout)
        sys.stdout.write("\n")
    if code == 0 and spec.supervise and spec.operation in ("restore", "warm"):
        sys.stdout.flush()
        return act.supervise()
    return code
