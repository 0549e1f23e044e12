"""ColdSnap's vLLM and SGLang integrations against the REAL engine sources (pinned versions).

The environment comes from scripts/engine-contract-env.sh (cached; CI builds it when absent,
outside CI the tests skip with the command to run). Each probe runs in its own interpreter so
vLLM's dependencies never reach this test process.
"""

from __future__ import annotations

import json

import pytest
from engines_testlib import REPO, engine_env_root, run_probe

PROBES = REPO / "tests" / "unit" / "engines" / "probes"
VLLM_CHECKS = [
    "version_is_pinned",
    "register_is_idempotent_and_registers_the_coldsnap_format",
    "observing_loader_wraps_the_safetensors_backed_formats",
    "default_loader_internals_the_observer_relies_on",
    "observer_classifies_a_load_through_vllms_own_safetensors_iterator",
    "sleep_backend_registers_as_a_cumem_backend",
    "model_config_selects_backend_and_extension",
    "worker_extension_mixes_into_the_gpu_worker",
    "engine_client_offers_every_call_the_control_plane_makes",
    "endpoint_plugin_satisfies_the_protocol",
    "entry_point_groups_are_vllms",
    "cumem_allocation_data_maps_to_the_allocation_table",
]
SGLANG_CHECKS = [
    "versions_are_pinned",
    "entry_point_group_is_sglangs",
    "register_installs_hooks_on_existing_targets",
    "hooked_functions_have_the_signatures_the_hooks_assume",
    "scheduler_api_used_by_the_control_plane",
    "memory_regions_are_the_three_tags",
    "server_flags_named_by_the_engine_rules_exist",
    "torch_memory_saver_api",
]


@pytest.fixture(scope="module")
def env_root():
    root = engine_env_root()
    if root is None:
        pytest.skip("the real-engine contract environment is not built: run bash scripts/engine-contract-env.sh")
    return root


def _results(proc) -> dict:
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, f"probe failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def vllm_results(env_root):
    return _results(run_probe(PROBES / "vllm_probe.py", [env_root / "vllm", env_root / "site"]))


@pytest.fixture(scope="module")
def sglang_results(env_root):
    return _results(run_probe(PROBES / "sglang_probe.py", [env_root / "site"], str(env_root)))


@pytest.mark.slow
@pytest.mark.parametrize("name", VLLM_CHECKS)
def test_vllm_contract(vllm_results, name):
    assert vllm_results.get(name) == "ok", vllm_results.get(name, "check did not run")


@pytest.mark.slow
@pytest.mark.parametrize("name", SGLANG_CHECKS)
def test_sglang_contract(sglang_results, name):
    assert sglang_results.get(name) == "ok", sglang_results.get(name, "check did not run")


def test_every_probe_check_is_asserted(vllm_results, sglang_results):
    assert sorted(vllm_results) == sorted(VLLM_CHECKS)
    assert sorted(sglang_results) == sorted(SGLANG_CHECKS)
