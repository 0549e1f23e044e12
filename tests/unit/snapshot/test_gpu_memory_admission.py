"""A GPU unit is restored only onto GPUs with room for what its workers held serving at capture: per GPU,
summed over the host's units, the memory free now plus what the workload being replaced holds there.
Otherwise prepare refuses, naming the GPU, the figures and who else holds its memory, before anything is
evicted (CUDA restore or the weights' re-creation would fail after it). nvidia-smi's output as it prints
it; on a GPU host tests/gpu fills a real GPU."""

from __future__ import annotations

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import AdmissionError
from ansible_collections.coldsnap.fleet.plugins.module_utils.process.gpu_memory import parse_gpu_memory
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.admission import GpuRoom

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


def artifact(workers: dict[str, int | None]) -> dict:
    return {"launch": {"execution": {"workers": [{"id": w, "device_slot": s} for w, s in workers.items()]}}}


def captured(**mibs: int) -> dict:
    return {"workers": [{"worker": w, "cuda": True, "memory_serving": {"gpu_used_mib": m},
                         "memory_at_checkpoint": {"gpu_used_mib": 100}} for w, m in mibs.items()]}


def test_nvidia_smi_figures_per_gpu_and_process():
    mem = parse_gpu_memory(GPUS, APPS)
    assert sorted(mem) == [0, 1], "a GPU without a free figure (unified memory) is not judged"
    assert mem[0] == {"uuid": "GPU-aaaa", "free_mib": 1200, "apps": {4242: 30000, 4243: 2000, 999: 46000}}
    assert mem[1]["apps"] == {5000: 512}


def test_room_counts_what_the_eviction_frees_and_names_who_holds_the_rest():
    mem = parse_gpu_memory(GPUS, APPS)
    room = GpuRoom(artifact({"w0": 0}), mem)
    room.add({"id": "u0", "devices": [0]}, captured(w0=30000))
    assert room.admit("h1", replaced={4242, 4243}) == [
        {"gpus": [0], "needed_mib": 30000, "free_mib": 1200, "freed_by_eviction_mib": 32000}]
    room = GpuRoom(artifact({"w0": 0}), mem)
    room.add({"id": "u0", "devices": [0]}, captured(w0=35000))
    with pytest.raises(AdmissionError) as err:  # a stranger's process holds the rest
        room.admit("h1", replaced={4242, 4243})
    msg = err.value.problem
    assert "h1: GPU 0 has 1200 MiB free (32000 MiB more once the workload being replaced is evicted)" in msg
    assert "held 35000 MiB of GPU memory serving at capture" in msg and "nothing was evicted" in msg
    assert "pid 999 (46000 MiB)" in msg and "4242" not in msg.split("Other users")[1]
    assert "launch.units[].devices" in err.value.fix


def test_each_gpu_is_judged_on_its_own_and_units_sharing_one_add_up():
    mem = parse_gpu_memory(GPUS, APPS)
    # two workers of one unit on GPUs 0 and 1: GPU 1's room does not make up for GPU 0's lack
    room = GpuRoom(artifact({"w0": 0, "w1": 1}), mem)
    room.add({"id": "u0", "devices": [0, 1]}, captured(w0=40000, w1=40000))
    with pytest.raises(AdmissionError, match="GPU 0 has 1200 MiB free"):
        room.admit("h1", replaced={4242, 4243})
    # two units on GPU 0 that fit one by one, not together
    room = GpuRoom(artifact({"a0": 0, "b0": 0}), mem)
    room.add({"id": "ua", "devices": [0]}, captured(a0=20000))
    room.add({"id": "ub", "devices": [0]}, captured(b0=20000))
    with pytest.raises(AdmissionError, match="held 40000 MiB"):
        room.admit("h1", replaced={4242, 4243})
    # a worker without a slot counts against its unit's GPUs together
    room = GpuRoom(artifact({"w0": None}), mem)
    room.add({"id": "u0", "devices": [0, 1]}, captured(w0=80000))
    assert room.admit("h1", replaced={4242})[0]["gpus"] == [0, 1]


def test_nothing_judged_without_figures():
    mem = parse_gpu_memory(GPUS, APPS)
    for memory, devices in (({}, [0]), (mem, [2])):  # nvidia-smi missing; a unified-memory GPU
        room = GpuRoom(artifact({"w0": 0}), memory)
        room.add({"id": "u0", "devices": devices}, captured(w0=10**6))
        assert room.admit("h", replaced=set()) == []
    room = GpuRoom(artifact({"w0": 0}), mem)
    room.add({"id": "u0", "devices": [0]}, {"workers": [{"worker": "w0", "cuda": False,
                                                        "memory_serving": {"gpu_used_mib": 10**6}}]})
    room.add({"id": "u1", "devices": [0]}, {"workers": [{"worker": "w0", "cuda": True}]})  # recorded no figure
    assert room.admit("h", replaced=set()) == []
    # an older capture: the checkpoint's figure (a lower bound) still counts
    room = GpuRoom(artifact({"w0": 0}), mem)
    room.add({"id": "u0", "devices": [0]}, {"workers": [{"worker": "w0", "cuda": True,
                                                        "memory_at_checkpoint": {"gpu_used_mib": 5000}}]})
    with pytest.raises(AdmissionError, match="held 5000 MiB"):
        room.admit("h", replaced=set())
