"""Fixtures shared by the vLLM tests (runtime host and docker): the engine environment with a tiny
Hugging Face Llama made offline, and what that server answers when a user starts it cold."""

from __future__ import annotations

import json
import subprocess

import pytest
from vllm_workload import kill_tree, openai_answers, start_cold_server


@pytest.fixture(scope="session")
def vllm(vllm_engine_python, tmp_path_factory):
    """The engine environment, a tiny Hugging Face Llama made offline, and its environment digest."""
    python = vllm_engine_python
    model_dir = tmp_path_factory.mktemp("models") / "llama-tiny"
    out = subprocess.run([python, "-m", "coldsnap_engines.hf_models", "--out", str(model_dir), "--preset", "tiny"],
                         check=True, capture_output=True, text=True)
    ident = json.loads(out.stdout)
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units import environment

    return python, model_dir, ident, environment.of_python(python)


@pytest.fixture(scope="session")
def cold_answers(vllm, tmp_path_factory):
    """What the server answers when a user starts it without ColdSnap."""
    python, model_dir, _ident, _digest = vllm
    log = tmp_path_factory.mktemp("cold") / "vllm.log"
    proc, port = start_cold_server(python, model_dir, log)
    try:
        return openai_answers(port)
    finally:
        kill_tree(proc.pid)
        proc.wait()
