"""Request format 4: every rejection class names the JSON path and the fix; round trips hold."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import FormatError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.canonical import canonical_json
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.engines import engine_issues
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import (
    identity,
    load_request,
    request_sha256,
    validate_request,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.strictjson import strict_loads

import coldsnap  # noqa: F401  # pylint: disable=unused-import


@pytest.fixture
def base(example_request_text) -> dict:
    return json.loads(example_request_text)


def problems(value) -> dict[str, str]:
    """{json path: message + fix} of a rejected request."""
    with pytest.raises(FormatError) as exc:
        validate_request(strict_loads(json.dumps(value)) if not isinstance(value, str) else strict_loads(value))
    return {i.path: f"{i.message} | {i.fix}" for i in exc.value.issues}


def test_reference_request_and_shared_example_are_accepted(base, example_request_text):
    # tests/conftest.py's SHARED_EXAMPLES; `from conftest import` would find whichever conftest came first
    shared_examples = Path(__file__).resolve().parents[3].parent / "shared" / "examples"

    req = load_request(example_request_text)
    assert req["launch"]["units"][0]["id"] == "unit-0"
    shared = shared_examples / "request-capture-reference.json"
    if shared.exists():  # the shape the project promises to keep valid
        load_request(shared.read_text())


def test_normalization_fills_driver_and_engine_defaults(base):
    del base["policy"]
    req = validate_request(base)
    assert req["policy"]["process"]["backend"] == "cuda-criu"  # n610's contract row
    assert req["policy"]["weights"]["mode"] == "auto"
    assert req["policy"]["weights"]["native"]["materialize"] == "async"  # reference engine default
    assert req["policy"]["weights"]["recovery"]["source"] == "local-safetensors"
    assert req["policy"]["retention"]["generations"] == 3
    # Normalized output is a fixed point.
    assert validate_request(copy.deepcopy(req)) == req


def test_round_trip_and_digest_are_stable(base):
    a = validate_request(base)
    b = load_request(json.dumps(base, indent=4, sort_keys=True))
    assert a == b
    assert request_sha256(a) == request_sha256(b)
    assert canonical_json(a) == canonical_json(b)
    assert identity(a).startswith("sha256:")


def test_unknown_fields_at_any_depth(base):
    base["surprise"] = 1
    base["launch"]["units"][0]["mounts"][0]["propagation"] = "rshared"
    base["policy"]["weights"]["native"]["exprot"] = True
    p = problems(base)
    assert "unknown field 'surprise'" in p["$.surprise"]
    assert "$.launch.units[0].mounts[0].propagation" in p
    assert "did you mean 'export'" in p["$.policy.weights.native.exprot"]
    assert "remove it" in p["$.surprise"]


def test_duplicate_keys_are_reported_at_their_path(example_request_text):
    text = example_request_text.replace('"OMP_NUM_THREADS": "2"', '"OMP_NUM_THREADS": "2", "OMP_NUM_THREADS": "4"')
    p = problems(text)
    assert "duplicate key 'OMP_NUM_THREADS'" in p["$.launch.units[0].environment.OMP_NUM_THREADS"]


def test_trailing_data_is_refused(example_request_text):
    with pytest.raises(FormatError) as exc:
        load_request(example_request_text + "\n{}")
    assert "trailing data" in str(exc.value)
    with pytest.raises(FormatError):
        load_request(example_request_text + " garbage")
    load_request(example_request_text + "\n\n  ")  # whitespace is fine


def test_wrong_types_and_missing_required(base):
    base["launch"]["units"][0]["index"] = "0"
    base["validation"]["max_tokens"] = True
    del base["launch"]["model"]["revision"]
    del base["workload"]
    p = problems(base)
    assert "expected an integer, got string" in p["$.launch.units[0].index"]
    assert "expected an integer, got boolean" in p["$.validation.max_tokens"]
    assert "missing required field 'revision'" in p["$.launch.model.revision"]
    assert "add 'workload'" in p["$.workload"]


def test_non_finite_numbers_and_invalid_json():
    with pytest.raises(FormatError, match="non-finite"):
        load_request('{"format": NaN}')
    with pytest.raises(FormatError, match="line 1"):
        load_request('{"format": 4,}')
    for empty in ("", " \n", b""):
        with pytest.raises(FormatError, match=r"\$: is empty"):
            load_request(empty)


@pytest.mark.parametrize("image", ["registry.example/coldsnap/runtime:latest", "runtime", "runtime@sha256:abc",
                                   "runtime@sha256:" + "A" * 64, "runtime@md5:" + "a" * 32])
def test_mutable_image_references_are_refused(base, image):
    base["launch"]["runtime"] = "docker"
    unit = base["launch"]["units"][0]
    del unit["environment_digest"]
    unit["image"] = image
    p = problems(base)
    assert "pin the image by digest" in p["$.launch.units[0].image"]


def test_digest_pinned_image_is_accepted(base):
    base["launch"]["runtime"] = "docker"
    unit = base["launch"]["units"][0]
    del unit["environment_digest"]
    unit["image"] = "registry.example:5000/coldsnap/runtime:1.0@sha256:" + "ab" * 32
    assert validate_request(base)["launch"]["units"][0]["image"].endswith("ab" * 32)


@pytest.mark.parametrize("rev", ["main", "v1.0", "6f1c2b7", "6F1C2B7D9E0A4C3B8F5E1D2A7C9B0E4F3A6D8C1B"])
def test_model_revision_must_be_an_immutable_commit(base, rev):
    base["launch"]["model"]["revision"] = rev
    p = problems(base)
    assert "immutable" in p["$.launch.model.revision"]


def test_worker_on_undeclared_unit(base):
    base["launch"]["execution"]["workers"][0]["unit"] = "unit-9"
    p = problems(base)
    assert "undeclared unit 'unit-9'" in p["$.launch.execution.workers[0].unit"]


def test_duplicate_ids(base):
    units = base["launch"]["units"]
    units.append(copy.deepcopy(units[0]))
    units[1]["index"] = 1
    workers = base["launch"]["execution"]["workers"]
    workers.append({**workers[0], "rank": 1})
    p = problems(base)
    assert "duplicate unit id 'unit-0'" in p["$.launch.units[1].id"]
    assert "duplicate worker id 'worker-0'" in p["$.launch.execution.workers[1].id"]


def test_device_slot_out_of_range_and_missing(base):
    unit = base["launch"]["units"][0]
    unit["devices"] = [0]
    base["launch"]["execution"]["workers"][0]["device_slot"] = 1
    p = problems(base)
    assert "slot 1 is out of range" in p["$.launch.execution.workers[0].device_slot"]
    base["launch"]["execution"]["workers"][0]["device_slot"] = None
    p = problems(base)
    assert "has GPUs but the worker has no device slot" in p["$.launch.execution.workers[0].device_slot"]


def test_ranks_indexes_groups_services(base):
    base["launch"]["execution"]["workers"][0]["rank"] = 3
    base["launch"]["units"][0]["index"] = 2
    base["launch"]["execution"]["groups"][0]["workers"].append("ghost")
    base["launch"]["execution"]["services"][0]["unit"] = "nowhere"
    p = problems(base)
    assert "not 0..0" in p["$.launch.execution.workers"]
    assert "position 0" in p["$.launch.units[0].index"]
    assert "unknown worker 'ghost'" in p["$.launch.execution.groups[0].workers[1]"]
    assert "undeclared unit 'nowhere'" in p["$.launch.execution.services[0].unit"]


def test_operation_needs(base):
    del base["output"]
    p = problems(base)
    assert "capture needs an output directory" in p["$.output"]
    base = json.loads(json.dumps(base))
    base["operation"] = "restore"
    p = problems(base)
    assert "needs the committed artifact" in p["$.artifact"]


def test_cache_paths_never_overlap_model_mounts(base):
    base["policy"]["cache"]["paths"] = ["/var/lib/coldsnap/models/reference-tiny/cache", "/root/.cache/huggingface"]
    p = problems(base)
    assert "overlaps mount" in p["$.policy.cache.paths[0]"]
    assert "Hugging Face cache" in p["$.policy.cache.paths[1]"]


def test_runtime_specific_pins(base):
    del base["launch"]["units"][0]["environment_digest"]
    p = problems(base)
    assert "environment_digest" in p["$.launch.units[0].environment_digest"]


def test_warm_refused_for_the_driver_without_that_boundary(base):
    base["operation"] = "warm"
    base["snapshot_driver"]["id"] = "n580"
    base["policy"]["process"]["backend"] = "criu"
    del base["output"]
    base["artifact"] = {"path": "/var/lib/coldsnap/artifacts/x/artifact.json"}
    p = problems(base)
    assert "no warm-restore boundary" in p["$.operation"]


def test_engine_rules_live_in_the_registry(base):
    req = validate_request(base)
    req["launch"]["engine"] = "sglang"
    req["launch"]["execution"]["adapter"]["schema"] = "sglang-v1"
    req["policy"]["weights"]["native"]["materialize"] = "async"
    issues = {i.path: i.message for i in engine_issues(req)}
    assert "no canonical model-payload writer" in issues["$.policy.weights.native.materialize"]


def test_every_problem_is_reported_at_once(base):
    base["format"] = 3
    base["kind"] = "request"
    base["launch"]["engine"] = "vlm"
    p = problems(base)
    assert {"$.format", "$.kind", "$.launch.engine"} <= set(p)
    assert "did you mean 'vllm'" in p["$.launch.engine"]


def test_n580_on_gpu_units_needs_a_template_capture(base, monkeypatch):
    import dataclasses

    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import engines

    base["snapshot_driver"]["id"] = "n580"
    base["policy"]["process"]["backend"] = "criu"
    base["launch"]["units"][0]["devices"] = [0]
    base["launch"]["execution"]["workers"][0]["device_slot"] = 0
    engine = base["launch"]["engine"]
    assert engines.ENGINES[engine].template_capture  # the reference engine stops as a template
    assert not engine_issues(validate_request(base))
    # An engine without one: the engine's rules are part of the one request validation (CLI, modules, Python).
    monkeypatch.setitem(engines.ENGINES, engine, dataclasses.replace(engines.ENGINES[engine], template_capture=False))
    issues = problems(base)
    assert "pre-CUDA template capture" in issues["$.snapshot_driver.id"]
    base["launch"]["units"][0]["devices"] = []
    base["launch"]["execution"]["workers"][0]["device_slot"] = None
    assert not engine_issues(validate_request(base))


@pytest.mark.parametrize("name", ["HF_TOKEN", "API_PASSWORD", "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY",
                                  "PGPASSWORD", "MYSQL_PWD", "GHTOKEN"])
def test_secrets_in_a_unit_environment_are_refused_with_the_way_to_pass_them(base, name):
    base["launch"]["units"][0]["environment"][name] = "hunter2"
    p = problems(base)
    where = f"$.launch.units[0].environment.{name}"
    assert "credential" in p[where] and "--secret-env" in p[where]
    assert "hunter2" not in json.dumps(p), "the value itself is never echoed"


@pytest.mark.parametrize("name", ["TOKENIZERS_PARALLELISM", "KEYBOARD_LAYOUT", "OMP_NUM_THREADS", "PASSTHROUGH_MODE",
                                  "PWD"])
def test_ordinary_names_that_contain_credential_words_are_accepted(base, name):
    base["launch"]["units"][0]["environment"][name] = "1"
    validate_request(base)


@pytest.mark.parametrize("value", ["http://alice:hunter2@proxy.internal:3128", "postgres://app:hunter2@db/app",
                                   "redis://:hunter2@cache:6379/0"])
def test_a_url_with_a_password_in_a_unit_environment_is_refused_whatever_its_name(base, value):
    base["launch"]["units"][0]["environment"]["HTTPS_PROXY"] = value
    p = problems(base)
    where = "$.launch.units[0].environment.HTTPS_PROXY"
    assert "password" in p[where] and "--secret-env" in p[where]
    assert "hunter2" not in json.dumps(p), "the value itself is never echoed"
    base["launch"]["units"][0]["environment"]["HTTPS_PROXY"] = "http://alice@proxy.internal:3128"
    validate_request(base)


def test_hostile_nesting_is_a_clear_format_error_not_a_crash():
    with pytest.raises(FormatError) as exc:
        strict_loads("[" * 100_000 + "]" * 100_000)
    assert "levels deep" in str(exc.value)


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("kv_discard", False, "KV cache in a snapshot is not implemented"),
    ("artifact_scope", "target-local", "target-local captures are not implemented"),
])
def test_process_policy_values_that_are_not_implemented_are_refused(base, field, value, needle):
    base["policy"]["process"][field] = value
    p = problems(base)
    assert needle in p[f"$.policy.process.{field}"] and "leave it out" in p[f"$.policy.process.{field}"]


def test_process_policy_backend_and_graphs_follow_the_snapshot_driver(base):
    gpu = copy.deepcopy(base)
    gpu["launch"]["units"][0]["devices"] = [0]
    gpu["launch"]["execution"]["workers"][0]["device_slot"] = 0
    gpu["policy"]["process"]["backend"] = "criu"
    assert "plain CRIU cannot dump" in problems(gpu)["$.policy.process.backend"]
    template = copy.deepcopy(validate_request(base))
    template["snapshot_driver"]["id"] = "n580"
    template["policy"]["process"].update(backend="criu", graph_policy="preserve")
    found = problems(template)["$.policy.process.graph_policy"]
    assert "no graphs to preserve" in found and "leave policy.process out" in found
    template["policy"]["process"]["graph_policy"] = "recreate-from-plan"
    assert validate_request(template)["policy"]["process"]["graph_policy"] == "recreate-from-plan"
    cpu = copy.deepcopy(base)
    cpu["policy"]["process"]["backend"] = "criu"
    assert validate_request(cpu)["policy"]["process"]["backend"] == "criu", "a CPU unit may use plain CRIU"


def test_graph_recreation_is_refused_for_gpu_units_of_engines_that_keep_their_cuda_graphs():
    vllm = json.loads((Path(__file__).resolve().parents[3] / "examples" / "vllm" / "capture.json").read_text())
    vllm.setdefault("policy", {}).setdefault("process", {})["graph_policy"] = "recreate-from-plan"
    assert validate_request(copy.deepcopy(vllm))["policy"]["process"]["graph_policy"] == "recreate-from-plan", \
        "vLLM on CPU captures no CUDA graphs: nothing to re-create"
    vllm["launch"]["units"][0]["devices"] = [0]
    vllm["launch"]["execution"]["workers"][0]["device_slot"] = 0
    vllm["policy"]["process"]["backend"] = "cuda-criu"
    found = problems(vllm)["$.policy.process.graph_policy"]
    assert "engine 'vllm' keeps the CUDA graphs of its GPU workers" in found and "implemented for reference" in found
    assert "set graph_policy 'preserve'" in found


def test_only_several_units_or_workers_need_the_coordinator(example_request_text):
    from ansible_collections.coldsnap.fleet.plugins.filter.coldsnap import FilterModule
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import needs_coordinator

    needs = FilterModule().filters()["needs_coordinator"]
    req = json.loads(example_request_text)
    one = {**req, "launch": {**req["launch"], "units": req["launch"]["units"][:1],
                             "execution": {**req["launch"]["execution"],
                                           "workers": req["launch"]["execution"]["workers"][:1]}}}
    assert needs(one) is False and needs_coordinator(one) is False
    two_units = {**one, "launch": {**one["launch"], "units": [*one["launch"]["units"], {"id": "unit-1"}]}}
    assert needs(two_units) is True
    two_workers = {**one, "launch": {**one["launch"], "execution": {
        **one["launch"]["execution"], "workers": [*one["launch"]["execution"]["workers"], {"id": "worker-1"}]}}}
    assert needs(two_workers) is True
    from ansible.errors import AnsibleFilterError

    with pytest.raises(AnsibleFilterError, match="needs_coordinator: expected the ColdSnap request"):
        needs("not a request")


@pytest.mark.parametrize("source", ["/", "/etc", "/proc/1", "/var/run/docker.sock", "/run/containerd/containerd.sock",
                                    "/sys", "/dev/sda", "/root",
                                    # a parent of a listed tree, below /run or /boot, a credential directory
                                    "/var", "/run/user/0", "/boot/grub", "/root/.ssh", "/home/ops/.docker"])
def test_a_mount_of_a_host_tree_or_the_container_engine_is_refused(base, source):
    base["launch"]["units"][0]["mounts"] = [{"source": source, "target": "/mnt/x", "read_only": False}]
    with pytest.raises(FormatError, match=r"mounts\[0\]\.source.*would give the unit"):
        validate_request(base)


@pytest.mark.parametrize("source", ["//etc", "//proc", "/models//../etc"])
def test_a_mount_spelled_with_extra_slashes_is_refused_as_not_normalized(base, source):
    base["launch"]["units"][0]["mounts"] = [{"source": source, "target": "/mnt/x", "read_only": True}]
    with pytest.raises(FormatError, match=r"mounts\[0\]\.source.*not a normalized path"):
        validate_request(base)


@pytest.mark.parametrize("path", ["/var/run", "/etc", "/root", "/"])
def test_a_model_source_that_is_a_host_tree_is_refused_like_a_mount(base, path):
    """A docker unit binds the model source when no mount covers it: the same rule as a mount's source."""
    base["launch"]["model"]["source"]["path"] = path
    with pytest.raises(FormatError, match=r"\$\.launch\.model\.source\.path.*would give the unit"):
        validate_request(base)


