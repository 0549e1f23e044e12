"""CUDA checkpoint through the driver API (cuda-python's ``cuda.bindings.driver``).

The sequence verified on an H200 (driver 580): lock -> checkpoint (GPU memory is
released into host memory that CRIU then dumps) ... CRIU dump/restore ... restore
-> unlock. A failed lock or checkpoint leaves the process unlocked and running.

A multi-process engine (vLLM V1: an API server without CUDA, an engine core and workers
with it) holds CUDA contexts in several processes of one tree: :func:`checkpoint_tree`
locks every one of them before it checkpoints any (no process may launch GPU work
against a peer that is already checkpointed), and :func:`restore_tree` restores every
one before it unlocks any.
"""

from __future__ import annotations

import contextlib
import os
import threading

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.proctree import process_tree


def _driver():
    try:
        from cuda.bindings import driver as cu
    except ImportError as exc:
        raise ColdSnapError("cuda-python is not installed on this host, so CUDA state cannot be checkpointed",
                            fix="pip install 'cuda-python>=12.6' (the 'gpu' extra of coldsnap)") from exc
    return cu


def _call(cu, what: str, result) -> object:
    err = result[0] if isinstance(result, tuple) else result
    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(err)[1]
        name = name.decode() if isinstance(name, bytes) else str(name)
        raise ColdSnapError(f"{what} failed: {name}")
    return result[1] if isinstance(result, tuple) and len(result) > 1 else None


def _init(cu) -> None:
    # Device ordinals mean PCI bus order everywhere (NVML, the unit's CUDA_VISIBLE_DEVICES, here).
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    _call(cu, "cuInit", cu.cuInit(0))


def preload() -> threading.Thread:
    """Initialise the CUDA driver in this process in the background (``cuInit`` took 0.19-0.23 s on an
    H200 host, plus 0.02-0.05 s to import the bindings), so that a restore's CUDA step, which needs
    it, finds it done: started before the CRIU restore, it costs the restore nothing. Errors are
    left to the step that needs the driver (which calls ``cuInit`` again and reports them)."""
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # here, not in the thread: one writer

    def run() -> None:
        with contextlib.suppress(Exception):
            _init(_driver())

    thread = threading.Thread(target=run, name="coldsnap-cuda-init", daemon=True)
    thread.start()
    return thread


def state(pid: int) -> str:
    """'running', 'locked', 'checkpointed' or 'failed'."""
    cu = _driver()
    _init(cu)
    st = _call(cu, f"cuCheckpointProcessGetState({pid})", cu.cuCheckpointProcessGetState(pid))
    name = getattr(st, "name", str(st))  # CU_PROCESS_STATE_RUNNING -> running
    return name.rsplit("_", 1)[-1].lower()


def uses_cuda(pid: int) -> bool:
    """True when ``pid`` holds a CUDA context (it maps the NVIDIA device files)."""
    try:
        with open(f"/proc/{pid}/maps") as fh:
            return any("/dev/nvidia" in line for line in fh)
    except OSError:
        return False


def cuda_pids(root: int) -> list[int]:
    """The processes of ``root``'s tree that hold a CUDA context, in pid order."""
    return sorted(pid for pid in process_tree(root) if uses_cuda(pid))


def checkpoint(pid: int, *, lock_timeout_ms: int = 30000) -> None:
    """Lock the process's CUDA API and move its GPU state to host memory.

    On any failure the process is unlocked again and keeps running (FAULTS 21).
    """
    checkpoint_tree([pid], lock_timeout_ms=lock_timeout_ms)


def checkpoint_tree(pids: list[int], *, lock_timeout_ms: int = 30000) -> None:
    """Lock the CUDA API of every process in ``pids``, then move each one's GPU state to host
    memory. On any failure the ones already checkpointed are restored, every lock is released,
    and the processes keep running (FAULTS 21)."""
    cu = _driver()
    _init(cu)
    locked: list[int] = []
    done: list[int] = []
    try:
        for pid in pids:
            args = cu.CUcheckpointLockArgs()
            args.timeoutMs = lock_timeout_ms
            _call(cu, f"cuCheckpointProcessLock({pid})", cu.cuCheckpointProcessLock(pid, args))
            locked.append(pid)
        for pid in pids:
            _call(cu, f"cuCheckpointProcessCheckpoint({pid})", cu.cuCheckpointProcessCheckpoint(pid, None))
            done.append(pid)
    except ColdSnapError:
        for pid in done:
            cu.cuCheckpointProcessRestore(pid, None)
        for pid in locked:
            cu.cuCheckpointProcessUnlock(pid, None)
        raise


