"""The order of CUDA checkpoint and restore over every CUDA process of a unit (all workers, every
process of each worker's tree), through a stand-in for the CUDA driver API that records calls:
every process is locked before any is checkpointed, every one is restored before any is unlocked,
and a failure part-way gives every process back its GPU state and its lock."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError, UnitError
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import cuda_checkpoint as cuda

A, B, C, D = (f"GPU-{c * 8}-{c * 4}-{c * 4}-{c * 4}-{c * 12}" for c in "abcd")


class FakeDriver:
    """Records (call, pid); ``fail`` names one (call, pid) that returns an error."""

    class CUresult:
        CUDA_SUCCESS = 0

    def __init__(self, fail: tuple[str, int] | None = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.fail = fail

    def _rec(self, name: str, pid: int):
        self.calls.append((name, pid))
        return (1 if self.fail == (name, pid) else 0,)

    def cuInit(self, _flags):
        return (0,)

    def cuGetErrorName(self, err):
        return (0, b"CUDA_ERROR_ILLEGAL_STATE")

    def CUcheckpointLockArgs(self):
        return SimpleNamespace(timeoutMs=0)

    def cuCheckpointProcessLock(self, pid, _args):
        return self._rec("lock", pid)

    def cuCheckpointProcessCheckpoint(self, pid, _args):
        return self._rec("checkpoint", pid)

    def cuCheckpointProcessRestore(self, pid, _args):
        return self._rec("restore", pid)

    def cuCheckpointProcessUnlock(self, pid, _args):
        return self._rec("unlock", pid)


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(cuda, "_driver", lambda: fake)
    return fake


def test_every_process_is_locked_before_any_is_checkpointed(driver):
    cuda.checkpoint_tree([10, 11, 20])
    assert driver.calls == [("lock", 10), ("lock", 11), ("lock", 20),
                            ("checkpoint", 10), ("checkpoint", 11), ("checkpoint", 20)]


def test_a_failed_checkpoint_gives_every_process_its_state_and_lock_back(driver):
    driver.fail = ("checkpoint", 20)
    with pytest.raises(ColdSnapError, match=r"cuCheckpointProcessCheckpoint\(20\) failed: CUDA_ERROR_ILLEGAL_STATE"):
        cuda.checkpoint_tree([10, 11, 20])
    assert driver.calls[-5:] == [("restore", 10), ("restore", 11), ("unlock", 10), ("unlock", 11), ("unlock", 20)]


def test_a_failed_lock_unlocks_the_ones_already_locked_and_checkpoints_none(driver):
    driver.fail = ("lock", 11)
    with pytest.raises(ColdSnapError, match=r"cuCheckpointProcessLock\(11\)"):
        cuda.checkpoint_tree([10, 11, 20])
    assert not [c for c in driver.calls if c[0] == "checkpoint"]
    assert ("unlock", 10) in driver.calls and ("lock", 20) not in driver.calls


def test_every_process_is_restored_before_any_is_unlocked(driver):
    cuda.restore_tree([10, 11, 20])
    assert driver.calls == [("restore", 10), ("restore", 11), ("restore", 20),
                            ("unlock", 10), ("unlock", 11), ("unlock", 20)]


def _activation(monkeypatch, handles: list[SimpleNamespace], *, devices: list[int], backend: str = "cuda-criu"):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3] / "runtime_image" / "activation"))
    from coldsnap_activation.sequence import Activation

    act = object.__new__(Activation)  # the CUDA steps need only the spec and the handles
    act.spec = SimpleNamespace(unit_id="unit-0", unit={"devices": devices}, driver={"backend": backend},
                               timeout=lambda _name, default: default)
    act.handles = handles
    return act


def _worker(wid: str, slot: int, pid: int) -> SimpleNamespace:
    return SimpleNamespace(worker={"id": wid, "rank": slot, "device_slot": slot}, pid=pid)


def test_a_unit_checkpoints_all_its_workers_cuda_processes_in_one_locked_step(monkeypatch):
    trees = {100: [101], 200: [200, 201]}  # worker-0: its engine core holds CUDA; worker-1: itself and a child
    monkeypatch.setattr(cuda, "cuda_pids", lambda root: trees[root])
    seen = []
    monkeypatch.setattr(cuda, "checkpoint_tree", lambda pids, lock_timeout_ms: seen.append(list(pids)))
    handles = [_worker("worker-0", 0, 100), _worker("worker-1", 1, 200)]
    act = _activation(monkeypatch, handles, devices=[0, 1])
    assert act._checkpoint_cuda(handles) == {"worker-0": [101], "worker-1": [200, 201]}
    assert seen == [[101, 200, 201]]


def test_a_unit_under_plain_criu_refuses_a_worker_that_holds_cuda(monkeypatch):
    monkeypatch.setattr(cuda, "cuda_pids", lambda root: [root] if root == 200 else [])
    monkeypatch.setattr(cuda, "checkpoint_tree", lambda *a, **k: pytest.fail("nothing may be checkpointed"))
    handles = [_worker("worker-0", 0, 100), _worker("worker-1", 1, 200)]
    act = _activation(monkeypatch, handles, devices=[0, 1], backend="criu")
    with pytest.raises(UnitError, match=r"worker worker-1 holds a CUDA context.*backend is 'criu'"):
        act._checkpoint_cuda(handles)


def test_a_unit_restores_all_its_workers_with_one_gpu_map(monkeypatch):
    # Captured on GPUs A and B of a four-GPU host; restored onto D and C of the same host.
    monkeypatch.setattr(cuda, "device_uuids", lambda: [A, B, C, D])
    seen = []
    monkeypatch.setattr(cuda, "restore_tree", lambda pids, remap: seen.append((list(pids), remap)))
    handles = [_worker("worker-0", 0, 100), _worker("worker-1", 1, 200)]
    act = _activation(monkeypatch, handles, devices=[3, 2])
    host = [A, B, C, D]
    captured = [{"cuda": True, "gpu_uuids": [A], "host_gpu_uuids": host, "cuda_pids": [101]},
                {"cuda": True, "gpu_uuids": [B], "host_gpu_uuids": host, "cuda_pids": [200, 201]}]
    act._restore_cuda(list(zip(handles, captured, strict=True)))
    assert seen == [([101, 200, 201], {A: D, B: C, C: A, D: B})]  # the GPUs left over: bus order


def test_a_unit_whose_workers_stay_on_their_gpus_restores_without_a_map_and_skips_cpu_workers(monkeypatch):
    monkeypatch.setattr(cuda, "device_uuids", lambda: [A, B])
    seen = []
    monkeypatch.setattr(cuda, "restore_tree", lambda pids, remap: seen.append((list(pids), remap)))
    handles = [_worker("worker-0", 0, 100), _worker("worker-1", 1, 200)]
    act = _activation(monkeypatch, handles, devices=[0, 1])
    captured = [{"cuda": True, "gpu_uuids": [A], "host_gpu_uuids": [A, B], "cuda_pids": [100]},
                {"cuda": False}]
    act._restore_cuda(list(zip(handles, captured, strict=True)))
    assert seen == [([100], None)]
    seen.clear()
    act._restore_cuda(list(zip(handles, [{"cuda": False}, {"cuda": False}], strict=True)))
    assert seen == []


def test_the_driver_starts_in_the_background_and_a_missing_one_is_left_to_the_restore(monkeypatch):
    """``preload`` (started before the CRIU restore) runs cuInit off the caller's thread; without
    cuda-python or a GPU it ends quietly: the restore's own call reports the error, naming the fix."""
    import threading

    inits: list[str] = []
    fake = FakeDriver()
    monkeypatch.setattr(fake, "cuInit", lambda _flags: inits.append(threading.current_thread().name) or (0,))
    monkeypatch.setattr(cuda, "_driver", lambda: fake)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    cuda.preload().join(10)
    assert inits == ["coldsnap-cuda-init"]
    assert cuda.os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"

    def missing():
        raise ColdSnapError("cuda-python is not installed on this host", fix="pip install cuda-python")

    monkeypatch.setattr(cuda, "_driver", missing)
    thread = cuda.preload()
    thread.join(10)
    assert not thread.is_alive()
    with pytest.raises(ColdSnapError, match="cuda-python"):
        cuda.restore_tree([4242])