def test_a_mount_of_a_model_directory_is_fine(base):
    base["launch"]["units"][0]["mounts"] = [{"source": "/root/models/tiny", "target": "/mnt/x", "read_only": True}]
    validate_request(base)


def test_free_text_that_would_swamp_every_task_result_is_refused_by_name(base):
    base["validation"]["prompt"] = "x" * 65537
    with pytest.raises(FormatError, match=r"\$\.validation\.prompt.*longer than 65536 characters"):
        validate_request(base)
    base["validation"]["prompt"] = "x" * 65536
    base["launch"]["units"][0]["command"] = [*base["launch"]["units"][0]["command"], "y" * 131073]
    with pytest.raises(FormatError, match=r"command\[\d+\].*longer than 131072 characters"):
        validate_request(base)


@pytest.mark.parametrize(("path", "needle"), [
    # credential directories, wherever the home is, and a user's home itself
    ("/root/.ssh", "credentials (.ssh)"), ("/home/alice/.aws", "credentials (.aws)"),
    ("/root/.config/gcloud", "credentials (.config)"), ("/home/alice", "home directory"),
    # mounted secrets and the state root's operation data (tokens, runner data, artifacts)
    ("/run/secrets", "mounted secrets"), ("/var/run/secrets/kubernetes.io", "mounted secrets"),
    ("/var/lib/coldsnap/runs", "operation data"), ("/var/lib/coldsnap/artifacts/x", "operation data"),
    ("/var/lib/docker", "container engine"),
    # where a host restore never writes caches: the capture would validate but never restore
    ("/etc/ssh", "system tree '/etc'"), ("/etc/ssl/private", "system tree '/etc'"),
    ("/usr/lib", "system tree '/usr'"), ("/lib32/x", "system tree '/lib32'"),
])
def test_cache_paths_that_hold_secrets_or_system_trees_are_refused(base, path, needle):
    base["policy"]["cache"]["paths"] = ["/root/.cache/vllm", path]
    p = problems(base)
    assert list(p) == ["$.policy.cache.paths[1]"], p
    assert needle in p["$.policy.cache.paths[1]"] and "remove this path from policy.cache.paths" in \
        p["$.policy.cache.paths[1]"]


