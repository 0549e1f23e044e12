"""Restore admission: can this host run that captured unit? Decided before eviction.

Placement (hostname, IPs, GPU UUIDs/ordinals, mount sources, transport env) may
change; process architecture, GPU model, compute capability, GPU count, CRIU,
the snapshot driver's minimum and (by default) the captured driver floor may not.
The kernel release is provenance: ``criu check`` decides, unless policy says exact.
"""

from __future__ import annotations

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import AdmissionError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.drivers import (
    SNAPSHOT_DRIVERS,
    admit_driver,
    nvidia_version,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import criu as criu_mod


def with_criu_check(facts: dict) -> dict:
    """``facts`` with a ``criu check`` result: facts gathered without one (``coldsnap_host_check_criu:
    false``, a quick inventory) get it run now, on this host, so that admission never admits a kernel
    it has not checked."""
    crit = facts.get("criu") or {}
    if not crit.get("installed") or crit.get("check") is not None:
        return facts
    res = criu_mod.criu_check(criu_mod.find_criu(crit.get("binary")))
    return {**facts, "criu": {**crit, "check": res.ok, "check_output": res.output[-2000:]}}


def admit_unit(*, artifact: dict, unit_id: str, facts: dict, devices: list[int], host: str,
               policy: dict | None = None) -> dict:
    """Return the admission record for one unit on one host, or raise AdmissionError.

    ``policy`` is the restore request's ``policy.compatibility`` (the operator decides at restore
    time); without one, the capture's applies.
    """
    platform = next(p for p in artifact["compatibility"]["units"] if p["unit"] == unit_id)
    policy = {**artifact["policy"]["compatibility"], **(policy or {})}
    where = f"unit {unit_id} on {host}"
    if facts["arch"] != platform["arch"]:
        raise AdmissionError(f"{where}: CPU architecture {facts['arch']} differs from the capture's {platform['arch']}",
                             fix="restore onto a host with the captured architecture")
    crit = facts.get("criu", {})
    if not crit.get("installed"):
        raise AdmissionError(f"{where}: CRIU is not installed", fix="run scripts/install-system.sh on the host")
    if crit.get("check") is not True:
        raise AdmissionError(f"{where}: 'criu check' fails: {(crit.get('check_output') or '')[-300:]}",
                             fix="use a kernel with the features CRIU needs, or another host")
    if artifact["runtime"]["kind"] == "host" and crit.get("version") != platform["criu_version"]:
        raise AdmissionError(f"{where}: CRIU {crit.get('version')} differs from the captured {platform['criu_version']}",
                             fix="install the captured CRIU version (runtime 'host' pins it with the environment)")
    if policy["kernel"] == "exact" and facts["kernel"] != platform["kernel"]:
        raise AdmissionError(f"{where}: kernel {facts['kernel']} differs from the captured {platform['kernel']} "
                             "and policy.compatibility.kernel is 'exact'",
                             fix="restore on the captured kernel, or set policy.compatibility.kernel to 'capability'")
    captured_gpus = platform.get("gpus", [])
    record = {"unit": unit_id, "host": host, "arch": facts["arch"], "kernel": facts["kernel"], "row": None}
    if captured_gpus:
        host_gpus = {g["index"]: g for g in facts.get("gpus", [])}
        if len(devices) != len(captured_gpus):
            raise AdmissionError(f"{where}: {len(devices)} GPU(s) assigned, the capture used {len(captured_gpus)}",
                                 fix="assign as many devices as the captured unit had")
        for slot, (ordinal, cap) in enumerate(zip(devices, captured_gpus, strict=True)):
            g = host_gpus.get(ordinal)
            if g is None:
                raise AdmissionError(f"{where}: GPU ordinal {ordinal} (slot {slot}) does not exist on the host",
                                     fix="use device ordinals the host has")
            if g["model"] != cap["model"]:
                raise AdmissionError(f"{where}: GPU {ordinal} is {g['model']}, the capture ran on {cap['model']}",
                                     fix="restore onto the captured GPU model")
            if g["compute_capability"] != cap["compute_capability"]:
                raise AdmissionError(f"{where}: GPU {ordinal} has compute capability {g['compute_capability']}, "
                                     f"the capture {cap['compute_capability']}", fix="restore onto the captured GPU model")
        driver = facts.get("nvidia_driver")
        floor = artifact["snapshot_driver"].get("captured_nvidia_driver")
        if (policy["enforce_captured_driver_floor"] and floor and driver
                and nvidia_version(driver) < nvidia_version(floor)):
            raise AdmissionError(f"{where}: NVIDIA driver {driver} is older than the captured floor {floor}",
                                 fix="upgrade the driver, or set policy.compatibility.enforce_captured_driver_floor "
                                     "to false (the snapshot driver's own minimum still applies)")
        workers = [w for w in artifact["launch"]["execution"]["workers"] if w["unit"] == unit_id]
        try:
            adm = admit_driver(artifact["snapshot_driver"]["id"], nvidia_driver=driver,
                               gpu_workers_per_unit=len(workers))
        except AdmissionError as exc:
            # The snapshot driver is the artifact's now: the way out is this host's driver, or a new capture.
            raise AdmissionError(f"{where}: {exc.problem}",
                                 fix="upgrade this host's NVIDIA driver, or restore onto a GPU host the snapshot "
                                     "driver admits; the snapshot driver is the artifact's, another one needs a new "
                                     "capture") from None
        record["row"] = adm.row
        record["nvidia_driver"] = driver
    else:
        record["row"] = f"{artifact['snapshot_driver']['id']}-cpu"
    record["snapshot_driver"] = SNAPSHOT_DRIVERS[artifact["snapshot_driver"]["id"]].id
    return record


class GpuRoom:
    """GPU memory a host's units need, per GPU, against what the GPUs can give them.

    ``add`` each unit of the host with its capture evidence, then ``admit``: every GPU must have room for
    what the workers placed on it held serving at capture (the evidence's ``memory_serving.gpu_used_mib``,
    measured after quiesce and before the weights were released; an older capture's
    ``memory_at_checkpoint``, a lower bound), summed over the host's units: the memory free on it now plus
    what the workload being replaced holds there (the eviction frees it). Otherwise the CUDA restore or
    the weights' re-creation would fail after the eviction: refused, naming the GPU, the figures and who else
    holds its memory. A worker is placed through its ``device_slot`` in the unit's devices; one without a
    slot is counted against all of its unit's GPUs together. ``memory``: this host's
    :func:`~.host_facts.gpu_memory` (None or {}: not known, nothing checked); GPUs that report no free
    figure (unified memory) are not judged."""

    def __init__(self, artifact: dict, memory: dict[int, dict] | None) -> None:
        self.slots = {w["id"]: w.get("device_slot") for w in artifact["launch"]["execution"]["workers"]}
        self.memory = memory or {}
        self.needs: dict[tuple[int, ...], int] = {}  # GPUs (one, or a unit's together) -> MiB needed there

    def add(self, unit: dict, captured: dict) -> None:
        devices = list(unit.get("devices") or [])
        for w in captured.get("workers", []):
            if not w.get("cuda"):
                continue
            mib = max(int((w.get(k) or {}).get("gpu_used_mib") or 0) for k in ("memory_serving", "memory_at_checkpoint"))
            slot = self.slots.get(w.get("worker"))
            where = (devices[slot],) if isinstance(slot, int) and 0 <= slot < len(devices) else tuple(devices)
            if mib and where:
                self.needs[where] = self.needs.get(where, 0) + mib

    def admit(self, host: str, *, replaced: set[int]) -> list[dict]:
        """Refuse a GPU without room (class doc); ``replaced``: every pid the eviction ends on this host.
        Returns the figures checked, one entry per GPU (or group of GPUs)."""
        checked = []
        for gpus, needed in sorted(self.needs.items()):
            if any(g not in self.memory for g in gpus):
                continue
            free = sum(self.memory[g]["free_mib"] for g in gpus)
            freed = sum(mib for g in gpus for pid, mib in self.memory[g]["apps"].items() if pid in replaced)
            checked.append({"gpus": list(gpus), "needed_mib": needed, "free_mib": free, "freed_by_eviction_mib": freed})
            if needed <= free + freed:
                continue
            others = sorted({(pid, mib) for g in gpus for pid, mib in self.memory[g]["apps"].items()
                             if pid not in replaced}, key=lambda x: -x[1])
            holders = ", ".join(f"pid {pid} ({mib} MiB)" for pid, mib in others[:8]) or "nobody nvidia-smi lists"
            plural = len(gpus) > 1
            raise AdmissionError(
                f"{host}: GPU{'s' if plural else ''} {', '.join(map(str, gpus))} {'have' if plural else 'has'} {free} "
                f"MiB free ({freed} MiB more once the workload being replaced is evicted); the workers restored "
                f"there held {needed} MiB of GPU memory serving at capture, so the restore would fail after the "
                f"eviction; nothing was evicted. Other users of that memory: {holders}",
                fix="free that GPU memory (stop those processes), or restore onto other GPUs (launch.units[].devices) "
                    "or another host")
        return checked


# NCCL's intra-node transports (P2P over NVLink/PCIe, SHM through host memory) fail after the
# CUDA driver restored a rank onto another GPU than it was checkpointed on: the process
# still reports its captured GPU (PCI bus id) while its memory lives on the new one, and
# NCCL's first collective fails with "invalid device ordinal". Measured on two H200s
# (driver 580, NCCL 2.28) without CRIU in bench/gpu_nccl_swap.py; the socket transport works.
NCCL_SOCKETS_ONLY = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}


