"""Admission (FAULTS 19, 20) and the snapshot-driver contract table, as pure decisions on facts."""

from __future__ import annotations

import copy
import json

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import AdmissionError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.drivers import admit_driver
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.admission import admit_unit

import coldsnap  # noqa: F401  # pylint: disable=unused-import

H200 = {"index": 0, "model": "NVIDIA H200", "compute_capability": "9.0", "nvidia_driver": "580.159.04",
        "memory_mib": 143771}


@pytest.fixture
def gpu_artifact(fixtures_dir) -> dict:
    art = json.loads((fixtures_dir / "artifacts" / "reference-tiny-n610.json").read_text())
    art["launch"]["units"][0]["devices"] = [0]
    art["launch"]["execution"]["workers"][0]["device_slot"] = 0
    art["compatibility"]["units"][0]["gpus"] = [{k: H200[k] for k in ("model", "compute_capability",
                                                                      "nvidia_driver", "memory_mib")}]
    art["snapshot_driver"]["captured_nvidia_driver"] = "580.159.04"
    return art


def facts(**over) -> dict:
    f = {"arch": "x86_64", "kernel": "6.18.44", "gpus": [dict(H200)], "nvidia_driver": "580.159.04",
         "criu": {"installed": True, "version": "4.1.1", "check": True, "check_output": "Looks good."}}
    f.update(over)
    return f


def admit(art, f, devices=(0,)):
    return admit_unit(artifact=art, unit_id="unit-0", facts=f, devices=list(devices), host="gpu-7")


def test_same_platform_is_admitted_by_the_qualified_exception(gpu_artifact):
    rec = admit(gpu_artifact, facts(kernel="6.8.0-other"))  # kernel differs: criu check decides
    assert rec["row"] == "n610-single-process-r580"


@pytest.mark.parametrize(("change", "needle"), [
    ({"arch": "aarch64"}, "CPU architecture aarch64"),
    ({"gpus": [{**H200, "model": "NVIDIA H100 80GB HBM3"}]}, "GPU 0 is NVIDIA H100"),
    ({"gpus": [{**H200, "compute_capability": "8.0"}]}, "compute capability 8.0"),
    ({"gpus": []}, "does not exist on the host"),
    ({"nvidia_driver": "575.51.02", "gpus": [{**H200, "nvidia_driver": "575.51.02"}]}, "older than the captured floor"),
    ({"criu": {"installed": True, "version": "4.1.1", "check": False,
               "check_output": "Error (criu/cr-check.c:1234): UFFD is not supported"}}, "UFFD is not supported"),
    ({"criu": {"installed": False}}, "CRIU is not installed"),
])
def test_refusals_name_the_problem(gpu_artifact, change, needle):
    with pytest.raises(AdmissionError) as exc:
        admit(gpu_artifact, facts(**change))
    assert needle in str(exc.value)
    assert "gpu-7" in str(exc.value) and "unit-0" in str(exc.value)


def test_gpu_count_must_match(gpu_artifact):
    with pytest.raises(AdmissionError, match="2 GPU"):
        admit(gpu_artifact, facts(gpus=[dict(H200), {**H200, "index": 1}]), devices=(0, 1))


def test_driver_floor_can_be_relaxed_but_not_the_contract_minimum(gpu_artifact):
    art = copy.deepcopy(gpu_artifact)
    art["snapshot_driver"]["captured_nvidia_driver"] = "590.10"
    art["policy"]["compatibility"]["enforce_captured_driver_floor"] = False
    assert admit(art, facts())["row"] == "n610-single-process-r580"
    with pytest.raises(AdmissionError, match="older than snapshot driver n610's minimum") as exc:
        admit(art, facts(nvidia_driver="570.1", gpus=[{**H200, "nvidia_driver": "570.1"}]))
    # Named like every other refusal, and the way out a restore has (its snapshot driver is the artifact's).
    assert exc.value.problem.startswith("unit unit-0 on gpu-7: ") and "new capture" in exc.value.fix


def test_the_driver_floor_compares_the_whole_version(gpu_artifact):
    """580.65 is older than a 580.159.04 floor, though both are branch 580."""
    old = "580.65.06"
    with pytest.raises(AdmissionError, match=r"580\.65\.06 is older than the captured floor 580\.159\.04"):
        admit(gpu_artifact, facts(nvidia_driver=old, gpus=[{**H200, "nvidia_driver": old}]))
    newer = "580.159.10"
    assert admit(gpu_artifact, facts(nvidia_driver=newer, gpus=[{**H200, "nvidia_driver": newer}]))["row"]


