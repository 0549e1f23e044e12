"""A restored engine gets its AMX permission back: torch and oneDNN ask the kernel for AMX tile data
(``arch_prctl(ARCH_REQ_XCOMP_PERM)``) the first time they run a bf16 kernel on a CPU with AMX; CRIU
restores the registers but not that permission, and the engine's next bf16 matmul died of SIGILL
(vLLM's worker on CPU: exit -4 on the first request after a restore). ``cpu_state.remember`` before
the dump and ``cpu_state.regrant`` on resume (what every engine integration does) keep it serving.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import criu as criu_mod
from coldsnap_engines.common import cpu_state

XTILEDATA = 1 << 18

# A bf16 matmul (AMX where the CPU has it), the permission remembered as the integrations do before a
# dump; then, restored, the same matmul, with or without the regrant the integrations do on resume.
ENGINE = r"""
import json, os, sys, time
import torch
from coldsnap_engines.common import cpu_state

torch.manual_seed(0)
a, b = torch.randn(256, 256, dtype=torch.bfloat16), torch.randn(256, 256, dtype=torch.bfloat16)
value = float((a @ b).float().sum())
info = {"pid": os.getpid(), "remembered": cpu_state.remember(), "value": value}
with open(sys.argv[1] + ".tmp", "w") as fh:
    json.dump(info, fh)
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
go = sys.argv[1] + ".go"
while not os.path.exists(go):
    time.sleep(0.02)
after = {"permitted_on_restore": cpu_state.permitted()}
if open(go).read() == "regrant":
    after["asked"] = cpu_state.regrant()
after["value"] = float((a @ b).float().sum())
with open(sys.argv[1] + ".after.tmp", "w") as fh:
    json.dump(after, fh)
os.rename(sys.argv[1] + ".after.tmp", sys.argv[1] + ".after")
while True:
    time.sleep(1)
"""


def _has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def _dead(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def test_the_permission_is_remembered_and_nothing_is_asked_when_nothing_was_lost():
    mask = cpu_state.remember()
    assert mask & ~XTILEDATA == 0, "only dynamic features are remembered"
    assert cpu_state.regrant() == [], "this process lost nothing"
    assert cpu_state.permitted() & mask == mask


@pytest.mark.criu
@pytest.mark.parametrize("resume", ["regrant", "plain"])
def test_a_restored_bf16_engine_keeps_running_its_amx_kernels(tmp_path, criu_build, reap, spawn_ready, resume):
    if not _has_amx():
        pytest.skip("this CPU has no AMX: there is no permission for a restore to drop")
    criu, _ours = criu_build
    proc, info = spawn_ready(ENGINE, "bf16 engine")
    assert info["remembered"] & XTILEDATA, "torch's bf16 matmul asked for AMX tile data on this AMX CPU"
    criu_mod.dump(criu, info["pid"], tmp_path / "images")
    proc.wait(timeout=30)
    restored = criu_mod.restore(criu, tmp_path / "images", work_dir=tmp_path / "work").pid
    reap(restored)
    ready = tmp_path / "bf16-engine.json"
    Path(f"{ready}.go").write_text(resume)
    after_file = Path(f"{ready}.after")
    deadline = time.time() + 60
    while not after_file.exists() and not _dead(restored):
        assert time.time() < deadline, "the restored engine neither answered nor died in 60 s"
        time.sleep(0.05)
    if resume == "plain":
        # What CRIU alone gives back: no permission, and the next AMX instruction kills the process.
        assert not after_file.exists() and _dead(restored), "CRIU now restores the AMX permission itself"
        return
    after = json.loads(after_file.read_text())
    assert not after["permitted_on_restore"] & XTILEDATA, "the restore dropped the permission"
    assert after["asked"] == [cpu_state.DYNAMIC_FEATURES[18]]
    assert after["value"] == info["value"], "the same product, computed again after the restore"
    assert not _dead(restored) and os.path.exists(f"/proc/{restored}")