class GpuMoves:
    """Tensor-parallel GPU workers of one host, and those that would run on another GPU than at capture.

    ``add`` each unit of the host with its capture evidence, then ``admit``: moving tensor-
    parallel GPU ranks that share a host onto other GPUs is refused unless NCCL runs on sockets.
    """

    def __init__(self, artifact: dict, facts: dict) -> None:
        execution = artifact["launch"]["execution"]
        tensor = {w for g in execution.get("groups", []) if g["kind"] == "tensor" and len(g["workers"]) > 1
                  for w in g["workers"]}
        self.slots = {w["id"]: w.get("device_slot") for w in execution["workers"] if w["id"] in tensor}
        self.uuids = {g["index"]: g.get("uuid") for g in facts.get("gpus", [])}
        self.moves: list[tuple[str, str, str]] = []
        self.ranks = 0
        self.environments: list[dict] = []

    def add(self, unit: dict, evidence: dict, captured_unit: dict) -> None:
        for w in evidence["workers"]:
            slot = self.slots.get(w["worker"])
            if not (w.get("cuda") and w.get("gpu_uuids")) or slot is None or slot >= len(unit["devices"]):
                continue
            self.ranks += 1
            self.environments.append(captured_unit.get("environment", {}))
            now = self.uuids.get(unit["devices"][slot])
            if now and now != w["gpu_uuids"][0]:
                self.moves.append((w["worker"], w["gpu_uuids"][0], now))

    def admit(self, host: str) -> None:
        """Refuse the moves unless they are safe: fewer than two GPU ranks on this host, or NCCL
        on sockets in every captured environment (NCCL reads its settings once per process)."""
        if not self.moves or self.ranks < 2:
            return
        if all(all(env.get(k) == v for k, v in NCCL_SOCKETS_ONLY.items()) for env in self.environments):
            return
        what = ", ".join(f"{w} ({a} -> {b})" for w, a, b in self.moves)
        raise AdmissionError(
            f"{host}: {self.ranks} tensor-parallel ranks share this host and {what} would run on another GPU "
            "than at capture; NCCL's intra-node transports (P2P, SHM) fail after such a move",
            fix="restore each rank onto the GPU it was captured on (same device ordinals, same host), or capture "
                "with NCCL_P2P_DISABLE=1 and NCCL_SHM_DISABLE=1 in every unit's environment (tensor-parallel "
                "traffic then goes over sockets)")