@pytest.mark.parametrize("path", ["/root/.cache/vllm", "/root/.cache/vllm/torch_compile_cache", "/var/cache/triton",
                                  "/home/alice/.cache/vllm", "/var/lib/coldsnap/compile-cache", "/srv/cache"])
def test_engine_cache_paths_stay_allowed(base, path):
    base["policy"]["cache"]["paths"] = [path]
    assert validate_request(base)["policy"]["cache"]["paths"] == [path]


def test_the_restore_refusal_and_the_validation_share_one_list():
    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import build
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import capsule_paths

    assert build.NO_HOST_CACHE_UNDER is capsule_paths.NO_HOST_CACHE_UNDER
    for tree in capsule_paths.NO_HOST_CACHE_UNDER:
        assert capsule_paths.cache_path_problems([tree + "/cache"], []), tree


@pytest.mark.parametrize("args", [["--api-key", "sk-SECRET"], ["--api-key=sk-SECRET"], ["--hf-token", "hf_x"],
                                  ["--hf_token=hf_x"], ["--password", "hunter2"], ["--auth-token", "t"],
                                  ["--admin-api-key", "k"], ["--access_token", "t"], ["--secret", "s"]])
def test_credentials_on_a_units_command_line_are_refused_like_in_its_environment(base, args):
    command = base["launch"]["units"][0]["command"]
    j = len(command)
    command.extend(args)
    p = problems(base)
    where = f"$.launch.units[0].command[{j}]"
    assert list(p) == [where], p
    assert args[0].split("=")[0] in p[where] and "credential" in p[where] and "--secret-env" in p[where]
    assert "SECRET" not in json.dumps(p) and "hf_x" not in json.dumps(p), "the value itself is never echoed"