def test_the_restore_request_sets_the_compatibility_policy(gpu_artifact):
    """The operator decides at restore time: the restore request's policy wins over the capture's."""
    art = copy.deepcopy(gpu_artifact)
    old = facts(nvidia_driver="580.65.06", gpus=[{**H200, "nvidia_driver": "580.65.06"}])
    relaxed = {"enforce_captured_driver_floor": False, "kernel": "capability"}
    assert admit_unit(artifact=art, unit_id="unit-0", facts=old, devices=[0], host="gpu-7", policy=relaxed)["row"]
    art["policy"]["compatibility"]["enforce_captured_driver_floor"] = False
    strict = {"enforce_captured_driver_floor": True, "kernel": "exact"}
    with pytest.raises(AdmissionError, match=r"kernel 6\.1\.0 differs"):
        admit_unit(artifact=art, unit_id="unit-0", facts=facts(kernel="6.1.0"), devices=[0], host="gpu-7",
                   policy=strict)


def test_exact_kernel_policy(gpu_artifact):
    art = copy.deepcopy(gpu_artifact)
    art["policy"]["compatibility"]["kernel"] = "exact"
    with pytest.raises(AdmissionError, match=r"kernel 6\.1\.0 differs"):
        admit(art, facts(kernel="6.1.0"))


def test_host_runtime_pins_the_criu_version(gpu_artifact):
    with pytest.raises(AdmissionError, match=r"CRIU 4\.2 differs"):
        admit(gpu_artifact, facts(criu={"installed": True, "version": "4.2", "check": True}))


def test_contract_rows():
    assert admit_driver("n610", nvidia_driver=None, gpu_workers_per_unit=0).row == "n610-cpu"
    assert admit_driver("n610", nvidia_driver="615.2", gpu_workers_per_unit=2).row == "n610"
    assert admit_driver("n610", nvidia_driver="580.159", gpu_workers_per_unit=1).row == "n610-single-process-r580"
    with pytest.raises(AdmissionError, match="minimum 610"):
        admit_driver("n610", nvidia_driver="580.159", gpu_workers_per_unit=2)
    assert admit_driver("n580", nvidia_driver="580.1", gpu_workers_per_unit=4).row == "n580"
    with pytest.raises(AdmissionError, match="needs an NVIDIA driver"):
        admit_driver("n580", nvidia_driver=None, gpu_workers_per_unit=1)


# ---- tensor-parallel GPU ranks moved to other GPUs (NCCL intra-node transports) -------------
GPU_A, GPU_B = "GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000"


def tp2_artifact(groups=(("tensor", ("worker-0", "worker-1")),)) -> dict:
    return {"launch": {"execution": {
        "workers": [{"id": f"worker-{r}", "unit": f"unit-{r}", "rank": r, "device_slot": 0} for r in (0, 1)],
        "groups": [{"kind": k, "workers": list(ws)} for k, ws in groups]}}}


def tp2_moves(devices: dict[str, int], env: dict | None = None, cuda: bool = True, **art):
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units.admission import GpuMoves

    captured_on = {"unit-0": GPU_A, "unit-1": GPU_B}
    moves = GpuMoves(tp2_artifact(**art), {"gpus": [{"index": 0, "uuid": GPU_A}, {"index": 1, "uuid": GPU_B}]})
    for uid, dev in devices.items():
        evidence = {"workers": [{"worker": uid.replace("unit", "worker"), "cuda": cuda,
                                 "gpu_uuids": [captured_on[uid]] if cuda else []}]}
        moves.add({"id": uid, "devices": [dev]}, evidence, {"environment": dict(env or {})})
    return moves


def test_tp_ranks_on_their_captured_gpus_are_admitted():
    m = tp2_moves({"unit-0": 0, "unit-1": 1})
    assert m.ranks == 2 and m.moves == []
    m.admit("gpu-7")


def test_swapped_tp_ranks_are_refused_before_eviction_with_the_fix():
    m = tp2_moves({"unit-0": 1, "unit-1": 0})
    assert m.moves == [("worker-0", GPU_A, GPU_B), ("worker-1", GPU_B, GPU_A)]
    with pytest.raises(AdmissionError) as exc:
        m.admit("gpu-7")
    text = str(exc.value)
    assert "gpu-7" in text and f"worker-0 ({GPU_A} -> {GPU_B})" in text and "invalid" not in text
    assert "NCCL_P2P_DISABLE=1" in exc.value.fix and "NCCL_SHM_DISABLE=1" in exc.value.fix


def test_swapped_tp_ranks_are_admitted_when_nccl_was_captured_on_sockets():
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units.admission import (
        NCCL_SOCKETS_ONLY,
    )

    m = tp2_moves({"unit-0": 1, "unit-1": 0}, env=NCCL_SOCKETS_ONLY)
    m.admit("gpu-7")
    half = tp2_moves({"unit-0": 1, "unit-1": 0}, env={"NCCL_P2P_DISABLE": "1"})  # SHM would still be used
    with pytest.raises(AdmissionError):
        half.admit("gpu-7")