def admit_capture(request: dict, *, host: str, units: list[dict], nvidia_driver: str | None) -> list[str]:
    """The snapshot driver's contract for the units of ``request`` this host captures, checked before
    anything runs or is dumped: the contract rows that admit them; AdmissionError naming the unit otherwise."""
    driver_id = request["snapshot_driver"]["id"]
    rows = []
    for unit in units:
        workers = [w for w in request["launch"]["execution"]["workers"] if w["unit"] == unit["id"]]
        gpu_workers = len(workers) if unit["devices"] else 0
        try:
            rows.append(admit_driver(driver_id, nvidia_driver=nvidia_driver, gpu_workers_per_unit=gpu_workers).row)
        except AdmissionError as exc:
            raise AdmissionError(f"unit {unit['id']} on {host}: {exc.problem}", fix=exc.fix) from None
    return rows


def choose_snapshot_driver(candidates: list[str], request: dict, facts: dict[str, dict]) -> dict:
    """The newest of ``candidates`` (the drivers the request is valid under, newest first) whose contract
    admits every unit on the facts of its host; the record of the choice, or AdmissionError naming why each
    driver was refused. ``facts`` maps each unit host to its host facts (only GPU units need any)."""
    launch = request["launch"]
    hosts = {u["host"]: (facts.get(u["host"]) or {}).get("nvidia_driver") for u in launch["units"] if u["devices"]}
    refused: dict[str, str] = {}
    for driver_id in candidates:
        try:
            rows = sorted({row for u in launch["units"]
                           for row in admit_capture({**request, "snapshot_driver": {"id": driver_id}}, host=u["host"],
                                                    units=[u], nvidia_driver=hosts.get(u["host"]))})
        except AdmissionError as exc:
            refused[driver_id] = exc.problem
            continue
        return {"id": driver_id, "chosen_by": "host facts" if hosts else "no GPU unit: the newest driver",
                "rows": rows, "nvidia_drivers": hosts, "refused": refused}
    raise AdmissionError(
        "no snapshot driver admits every unit of this request: "
        + "; ".join(f"{d}: {why}" for d, why in refused.items()),
        fix="upgrade the NVIDIA driver of the named hosts, place the units on other hosts, or name "
            "snapshot_driver.id to get that driver's own refusal")