@pytest.mark.parametrize("args", [["--model-url=https://u:UrlPassw0rd7@host/m"], ["--db", "postgres://u:DbPassw0rd9@db/x"],
                                  ["--", "https://u:UrlPassw0rd7@host/m"]])
def test_a_url_with_a_password_on_a_units_command_line_is_refused_like_in_its_environment(base, args):
    command = base["launch"]["units"][0]["command"]
    j = len(command) + len(args) - 1
    command.extend(args)
    p = problems(base)
    where = f"$.launch.units[0].command[{j}]"
    assert list(p) == [where], p
    assert "URL with a password" in p[where] and "take the password out of the URL" in p[where]
    assert "Passw0rd" not in json.dumps(p), "the value itself is never echoed"


def test_engine_flags_that_count_tokens_are_not_credentials(base):
    base["launch"]["units"][0]["command"].extend([
        "--max-tokens", "16", "--max-num-batched-tokens", "8192", "--tokenizer", "/m", "--tokenizer-mode", "auto",
        "--skip-tokenizer-init", "--max-model-len", "4096", "--served-model-name", base["workload"]["served_model_name"],
        "--long-prefill-token-threshold", "64", "--return-tokens-as-token-ids", "--speculative-token-map", "/m/t",
        "--max-total-tokens=1024", "--ssl-keyfile", "/etc/k.pem", "--private-shm", "--key-value-cache-dtype", "auto",
        "--", "--api-key"])
    validate_request(base)


