"""vLLM's packed copies of the CPU linear weights (``coldsnap_engines.vllm.cpu_packed``), with vLLM's own
dispatch in its engine environment: dropped in place before a snapshot (their memory leaves the process),
packed again from the hydrated arena, and the layers compute exactly what they did. In bfloat16, vLLM's
CPU default, where this CPU has AVX-512 (vLLM packs bfloat16 only there); in float32 elsewhere."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from vllm_workload import PACKS_LAYERS

pytestmark = [pytest.mark.vllm]


@pytest.fixture(scope="module")
def result(vllm_engine_python):
    out = subprocess.run([vllm_engine_python, str(Path(__file__).with_name("packed_child.py")),
                          "bfloat16" if PACKS_LAYERS else "float32"],
                         check=False, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_rebuildable_copy_is_found_and_the_stray_one_is_left_alone(result):
    names = [name for name, _kind in result["found"]]
    assert names == ["0", "1", "2", "3"], result["found"]
    kinds = {kind for _name, kind in result["found"]}
    assert kinds <= {"sgl", "onednn"} and "onednn" in kinds


def test_release_frees_the_copies_memory(result):
    assert result["emptied"]
    # Two 4096x2048 copies and more: tens of MiB leave the process before the arena is released.
    assert result["freed"] >= 2 * 4096 * 2048 * result["itemsize"]
    assert result["anon_dropped"] >= result["freed"] * 3 // 4, result


def test_repacked_layers_compute_exactly_what_they_did(result):
    assert result["repacked"] == 4 and result["again"] == 4
    assert all(result["same"]) and all(result["same_again"]), result
