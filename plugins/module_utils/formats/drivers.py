"""Snapshot process drivers (n580, n610) as data: one contract table, no scattered ifs.

A contract row states the minimum NVIDIA driver, whether CUDA state is captured,
which restore boundaries exist, the driver-owned policy defaults, and the
qualified exceptions (a lower floor admitted under stated conditions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import AdmissionError


@dataclass(frozen=True)
class QualifiedException:
    """A documented admission below the driver's general minimum."""

    row: str
    min_nvidia_driver: int
    max_workers_per_unit: int
    condition: str
    qualified_on: str


@dataclass(frozen=True)
class DriverContract:
    """One snapshot process driver."""

    id: str
    abi: int
    min_nvidia_driver: int
    captures_cuda_state: bool
    warm_restore: bool
    description: str
    policy_defaults: dict = field(default_factory=dict)
    exceptions: tuple[QualifiedException, ...] = ()
    qualified: tuple[str, ...] = ()

    def as_capability(self) -> dict:
        return {
            "id": self.id,
            "abi": self.abi,
            "min_nvidia_driver": self.min_nvidia_driver,
            "captures_cuda_state": self.captures_cuda_state,
            "warm_restore": self.warm_restore,
            "qualified": list(self.qualified),
            "exceptions": [
                {"row": e.row, "min_nvidia_driver": e.min_nvidia_driver, "condition": e.condition,
                 "qualified_on": e.qualified_on}
                for e in self.exceptions
            ],
        }


SNAPSHOT_DRIVERS: dict[str, DriverContract] = {
    "n610": DriverContract(
        id="n610",
        abi=1,
        min_nvidia_driver=610,
        captures_cuda_state=True,
        warm_restore=True,
        description="initialized process state: CUDA checkpoint + CRIU; graphs kept; fastest, driver-specific",
        policy_defaults={
            "process": {"backend": "cuda-criu", "kv_discard": True, "graph_policy": "preserve",
                        "artifact_scope": "portable"},
            "weights": {"mode": "auto"},
        },
        exceptions=(
            QualifiedException(
                row="n610-single-process-r580",
                min_nvidia_driver=580,
                max_workers_per_unit=1,
                condition="one GPU worker per launch unit and no live NCCL communicator at checkpoint",
                qualified_on="NVIDIA H200, driver 580.159",
            ),
        ),
        qualified=("cpu: reference engine, CRIU 4.1.1", "gpu: reference engine, H200, driver 580.159"),
    ),
    "n580": DriverContract(
        id="n580",
        abi=1,
        min_nvidia_driver=580,
        captures_cuda_state=False,
        warm_restore=False,
        description="context-free pre-exec template: no CUDA context or sockets captured; portable across drivers",
        policy_defaults={
            "process": {"backend": "criu", "kv_discard": True, "graph_policy": "recreate-from-plan",
                        "artifact_scope": "portable"},
            "weights": {"mode": "auto"},
        },
        qualified=("cpu: reference engine, CRIU 4.1.1",
                   "gpu: reference engine (context-free template), H200, driver 580.159"),
    ),
}


def contract_rows(driver_id: str) -> tuple[str, ...]:
    """The contract rows that can admit a host for ``driver_id`` (what an artifact's ``row`` may say)."""
    contract = SNAPSHOT_DRIVERS[driver_id]
    return (driver_id, f"{driver_id}-cpu", *(e.row for e in contract.exceptions))


@dataclass(frozen=True)
class DriverAdmission:
    """Which contract row admitted a host, and the NVIDIA driver it saw."""

    driver: str
    row: str
    nvidia_driver: str | None


def nvidia_major(version: str) -> int:
    """'580.159.03' -> 580."""
    try:
        return int(str(version).split(".", 1)[0])
    except ValueError as exc:
        raise AdmissionError(f"cannot read NVIDIA driver version {version!r}") from exc


def nvidia_version(version: str) -> tuple[int, ...]:
    """'580.159.03' -> (580, 159, 3): NVIDIA driver versions compare component by component."""
    try:
        return tuple(int(part) for part in str(version).strip().split("."))
    except ValueError as exc:
        raise AdmissionError(f"cannot read NVIDIA driver version {version!r}",
                             fix="report the driver as nvidia-smi prints it (e.g. 580.159.03)") from exc


def admit_driver(driver_id: str, *, nvidia_driver: str | None, gpu_workers_per_unit: int) -> DriverAdmission:
    """Admit a host for ``driver_id``; raise AdmissionError naming the floor otherwise.

    CPU-only units (no GPU worker) need no NVIDIA driver: both drivers reduce to CRIU.
    """
    contract = SNAPSHOT_DRIVERS.get(driver_id)
    if contract is None:
        raise AdmissionError(f"unknown snapshot driver {driver_id!r}", fix=f"use one of {', '.join(SNAPSHOT_DRIVERS)}")
    if gpu_workers_per_unit == 0:
        return DriverAdmission(driver_id, f"{driver_id}-cpu", None)
    if nvidia_driver is None:
        raise AdmissionError(f"snapshot driver {driver_id} needs an NVIDIA driver for GPU workers but none was found",
                             fix="install the NVIDIA driver or place the unit on a GPU host")
    major = nvidia_major(nvidia_driver)
    if major >= contract.min_nvidia_driver:
        return DriverAdmission(driver_id, driver_id, nvidia_driver)
    for exc in contract.exceptions:
        if major >= exc.min_nvidia_driver and gpu_workers_per_unit <= exc.max_workers_per_unit:
            return DriverAdmission(driver_id, exc.row, nvidia_driver)
    raise AdmissionError(
        f"NVIDIA driver {nvidia_driver} is older than snapshot driver {driver_id}'s minimum {contract.min_nvidia_driver}"
        + (f" (qualified exception: {contract.exceptions[0].condition}, from {contract.exceptions[0].min_nvidia_driver})"
           if contract.exceptions else ""),
        fix=f"upgrade the NVIDIA driver to >= {contract.min_nvidia_driver} or use snapshot driver n580",
    )