@pytest.mark.parametrize("example", ["reference/capture.json", "reference/restore.json", "vllm/restore.json"])
def test_a_served_model_name_the_command_does_not_serve_is_refused(example):
    # The restored server serves the captured names: a restore asking for another fails in prepare, not
    # after the eviction with the validation's 404.
    base = json.loads((Path(__file__).resolve().parents[3] / "examples" / example).read_text())
    base["workload"]["served_model_name"] = "llama-prod"
    base["launch"]["units"][0]["command"] += ["--served-model-name", "llama-canary", "llama-dev"]
    p = problems(base)
    assert "'llama-prod' is not a name the server of unit 'unit-0' serves" in p["$.workload.served_model_name"]
    assert list(p) == ["$.workload.served_model_name"]
    assert "'llama-prod' is not a name the server of unit 'unit-0' serves" in p["$.workload.served_model_name"]
    assert "set workload.served_model_name to 'llama-canary'" in p["$.workload.served_model_name"]


@pytest.mark.parametrize("command", [["--served-model-name", "a", "llama-prod"], ["--served-model-name=llama-prod"],
                                     ["--served-model-name", "x", "--served_model_name", "llama-prod", "--port", "8000"],
                                     []])
def test_a_served_model_name_among_the_commands_names_passes(base, command):
    base["workload"]["served_model_name"] = "llama-prod"
    base["launch"]["units"][0]["command"] += command
    validate_request(base)