@pytest.mark.parametrize("case", ["one rank on this host", "cpu workers", "no tensor group"])
def test_moves_that_nccl_survives_are_admitted(case):
    m = {"one rank on this host": lambda: tp2_moves({"unit-0": 1}),  # the peer is on another host: NET transport
         "cpu workers": lambda: tp2_moves({"unit-0": 1, "unit-1": 0}, cuda=False),
         "no tensor group": lambda: tp2_moves({"unit-0": 1, "unit-1": 0}, groups=())}[case]()
    m.admit("gpu-7")


# ----------------------------------------------------------------------------- unified memory (GB10), on paper
# Recorded `nvidia-smi --query-gpu=index,name,compute_cap,memory.total,uuid,driver_version
# --format=csv,noheader,nounits` lines: an H200, and a unified-memory aarch64 part that reports no
# memory of its own ([N/A]), as GB10 systems do.
SMI_H200 = "0, NVIDIA H200, 9.0, 143771, GPU-2f6c1a8e-0b7d-4c44-9d0a-6c1f0e2d9a11, 580.159.04\n"
SMI_GB10 = "0, NVIDIA GB10, 12.1, [N/A], GPU-9a1b2c3d-4e5f-6a7b-8c9d-0e1f2a3b4c5d, 580.95.05\n"


def test_nvidia_smi_figures_parse_and_unreported_memory_is_none():
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units.host_facts import parse_nvidia_smi

    (h200,), driver = parse_nvidia_smi(SMI_H200)
    assert driver == "580.159.04" and h200["memory_mib"] == 143771 and not h200["unified_memory"]
    (gb10,), driver = parse_nvidia_smi(SMI_GB10)
    assert driver == "580.95.05"
    assert gb10 == {"index": 0, "model": "NVIDIA GB10", "compute_capability": "12.1", "memory_mib": None,
                    "unified_memory": True, "uuid": "GPU-9a1b2c3d-4e5f-6a7b-8c9d-0e1f2a3b4c5d",
                    "nvidia_driver": "580.95.05"}


def test_nvml_without_a_memory_figure_reports_none():
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units.host_facts import _nvml_memory_mib

    class NotSupported(Exception):
        pass

    class Nvml:
        @staticmethod
        def nvmlDeviceGetMemoryInfo(_handle):
            raise NotSupported("Not Supported")

    assert _nvml_memory_mib(Nvml, object()) is None


def test_a_unified_memory_gpu_without_a_memory_figure_is_a_valid_platform_and_admitted(fixtures_dir):
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import validate_artifact
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units.host_facts import parse_nvidia_smi

    gpus, driver = parse_nvidia_smi(SMI_GB10)
    art = json.loads((fixtures_dir / "artifacts" / "reference-tiny-n610.json").read_text())
    art["launch"]["units"][0]["devices"] = [0]
    art["launch"]["execution"]["workers"][0]["device_slot"] = 0
    art["compatibility"]["units"][0].update(arch="aarch64", gpus=[
        {k: gpus[0][k] for k in ("model", "compute_capability", "nvidia_driver")}])
    art["snapshot_driver"]["captured_nvidia_driver"] = driver
    validate_artifact(art)  # memory_mib is optional in the platform inventory
    assert admit(art, facts(arch="aarch64", gpus=gpus, nvidia_driver=driver))["row"]
    with pytest.raises(AdmissionError, match=r"GB10|GPU"):
        admit(art, facts(arch="aarch64"))  # an H200 is not the captured GPU


def test_a_host_whose_facts_skipped_criu_check_is_checked_before_admission(gpu_artifact, tmp_path):
    """Facts gathered without ``criu check`` (a quick inventory) never admit an unchecked kernel:
    admission refuses them as they are, and the prepare step runs the check on the host first."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units.admission import with_criu_check

    unchecked = facts(criu={"installed": True, "version": "4.1.1", "check": None, "check_output": None})
    with pytest.raises(AdmissionError, match="'criu check'"):
        admit(gpu_artifact, unchecked)
    failing = tmp_path / "criu"  # a CRIU whose check fails, as on a kernel without a feature it needs
    failing.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo 'Version: 4.1.1'; exit 0; }\n"
                       "echo 'Error (criu/cr-check.c:1234): UFFD is not supported' >&2; exit 1\n")
    failing.chmod(0o755)
    checked = with_criu_check({**unchecked, "criu": {**unchecked["criu"], "binary": str(failing)}})
    assert checked["criu"]["check"] is False
    with pytest.raises(AdmissionError, match="UFFD is not supported"):
        admit(gpu_artifact, checked)
    assert with_criu_check(facts()) == facts(), "a check already made is not run again"