def _uuid_string(raw: bytes) -> str:
    h = bytes(raw).hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def uuid_struct(cu, text: str, keep: list):
    """A CUuuid for an NVML-style ``GPU-xxxxxxxx-...`` string (the GPU need not be on this host).

    cuda-python's CUuuid has read-only fields, but wraps existing memory when given its
    address: the 16 bytes live in a ctypes buffer that ``keep`` holds until the call is done.
    """
    import ctypes

    raw = bytes.fromhex(text.removeprefix("GPU-").replace("-", ""))
    if len(raw) != 16:
        raise ColdSnapError(f"{text!r} is not a GPU UUID", fix="use the form GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx")
    buf = ctypes.create_string_buffer(raw, 16)
    keep.append(buf)
    return cu.CUuuid(_ptr=ctypes.addressof(buf))


def device_uuids() -> list[str]:
    """UUIDs (``GPU-...``) of the GPUs this process can see, in CUDA ordinal order."""
    cu = _driver()
    _init(cu)
    count = _call(cu, "cuDeviceGetCount", cu.cuDeviceGetCount())
    out = []
    for i in range(count):
        dev = _call(cu, f"cuDeviceGet({i})", cu.cuDeviceGet(i))
        out.append(_uuid_string(_call(cu, f"cuDeviceGetUuid({i})", cu.cuDeviceGetUuid(dev)).bytes))
    return out


def restore_map(used_before: list[str], used_now: list[str], host_before: list[str] | None,
                host_now: list[str]) -> dict[str, str] | None:
    """The GPU map for ``restore``: None when nothing moves, else a bijection over all GPUs.

    The driver wants a pair for every GPU the process's driver state knows, which is every
    GPU of the host it was checkpointed on (not only the ones it used), and the caller must
    see all of them too. ``used_*`` are the GPUs the worker used at capture and uses now (in
    slot order), ``host_*`` every GPU of the capture host and of this host (PCI bus order).
    The GPUs the worker did not use are paired identity-first, then in bus order.
    """
    pairs = dict(zip(used_before, used_now, strict=True))
    if not host_before:  # capture evidence without the host's GPU list: the used pairs only
        return pairs if any(a != b for a, b in pairs.items()) else None
    if all(a == b for a, b in pairs.items()) and list(host_before) == list(host_now):
        return None
    if len(host_before) != len(host_now):
        raise ColdSnapError(
            f"the process was checkpointed on a host with {len(host_before)} GPU(s) and this host has "
            f"{len(host_now)}: the CUDA driver restores only onto the same number of GPUs",
            fix="restore onto a host with the same GPU count (any order; GPUs are matched by UUID)")
    missing = [u for u in pairs.values() if u not in host_now]
    if missing:
        raise ColdSnapError(f"GPU(s) {', '.join(missing)} are not visible to the restoring process",
                            fix="run the restore without CUDA_VISIBLE_DEVICES restrictions")
    rest_before = [u for u in host_before if u not in pairs]
    rest_now = [u for u in host_now if u not in pairs.values()]
    stay = [u for u in rest_before if u in rest_now]
    pairs.update((u, u) for u in stay)
    pairs.update(zip([u for u in rest_before if u not in stay], [u for u in rest_now if u not in stay], strict=True))
    return pairs


def restore(pid: int, *, remap: dict[str, str] | None = None) -> None:
    """Bring GPU state back after the CRIU restore (fatal for the process if it fails).

    ``remap`` maps each checkpointed GPU's UUID to the GPU to restore it onto (same
    chip type); the driver needs a pair for every GPU of the capture host once any
    moves, so callers pass ``restore_map``'s bijection or None.
    """
    cu = _driver()
    _init(cu)
    args = None
    if remap:
        args = cu.CUcheckpointRestoreArgs()
        pairs, keep = [], []
        for old, new in remap.items():
            pair = cu.CUcheckpointGpuPair()
            pair.oldUuid = uuid_struct(cu, old, keep)
            pair.newUuid = uuid_struct(cu, new, keep)
            pairs.append(pair)
        args.gpuPairs = pairs
        args.gpuPairsCount = len(pairs)
    _call(cu, f"cuCheckpointProcessRestore({pid})", cu.cuCheckpointProcessRestore(pid, args))


def unlock(pid: int) -> None:
    """Let the restored process use CUDA again."""
    cu = _driver()
    _init(cu)
    _call(cu, f"cuCheckpointProcessUnlock({pid})", cu.cuCheckpointProcessUnlock(pid, None))


def restore_tree(pids: list[int], *, remap: dict[str, str] | None = None) -> None:
    """Restore the GPU state of every process in ``pids``, then unlock them all."""
    for pid in pids:
        restore(pid, remap=remap)
    for pid in pids:
        unlock(pid)