@pytest.mark.parametrize("source", ["/home", "/home/alice", "/var/lib/docker", "/var/lib/docker/volumes/m/_data",
                                    "/var/lib/containerd", "/var/lib/coldsnap", "/var/lib/coldsnap/runs/op-1",
                                    "/var/lib/coldsnap/workloads", "/var/lib", "/run/secrets"])
def test_a_mount_that_holds_credentials_is_refused(base, source):
    base["launch"]["units"][0]["mounts"] = [{"source": source, "target": "/mnt/x", "read_only": True}]
    p = problems(base)
    assert "would give the unit" in p["$.launch.units[0].mounts[0].source"]
    assert "mount the model's own directory" in p["$.launch.units[0].mounts[0].source"]


@pytest.mark.parametrize("source", ["/home/alice/models/tiny", "/var/lib/coldsnap/models/tiny",
                                    "/var/lib/coldsnap/hf-cache", "/var/lib/models"])
def test_a_model_directory_below_a_home_or_the_state_root_is_still_mountable(base, source):
    base["launch"]["units"][0]["mounts"] = [{"source": source, "target": "/mnt/x", "read_only": True}]
    validate_request(base)


def test_messages_name_json_values_and_a_missing_kind_as_missing(base):
    base["format"] = None
    del base["launch"]["model"]["source"]["kind"]
    p = problems(base)
    assert "got null" in p["$.format"], p
    assert "missing required field 'kind'" in p["$.launch.model.source.kind"], p
    base["format"] = True
    assert "got true" in problems(base)["$.format"]


