"""Host facts that admission compares with a capture's platform inventory:
architecture, kernel, CPU, GPUs (NVML, else nvidia-smi), NVIDIA driver,
compute capability, CRIU version and ``criu check``."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.process.gpu_memory import NOT_REPORTED, number


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or ""


def parse_nvidia_smi(text: str) -> tuple[list[dict], str | None]:
    """(gpus, driver) from ``nvidia-smi --query-gpu=index,name,compute_cap,memory.total,uuid,driver_version
    --format=csv,noheader,nounits``. A field the GPU does not report is None (``memory_mib``), and a GPU
    without its own memory figure is marked ``unified_memory``."""
    out: list[dict] = []
    driver = None
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 6:
            continue
        idx, name, cc, mem, uuid, drv = parts
        driver = drv if drv not in NOT_REPORTED else driver
        mib = number(mem)
        out.append({"index": int(idx), "model": name,
                    "compute_capability": cc if cc not in NOT_REPORTED else None,
                    "memory_mib": int(mib) if mib is not None else None, "unified_memory": mib is None,
                    "uuid": uuid, "nvidia_driver": drv})
    return out, driver


def _nvml_memory_mib(pynvml, handle) -> int | None:
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total // (1 << 20))
    except Exception:  # NVMLError_NotSupported on unified-memory GPUs (GB10)
        return None


def gpus() -> tuple[list[dict], str | None, str]:
    """(gpus, nvidia driver version or None, how they were found)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            driver = driver.decode() if isinstance(driver, bytes) else driver
            out = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                name = pynvml.nvmlDeviceGetName(h)
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
                mem = _nvml_memory_mib(pynvml, h)
                uuid = pynvml.nvmlDeviceGetUUID(h)
                out.append({"index": i, "model": name.decode() if isinstance(name, bytes) else name,
                            "compute_capability": f"{major}.{minor}", "memory_mib": mem, "unified_memory": mem is None,
                            "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid, "nvidia_driver": driver})
            return out, driver, "nvml"
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library, no driver, or no GPU: try nvidia-smi, else none
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        r = subprocess.run([smi, "--query-gpu=index,name,compute_cap,memory.total,uuid,driver_version",
                            "--format=csv,noheader,nounits"], check=False, capture_output=True, text=True, timeout=60)
        if r.returncode == 0:
            found, driver = parse_nvidia_smi(r.stdout)
            return found, driver, "nvidia-smi"
    return [], None, "none"


def gather(*, check_criu: bool = True, criu_binary: str | None = None) -> dict:
    """Everything admission needs about this host, as plain JSON."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
    from ansible_collections.coldsnap.fleet.plugins.module_utils.process import criu as criu_mod

    gpu_list, driver, source = gpus()
    facts = {
        "arch": platform.machine(),
        "kernel": platform.release(),
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count() or 0,
        "gpus": gpu_list,
        "gpu_source": source,
        "nvidia_driver": driver,
        "criu": {"installed": False, "version": None, "check": None, "check_output": None, "binary": None},
        "docker": bool(shutil.which("docker")),
        "python": platform.python_version(),
    }
    try:
        c = criu_mod.find_criu(criu_binary)
        facts["criu"].update(installed=True, version=c.version, binary=c.binary)
        if check_criu:
            res = criu_mod.criu_check(c)
            facts["criu"].update(check=res.ok, check_output=res.output[-2000:])
    except ColdSnapError as exc:
        facts["criu"]["error"] = str(exc)
    return facts
