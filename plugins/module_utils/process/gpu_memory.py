"""GPU memory as nvidia-smi reports it now: free per GPU and what each process holds there. Read by a
capture (what a unit's workers hold serving) and by restore's admission (room on the target GPUs)."""

from __future__ import annotations

import shutil
import subprocess

NOT_REPORTED = ("[N/A]", "N/A", "[Not Supported]", "Not Supported", "")


def number(text: str) -> float | None:
    """A figure nvidia-smi printed, or None where it says the GPU does not report it (unified-memory
    GPUs such as GB10 print ``[N/A]`` for ``memory.total``)."""
    text = text.strip()
    if text in NOT_REPORTED:
        return None
    try:
        return float(text)
    except ValueError:
        return None


def parse_gpu_memory(gpus_csv: str, apps_csv: str) -> dict[int, dict]:
    """Per GPU ordinal ``{"uuid", "free_mib", "apps": {pid: MiB}}`` from ``nvidia-smi
    --query-gpu=index,uuid,memory.free`` and ``--query-compute-apps=gpu_uuid,pid,used_memory`` (both
    ``--format=csv,noheader,nounits``). A GPU that reports no free figure (unified memory) is left out."""
    out: dict[int, dict] = {}
    by_uuid: dict[str, dict] = {}
    for line in gpus_csv.strip().splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) != 3 or not parts[0].isdigit():
            continue
        free = number(parts[2])
        if free is None:
            continue
        out[int(parts[0])] = by_uuid[parts[1]] = {"uuid": parts[1], "free_mib": int(free), "apps": {}}
    for line in apps_csv.strip().splitlines():
        parts = [x.strip() for x in line.split(",")]
        used = number(parts[2]) if len(parts) == 3 else None
        if used is None or parts[0] not in by_uuid or not parts[1].isdigit():
            continue
        apps = by_uuid[parts[0]]["apps"]
        apps[int(parts[1])] = apps.get(int(parts[1]), 0) + int(used)
    return out


def gpu_memory() -> dict[int, dict]:
    """This host's GPUs' free memory and who uses it now (:func:`parse_gpu_memory`); {} without nvidia-smi
    or when it fails."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return {}
    runs = [subprocess.run([smi, query, "--format=csv,noheader,nounits"], check=False, capture_output=True,
                           text=True, timeout=60)
            for query in ("--query-gpu=index,uuid,memory.free", "--query-compute-apps=gpu_uuid,pid,used_memory")]
    if any(r.returncode != 0 for r in runs):
        return {}
    return parse_gpu_memory(runs[0].stdout, runs[1].stdout)