@pytest.mark.parametrize(("edit", "field"), [
    (lambda r: r["launch"]["execution"]["services"][0].__setitem__("address", "localhost"),
     "$.launch.execution.services[0].address"),
    (lambda r: r["launch"]["units"][0]["command"].extend(["--host", "gpu-a.example"]), "$.launch.units[0].command[6]"),
    (lambda r: r["launch"]["units"][0]["command"].append("--host=localhost"), "$.launch.units[0].command[5]"),
])
def test_a_host_name_where_a_restore_moves_listeners_by_address_is_refused(edit, field):
    """CRIU records listeners by number: a name would match none of them on a restore onto another address."""
    import copy
    import json
    from pathlib import Path

    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import FormatError

    doc = json.loads((Path(__file__).resolve().parents[3] / "examples" / "reference" / "capture.json").read_text())
    doc = copy.deepcopy(doc)
    edit(doc)
    with pytest.raises(FormatError) as err:
        validate_request(doc)
    assert any(i.path == field and "is not an IP address" in i.message for i in err.value.issues), err.value


@pytest.mark.parametrize("operation", ["capture", "restore", "warm", "wake"])
def test_an_operation_that_validates_needs_a_service_to_ask(base, operation):
    # Without a service no unit probes or asks anything: a capture would commit an "accepted" artifact
    # whose acceptance reply nobody checked.
    base["operation"] = operation
    if operation != "capture":
        base.pop("output")
        base["artifact"] = {"path": "/var/lib/coldsnap/artifacts/x/artifact.json"}
    base["launch"]["execution"]["services"] = []
    p = problems(base)
    assert "no service says where the engine serves" in p["$.launch.execution.services"]
    assert "add the service the validation request goes to" in p["$.launch.execution.services"]


def test_operations_that_ask_the_engine_nothing_need_no_service(base):
    base["operation"] = "sleep"
    base.pop("output")
    base["launch"]["execution"]["services"] = []
    validate_request(base)
