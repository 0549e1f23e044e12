"""A GPU unit is restored only onto GPUs with room for what its workers held serving at capture: the
memory free now plus what the workload being replaced holds there. Otherwise prepare refuses, naming the
GPUs, the figures and who else holds the memory, before anything is evicted (CUDA restore would fail
after it). nvidia-smi's output as it prints it; on a GPU host tests/gpu restores for real."""

from __future__ import annotations

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import AdmissionError
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.admission import require_gpu_memory
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.host_facts import parse_gpu_memory

GPUS = """0, GPU-aaaa, 1200
1, GPU-bbbb, 80000
2, GPU-cccc, [N/A]
"""
APPS = """GPU-aaaa, 4242, 30000
GPU-aaaa, 4243, 2000
GPU-aaaa, 999, 46000
GPU-bbbb, 5000, 512
GPU-zzzz, 1, 1
"""


def captured(*mibs: int) -> dict:
    return {"workers": [{"worker": f"w{i}", "cuda": True, "memory_at_checkpoint": {"gpu_used_mib": m}}
                        for i, m in enumerate(mibs)]}


def test_nvidia_smi_figures_per_gpu_and_process():
    mem = parse_gpu_memory(GPUS, APPS)
    assert sorted(mem) == [0, 1], "a GPU without a free figure (unified memory) is not judged"
    assert mem[0] == {"uuid": "GPU-aaaa", "free_mib": 1200, "apps": {4242: 30000, 4243: 2000, 999: 46000}}
    assert mem[1]["apps"] == {5000: 512}


def test_room_counts_what_the_eviction_frees():
    mem = parse_gpu_memory(GPUS, APPS)
    unit = {"id": "u0", "devices": [0]}
    got = require_gpu_memory(unit, captured(30000), host="h1", replaced={4242, 4243}, memory=mem)
    assert got == {"needed_mib": 30000, "free_mib": 1200, "freed_by_eviction_mib": 32000}
    with pytest.raises(AdmissionError) as err:  # a stranger's process holds the rest
        require_gpu_memory(unit, captured(30000, 5000), host="h1", replaced={4242, 4243}, memory=mem)
    msg = err.value.problem
    assert "unit u0 on h1: GPU 0 has 1200 MiB free (32000 MiB more once the workload being replaced is evicted)" in msg
    assert "held 35000 MiB of GPU memory serving at capture" in msg and "nothing was evicted" in msg
    assert "pid 999 (46000 MiB)" in msg and "4242" not in msg.split("Other users")[1]
    assert "launch.units[].devices" in err.value.fix


def test_nothing_judged_without_figures():
    mem = parse_gpu_memory(GPUS, APPS)
    assert require_gpu_memory({"id": "u0", "devices": [0]}, captured(10**6), host="h", replaced=set(), memory={}) is None
    assert require_gpu_memory({"id": "u0", "devices": [2]}, captured(10**6), host="h", replaced=set(), memory=mem) is None
    cpu = {"workers": [{"worker": "w0", "cuda": False, "memory_at_checkpoint": {"gpu_used_mib": 9}}]}
    assert require_gpu_memory({"id": "u0", "devices": [0]}, cpu, host="h", replaced=set(), memory=mem) is None
    old = {"workers": [{"worker": "w0", "cuda": True}]}  # a capture that recorded no figure
    assert require_gpu_memory({"id": "u0", "devices": [0]}, old, host="h", replaced=set(), memory=mem) is None
    serving = {"workers": [{"worker": "w0", "cuda": True, "memory_serving": {"gpu_used_mib": 30000},
                            "memory_at_checkpoint": {"gpu_used_mib": 500}}]}  # weights released at checkpoint
    with pytest.raises(AdmissionError, match="held 30000 MiB"):
        require_gpu_memory({"id": "u0", "devices": [0]}, serving, host="h", replaced=set(), memory=mem)
    two = require_gpu_memory({"id": "u0", "devices": [0, 1]}, captured(40000, 40000), host="h",
                             replaced={4242}, memory=mem)
    assert two["free_mib"] == 81200
