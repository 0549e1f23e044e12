"""CPU state a process asked the kernel for that a CRIU restore does not bring back.

On x86-64 a process must ask the kernel (``arch_prctl(ARCH_REQ_XCOMP_PERM)``) before it
may use a dynamically enabled register state: today AMX's tile data (XTILEDATA). torch
and oneDNN ask the first time they run a bf16 or int8 kernel on a CPU with AMX. CRIU 4.1
restores the registers but not that permission, so a restored engine dies of SIGILL
(exit -4) at its next AMX instruction: vLLM on CPU serves bf16 and did, on the first
request after a restore.

The permission is per process (every thread shares it). :func:`remember` reads it in the
engine before the dump; the answer lives in this module's memory, which the restore brings
back with the process. :func:`regrant` asks again for what was permitted then and is not now,
first thing on resume, before any kernel runs. Both are no-ops where there is nothing to do
(another architecture, a CPU without AMX, a process that never used it).
"""

from __future__ import annotations

import ctypes
import os
import platform

SYS_ARCH_PRCTL = 158  # x86-64
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
DYNAMIC_FEATURES = {18: "AMX tile data (XTILEDATA)"}  # xstate components granted on request

_REMEMBERED = {"mask": 0}  # the dynamic features permitted when remember() ran (kept across a restore)


def _x86_64() -> bool:
    return platform.system() == "Linux" and platform.machine() == "x86_64"


def _arch_prctl(code: int, arg) -> int:
    """``arch_prctl(code, arg)``: 0, or the errno of its failure."""
    libc = ctypes.CDLL(None, use_errno=True)
    return 0 if libc.syscall(SYS_ARCH_PRCTL, code, arg) == 0 else ctypes.get_errno()


def permitted() -> int:
    """The mask of xstate features this process may use (0 where the kernel cannot say)."""
    if not _x86_64():
        return 0
    mask = ctypes.c_uint64(0)
    return int(mask.value) if _arch_prctl(ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) == 0 else 0


def _dynamic(mask: int) -> int:
    return mask & sum(1 << bit for bit in DYNAMIC_FEATURES)


def remember() -> int:
    """Note the dynamic features this process may use now (before a dump); returns their mask."""
    _REMEMBERED["mask"] |= _dynamic(permitted())
    return _REMEMBERED["mask"]


def regrant() -> list[str]:
    """Ask again for the dynamic features :func:`remember` saw and this process lost (after a restore).
    Returns the names of those asked for; raises :class:`OSError` naming the feature when refused."""
    missing = _REMEMBERED["mask"] & ~permitted()
    if not missing:
        return []
    asked = []
    for bit, name in sorted(DYNAMIC_FEATURES.items()):
        if not missing & (1 << bit):
            continue
        err = _arch_prctl(ARCH_REQ_XCOMP_PERM, bit)
        if err:
            raise OSError(err, f"the restored engine (pid {os.getpid()}) cannot get back its permission to use "
                               f"{name}: arch_prctl(ARCH_REQ_XCOMP_PERM, {bit}) failed: {os.strerror(err)}; "
                               "restore on a host whose CPU and kernel offer it, as the capture's host did")
        asked.append(name)
    return asked
