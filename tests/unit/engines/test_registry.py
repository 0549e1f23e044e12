"""Engine rules as data: capture requirements, restore-command normalization, load-format choice."""

from __future__ import annotations

import copy
import json

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.engines import (
    ENGINES,
    VLLM_WORKER_EXTENSION,
    command_issues,
    command_option,
    engine_issues,
    engine_spec,
    normalize_restore_command,
    preferred_load_format,
    semantic_command,
    set_command_option,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request

VLLM_OK = ["vllm", "serve", "/models/m", "--port", "8000", "--enable-sleep-mode", "--sleep-mode-backend", "coldsnap",
           "--worker-extension-cls", VLLM_WORKER_EXTENSION, "--load-format", "instanttensor"]
VLLM_ENV = {"VLLM_PLUGINS": "coldsnap"}
# No sleep-mode flags: vLLM's CPU build refuses them.
VLLM_CPU = ["vllm", "serve", "/models/m", "--port", "8000", "--worker-extension-cls", VLLM_WORKER_EXTENSION,
            "--load-format", "instanttensor", "--served-model-name", "reference-tiny"]


def test_option_parsing_accepts_both_spellings_and_the_last_wins():
    cmd = ["vllm", "serve", "m", "--load_format=pt", "--load-format", "safetensors"]
    assert command_option(cmd, "--load-format") == "safetensors"
    assert command_option(["x", "--load-format=auto"], "--load-format") == "auto"
    assert command_option(["x"], "--load-format") is None
    assert set_command_option(cmd, "--load-format", "coldsnap") == ["vllm", "serve", "m", "--load-format", "coldsnap"]


@pytest.mark.parametrize("cmd", [
    ["vllm", "serve", "m", "--load-format", "instanttensor", "--port", "8000"],
    ["vllm", "serve", "m", "--load_format=fastsafetensors", "--port", "8000"],
    ["vllm", "serve", "m", "--port", "8000"],
])
def test_vllm_restore_commands_are_normalized_to_the_coldsnap_loader(cmd):
    out = normalize_restore_command("vllm", cmd)
    assert command_option(out, "--load-format") == "coldsnap"
    assert out.count("--load-format") == 1 and "--port" in out and out[:3] == cmd[:3]
    assert normalize_restore_command("vllm", out) == out, "idempotent"
    assert semantic_command("vllm", cmd) == semantic_command("vllm", out), "capture and restore compare equal"


def test_other_engines_keep_their_command():
    cmd = ["coldsnap-reference-engine", "--model", "/m"]
    assert normalize_restore_command("reference", cmd) == cmd
    assert normalize_restore_command("sglang", ["python", "-m", "sglang.launch_server"]) == \
        ["python", "-m", "sglang.launch_server"]
    with pytest.raises(ColdSnapError, match="no ColdSnap integration"):
        engine_spec("tgi")


@pytest.mark.parametrize(("configured", "installed", "want"), [
    ("auto", ["fastsafetensors", "instanttensor"], "instanttensor"),
    (None, ["fastsafetensors"], "fastsafetensors"),
    ("safetensors", [], "safetensors"),
    (None, [], "auto"),
    ("fastsafetensors", ["instanttensor"], "fastsafetensors"),  # an explicit fast loader is respected
])
def test_capture_prefers_installed_fast_loaders(configured, installed, want):
    assert preferred_load_format("vllm", configured, installed) == want


def test_a_complete_vllm_capture_command_has_no_issues():
    assert command_issues("vllm", VLLM_OK, VLLM_ENV, gpu=True) == []
    assert command_issues("vllm", VLLM_OK, {"VLLM_PLUGINS": "lora_filesystem_resolver,coldsnap"}, gpu=True) == []
    assert command_issues("vllm", VLLM_CPU, VLLM_ENV) == []


def test_vllm_sleep_mode_flags_on_a_cpu_unit_are_refused_by_name():
    """vLLM's CPU build refuses sleep mode at start: said at validation, not after a failed start."""
    issues = command_issues("vllm", VLLM_OK, VLLM_ENV, gpu=False)
    assert [i[1] for i in issues] == [f"engine 'vllm' on a CPU unit (no devices) does not accept {f}"
                                      for f in ("--enable-sleep-mode", "--sleep-mode-backend")]


def test_a_negated_boolean_flag_counts_as_off_when_it_comes_last():
    """vLLM's boolean options take ``--no-<flag>`` too, and argparse keeps the last word."""
    off = [*VLLM_OK, "--no-enable-sleep-mode"]
    issues = command_issues("vllm", off, VLLM_ENV, gpu=True)
    assert [(i[1], i[2]) for i in issues] == [(
        "engine 'vllm' capture needs --enable-sleep-mode; the command turns it off with --no-enable-sleep-mode",
        "remove --no-enable-sleep-mode from the command")]
    on_again = [*off, "--enable-sleep-mode"]
    assert command_issues("vllm", on_again, VLLM_ENV, gpu=True) == []
    # On a CPU unit sleep mode must be off: a negation that comes last is fine, an earlier one is not.
    assert command_issues("vllm", [*VLLM_CPU, "--no-enable-sleep-mode"], VLLM_ENV) == []
    late = [*VLLM_CPU, "--no-enable-sleep-mode", "--enable-sleep-mode"]
    assert [i[1] for i in command_issues("vllm", late, VLLM_ENV)] == [
        "engine 'vllm' on a CPU unit (no devices) does not accept --enable-sleep-mode"]


@pytest.mark.parametrize(("drop", "needle"), [
    ("--enable-sleep-mode", "needs --enable-sleep-mode"),
    ("--sleep-mode-backend", "needs --sleep-mode-backend coldsnap"),
    ("--worker-extension-cls", f"needs --worker-extension-cls {VLLM_WORKER_EXTENSION}"),
])
def test_vllm_capture_requirements(drop, needle):
    cmd = list(VLLM_OK)
    i = cmd.index(drop)
    del cmd[i: i + (1 if drop == "--enable-sleep-mode" else 2)]
    # Sleep mode (and its backend flag) exists on GPU builds only: required on GPU units.
    issues = command_issues("vllm", cmd, VLLM_ENV, gpu=True)
    assert len(issues) == 1 and needle in issues[0][1]
    if drop != "--worker-extension-cls":  # vLLM's CPU build has no sleep mode: the other flag is refused there
        assert all("does not accept" in i[1] for i in command_issues("vllm", cmd, VLLM_ENV, gpu=False))


def test_vllm_capture_needs_a_safetensors_format_and_the_plugin_allow_list():
    cmd = set_command_option(VLLM_OK, "--load-format", "pt")
    assert "safetensors-backed load format" in command_issues("vllm", cmd, VLLM_ENV, gpu=True)[0][1]
    cmd = set_command_option(VLLM_OK, "--load-format", "coldsnap")
    assert command_issues("vllm", cmd, VLLM_ENV, gpu=True), "capture cannot start from the hydrating loader"
    (field, problem, fix), = command_issues("vllm", VLLM_OK, {}, gpu=True)
    assert field == "environment" and "VLLM_PLUGINS" in problem and fix.startswith("set VLLM_PLUGINS=coldsnap")
    (issue,) = command_issues("vllm", VLLM_OK, {"VLLM_PLUGINS": "other"}, gpu=True)
    problem = issue[1]
    assert "does not name the ColdSnap plugin" in problem


def test_sglang_rules():
    ok = ["python", "-m", "sglang.launch_server", "--model-path", "/m", "--enable-memory-saver"]
    assert command_issues("sglang", ok, {}) == []  # SGLANG_PLUGINS unset loads every plugin
    assert "SGLANG_PLUGINS" in command_issues("sglang", ok, {"SGLANG_PLUGINS": "x"})[0][1]
    issues = command_issues("sglang", [*ok, "--enable-weights-cpu-backup"], {})
    assert "cannot use --enable-weights-cpu-backup" in issues[0][1]
    assert "--enable-memory-saver" in command_issues("sglang", ok[:-1], {})[0][1]
    assert ENGINES["sglang"].materialize_modes == ("off",) and not ENGINES["sglang"].canonical_writer


@pytest.fixture
def reference_request(example_request_text):
    return validate_request(json.loads(example_request_text))


def _as_engine(req: dict, engine: str, command: list[str], env: dict) -> dict:
    req = copy.deepcopy(req)
    req["launch"]["engine"] = engine
    req["launch"]["execution"]["adapter"]["schema"] = ENGINES[engine].adapter_schema
    req["launch"]["units"][0]["command"] = command
    req["launch"]["units"][0]["environment"] = env
    req["policy"]["weights"]["native"]["materialize"] = ENGINES[engine].default_materialize
    return req


def test_engine_issues_point_at_the_unit(reference_request):
    req = _as_engine(reference_request, "vllm", VLLM_CPU, VLLM_ENV)
    assert engine_issues(req) == []
    req["launch"]["units"][0]["environment"] = {}
    paths = [i.path for i in engine_issues(req)]
    assert paths == ["$.launch.units[0].environment"]
    req["operation"] = "restore"  # the rules are capture rules
    assert engine_issues(req) == []


def test_sglang_refuses_materialization_and_more_workers(reference_request):
    cmd = ["python", "-m", "sglang.launch_server", "--enable-memory-saver"]
    req = _as_engine(reference_request, "sglang", cmd, {})
    assert {i.path: i.message for i in engine_issues(req)}["$.launch.units[0].devices"].startswith(
        "engine 'sglang' runs on GPU units only"), "torch_memory_saver is CUDA-only"
    req["launch"]["units"][0]["devices"] = [0]
    req["policy"]["process"]["graph_policy"] = "preserve"
    assert engine_issues(req) == []
    for mode in ("async", "required"):
        req["policy"]["weights"]["native"]["materialize"] = mode
        assert "no canonical model-payload writer" in {i.path: i.message for i in engine_issues(req)}[
            "$.policy.weights.native.materialize"]
    req["policy"]["weights"]["native"]["materialize"] = "off"
    w = req["launch"]["execution"]["workers"]
    w.append({**w[0], "id": "worker-1", "rank": 1})
    msgs = {i.path: i.message for i in engine_issues(req)}
    assert "at most 1 worker" in msgs["$.launch.execution.workers"]


def test_vllm_units_hold_one_worker(reference_request):
    req = _as_engine(reference_request, "vllm", VLLM_OK, VLLM_ENV)
    unit = req["launch"]["units"][0]
    w = req["launch"]["execution"]["workers"]
    w.append({**w[0], "id": "worker-1", "rank": 1})
    req["launch"]["execution"]["groups"][0]["workers"] = ["worker-0", "worker-1"]
    unit["devices"] = []
    issue = {i.path: i for i in engine_issues(req)}["$.launch.units[0]"]
    assert "holds 2 workers (worker-0, worker-1)" in issue.message and "gloo TCP" in issue.message
    assert "tensor parallel size 1" in issue.fix
    # On GPUs vLLM serves both ranks from one server, while the activation starts a process per worker.
    unit["devices"] = ["GPU-0", "GPU-1"]
    w[0]["device_slot"], w[1]["device_slot"] = 0, 1
    issue = {i.path: i for i in engine_issues(req)}["$.launch.units[0]"]
    assert "holds 2 workers" in issue.message and "one server" in issue.message
    assert "one worker per unit" in issue.fix
    # The reference engine runs a process per rank: a unit may hold both.
    req["launch"]["engine"] = "reference"
    assert "$.launch.units[0]" not in {i.path for i in engine_issues(req)}


@pytest.mark.parametrize("spelling", [["--tensor-parallel-size", "2"], ["--tensor-parallel-size=2"], ["-tp", "2"]])
def test_a_tensor_parallel_size_that_is_not_the_units_worker_count_is_refused(reference_request, spelling):
    req = _as_engine(reference_request, "vllm", [*VLLM_CPU, *spelling], VLLM_ENV)
    (issue,) = engine_issues(req)
    assert issue.path == "$.launch.units[0].command" and "which holds 1 worker(s)" in issue.message
    assert "set " in issue.fix and " 1 " in issue.fix
    req["launch"]["units"][0]["command"] = [*VLLM_CPU, spelling[0].split("=")[0], "1"]
    assert engine_issues(req) == []


@pytest.mark.parametrize(("abbreviated", "full"), [
    (["--tensor-parallel", "2"], "--tensor-parallel-size"),
    (["-t", "2"], "-tp"),
    (["--load-form", "dummy"], "--load-format"),
    (["--load_form=dummy"], "--load-format"),
    (["--po", "9000"], "--port"),
    (["--enable-sleep"], "--enable-sleep-mode"),
    (["--served-mo", "x"], "--served-model-name"),
    (["--api-k", "sk-1"], "--api-key"),
    (["-as", "2"], "-asc"),
])
def test_vllm_option_abbreviations_are_refused_by_their_full_name(abbreviated, full):
    # vLLM's parser (argparse, allow_abbrev) takes any unambiguous prefix: the rules would read nothing.
    issues = command_issues("vllm", [*VLLM_CPU, *abbreviated], VLLM_ENV)
    assert any("abbreviates" in problem and f"spell out {full}" == fix for _where, problem, fix in issues), issues


@pytest.mark.parametrize(("extra", "flag"), [
    (["--uds", "/run/v.sock"], "--uds"),
    (["--ssl-keyfile", "/k", "--ssl-certfile", "/c"], "--ssl-keyfile"),
    (["--headless"], "--headless"),
    (["--grpc"], "--grpc"),
    (["--config", "/etc/vllm.yaml"], "--config"),
    (["--data-parallel-size", "2"], "--data-parallel-size"),
    (["-dp", "2"], "--data-parallel-size"),
    (["--pipeline_parallel_size=2"], "--pipeline-parallel-size"),
    (["-pcp", "2"], "--prefill-context-parallel-size"),
    (["--nnodes", "2"], "--nnodes"),
    (["--api-server-count", "2"], "--api-server-count"),
    (["--distributed-executor-backend", "ray"], "--distributed-executor-backend"),
])
def test_vllm_options_a_capture_cannot_follow_are_refused_by_name(extra, flag):
    issues = command_issues("vllm", [*VLLM_CPU, *extra], VLLM_ENV)
    assert any(f"cannot use {flag}" in problem and flag in fix for _where, problem, fix in issues), issues


@pytest.mark.parametrize("extra", [
    ["--data-parallel-size", "1"], ["-pp", "1"], ["--api-server-count=1"], ["--distributed-executor-backend", "mp"],
    ["--root-path", "/v1-proxy"], ["--kv-transfer-config", '{"kv_connector": "X"}'], ["--max-model-len", "256"],
])
def test_vllm_options_a_capture_follows_are_not_refused(extra):
    assert command_issues("vllm", [*VLLM_CPU, *extra], VLLM_ENV) == []


def test_tensor_parallel_spellings_are_one_option_whose_last_spelling_wins(reference_request):
    req = _as_engine(reference_request, "vllm", [*VLLM_CPU, "-tp", "2", "--tensor-parallel-size", "1"], VLLM_ENV)
    assert engine_issues(req) == [], "vLLM runs one rank: the later spelling wins"
    req["launch"]["units"][0]["command"] = [*VLLM_CPU, "--tensor-parallel-size", "1", "-tp", "2"]
    (issue,) = engine_issues(req)
    assert issue.message.startswith("-tp '2'")


def test_vllm_plugins_is_split_at_commas_without_trimming():
    # vLLM's envs.VLLM_PLUGINS is os.environ["VLLM_PLUGINS"].split(","): " coldsnap" names no plugin.
    (issue,) = command_issues("vllm", VLLM_CPU, {"VLLM_PLUGINS": "lora_filesystem_resolver, coldsnap"})
    assert issue[0] == "environment" and "keeps blanks" in issue[1] and "without blanks" in issue[2]
    assert command_issues("vllm", VLLM_CPU, {"VLLM_PLUGINS": "lora_filesystem_resolver,coldsnap"}) == []


@pytest.mark.parametrize(("command", "served_as"), [
    (VLLM_CPU[:-2], "/models/m"),
    (["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/m", "--port", "8000",
      "--worker-extension-cls", VLLM_WORKER_EXTENSION], "/models/m"),
])
def test_without_a_served_name_vllm_serves_the_model_under_its_path(reference_request, command, served_as):
    req = _as_engine(reference_request, "vllm", command, VLLM_ENV)
    req["workload"]["served_model_name"] = "m"
    (issue,) = engine_issues(req)
    assert issue.path == "$.workload.served_model_name" and repr(served_as) in issue.message
    assert "--served-model-name m" in issue.fix
    req["workload"]["served_model_name"] = served_as
    assert engine_issues(req) == []
    req["launch"]["units"][0]["command"] = [*command, "--served-model-name", "m"]
    req["workload"]["served_model_name"] = "m"
    assert engine_issues(req) == []


def test_the_coldsnap_loader_accepts_the_extra_config_the_capture_loader_took():
    from coldsnap_engines.vllm.loader import EXTRA_CONFIG_KEY, unexpected_extra_config

    # A restore keeps the captured --model-loader-extra-config; vLLM's default loader accepted these keys.
    assert unexpected_extra_config({"num_threads": 4, "enable_multithread_load": True}) == set()
    assert unexpected_extra_config({EXTRA_CONFIG_KEY: "/spec.json"}) == set()
    assert unexpected_extra_config(None) == set()
    assert unexpected_extra_config({"other": 1}) == {"other"}
