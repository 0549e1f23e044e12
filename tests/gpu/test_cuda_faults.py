"""FAULTS.md 21 and 22 with the real CUDA driver checkpoint API (GPU only)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
HERE = Path(__file__).parent


def child(mode: str, gib: float) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, str(HERE / "gpu_child.py"), mode, str(gib)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_fault21_lock_timeout_leaves_the_process_unlocked_and_running():
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
    from ansible_collections.coldsnap.fleet.plugins.module_utils.process import cuda_checkpoint as cuda

    p = child("busy", 0.25)
    try:
        time.sleep(0.5)
        with pytest.raises(ColdSnapError) as exc:
            cuda.checkpoint(p.pid, lock_timeout_ms=50)
        assert "cuCheckpointProcess" in str(exc.value)
        assert cuda.state(p.pid) == "running"
        assert p.poll() is None, "the process must be left running"
    finally:
        p.kill()
        p.wait()


def test_fault22_cuda_restore_failure_is_reported():
    """Restore into a GPU without room for the checkpointed state fails clearly."""
    import torch
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
    from ansible_collections.coldsnap.fleet.plugins.module_utils.process import cuda_checkpoint as cuda

    p = child("hold", 8)
    filler = None
    try:
        cuda.checkpoint(p.pid)
        assert cuda.state(p.pid) == "checkpointed"
        free, _total = torch.cuda.mem_get_info()
        filler = torch.empty(free - (1 << 30), dtype=torch.uint8, device="cuda")  # leave 1 GiB: too little
        with pytest.raises(ColdSnapError) as exc:
            cuda.restore(p.pid)
        assert "cuCheckpointProcessRestore" in str(exc.value)
        del filler
        filler = None
        torch.cuda.empty_cache()
    finally:
        del filler
        p.kill()
        p.wait()


def test_checkpoint_restore_keeps_the_bytes_with_an_explicit_gpu_mapping():
    from ansible_collections.coldsnap.fleet.plugins.module_utils.process import cuda_checkpoint as cuda

    p = child("hold", 1)
    try:
        uuid = cuda.device_uuids()[0]
        assert uuid.startswith("GPU-") and len(uuid) == 40
        from cuda.bindings import driver as cu

        keep: list = []
        assert cuda._uuid_string(cuda.uuid_struct(cu, uuid, keep).bytes) == uuid  # any UUID, not only local ones
        cuda.checkpoint(p.pid)
        assert cuda.state(p.pid) == "checkpointed"
        # The remap path, onto the same GPUs: the driver wants a pair for every GPU of the host.
        cuda.restore(p.pid, remap={u: u for u in cuda.device_uuids()})
        cuda.unlock(p.pid)
        assert cuda.state(p.pid) == "running"
        time.sleep(0.3)
        assert p.poll() is None
    finally:
        p.kill()
        out = p.communicate()[0]
    assert "corrupted" not in out


def _gpu_used_mib(pid: int) -> int:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         check=True, capture_output=True, text=True).stdout
    return next((int(m) for p, m in (line.split(",") for line in out.splitlines()) if int(p) == pid), 0)


def test_context_shrink_survives_a_checkpoint_and_restore_gives_the_stack_back():
    """What a released engine does before its CUDA checkpoint (coldsnap_engines.common.gpu_context)."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.process import cuda_checkpoint as cuda

    integ = str(HERE.parents[1] / "runtime_image" / "integrations")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([integ, os.environ.get("PYTHONPATH", "")])}
    p = subprocess.Popen([sys.executable, str(HERE / "context_child.py")], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline().strip() == "ready"
        before = _gpu_used_mib(p.pid)
        p.stdin.write("shrink\n")
        p.stdin.flush()
        _word, stack, now = p.stdout.readline().split()
        assert int(stack) > 0 and int(now) == 0
        after = _gpu_used_mib(p.pid)
        assert after < before, f"shrinking freed nothing ({before} -> {after} MiB)"
        cuda.checkpoint(p.pid)
        cuda.restore(p.pid)
        cuda.unlock(p.pid)
        p.stdin.write("restore\n")
        p.stdin.flush()
        assert p.stdout.readline().split() == ["restored", stack, "True"]
    finally:
        p.kill()
        p.wait()
