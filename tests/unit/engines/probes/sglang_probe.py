"""Check ColdSnap's SGLang integration against the REAL SGLang source (engine-contract env).

SGLang's package ``__init__`` imports triton and CUDA kernels, so the package is not
imported: its plugin framework module (``sglang/srt/plugins/hook_registry.py``,
standard library only) is loaded from the real file under its real name, our
``register()`` runs against it, and every hook target and every SGLang API the
integration calls is located in the real source with ``ast``.

argv: <env root>. Prints {check name: "ok" | error text}.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import sys
import tempfile
import traceback
import types
from pathlib import Path

ROOT = Path(sys.argv[1])
SRC = ROOT / "sglang"
RESULTS: dict[str, str] = {}
_TREES: dict[str, ast.Module] = {}


def check(fn):
    try:
        fn()
        RESULTS[fn.__name__] = "ok"
    except Exception:
        RESULTS[fn.__name__] = traceback.format_exc(limit=4)[-1500:]
    return fn


def module_file(mod: str) -> Path:
    p = SRC / Path(*mod.split("."))
    return p.with_suffix(".py") if p.with_suffix(".py").exists() else p / "__init__.py"


def tree(mod: str) -> ast.Module:
    if mod not in _TREES:
        _TREES[mod] = ast.parse(module_file(mod).read_text())
    return _TREES[mod]


def find(target: str) -> ast.AST:
    """The def/class node of a dotted target (module.func, module.Class, module.Class.method)."""
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):
        mod = ".".join(parts[:i])
        if module_file(mod).exists():
            node: ast.AST = tree(mod)
            for name in parts[i:]:
                body = getattr(node, "body", [])
                hits = [n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                        and n.name == name]
                if not hits:
                    raise AssertionError(f"{target}: {name!r} not found in {module_file(mod)}")
                node = hits[-1]
            return node
    raise AssertionError(f"{target}: no module file")


def args_of(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    return [x.arg for x in a.posonlyargs + a.args] + ["*"] + [x.arg for x in a.kwonlyargs]


def load_hook_registry():
    """Import the real hook_registry module under its real dotted name, without sglang/__init__."""
    for pkg in ("sglang", "sglang.srt", "sglang.srt.plugins"):
        if pkg not in sys.modules:
            m = types.ModuleType(pkg)
            m.__path__ = [str(module_file(pkg).parent)]
            sys.modules[pkg] = m
    name = "sglang.srt.plugins.hook_registry"
    spec = importlib.util.spec_from_file_location(name, module_file(name))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@check
def versions_are_pinned():
    v = (ROOT / "VERSIONS").read_text().split()
    assert "sglang==0.5.23" in v and "torch_memory_saver==0.0.10" in v, v
    assert (SRC / "sglang-0.5.23.dist-info").is_dir()


@check
def entry_point_group_is_sglangs():
    for node in ast.walk(tree("sglang.srt.plugins")):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "GENERAL_PLUGINS_GROUP" for t in node.targets):
            assert node.value.value == "sglang.srt.plugins"
            return
    raise AssertionError("GENERAL_PLUGINS_GROUP not found")


@check
def register_installs_hooks_on_existing_targets():
    hr = load_hook_registry()
    os.environ["COLDSNAP_CONTROL_FILE"] = str(Path(tempfile.mkdtemp()) / "control.json")
    os.environ["COLDSNAP_HYDRATION_SPEC"] = str(Path(tempfile.mkdtemp()) / "spec.json")
    from coldsnap_engines.sglang import plugin

    plugin.register()
    plugin.register()
    hooks = hr.HookRegistry._hooks
    want = {t: hr.HookType.AROUND for t in plugin.HOOK_TARGETS["iterators"]}
    want[plugin.HOOK_TARGETS["load_model"]] = hr.HookType.AROUND
    want[plugin.HOOK_TARGETS["get_model_loader"]] = hr.HookType.AROUND
    want[plugin.HOOK_TARGETS["scheduler_init"]] = hr.HookType.AFTER
    want[plugin.HOOK_TARGETS["scheduler_pump"]] = hr.HookType.AFTER
    for target, kind in want.items():
        assert [h[0] for h in hooks[target]] == [kind], (target, hooks.get(target))
        find(target)


@check
def hooked_functions_have_the_signatures_the_hooks_assume():
    for name in ("safetensors_weights_iterator", "fastsafetensors_weights_iterator", "instanttensor_weights_iterator"):
        assert args_of(find(f"sglang.srt.model_loader.weight_utils.{name}"))[0] == "hf_weights_files", name
    assert args_of(find("sglang.srt.model_loader.loader.get_model_loader"))[:1] == ["load_config"]
    for cls in ("DefaultModelLoader", "DummyModelLoader"):
        got = args_of(find(f"sglang.srt.model_loader.loader.{cls}.load_model"))
        assert got[:2] == ["self", "*"] and {"model_config", "device_config"} <= set(got), (cls, got)


@check
def scheduler_api_used_by_the_control_plane():
    sched = "sglang.srt.managers.scheduler.Scheduler"
    for meth in ("__init__", "ingest_requests", "is_fully_idle"):
        find(f"{sched}.{meth}")
    src = module_file("sglang.srt.managers.scheduler").read_text()
    for attr in ("self.tp_worker =", "get_parallel().tp_rank", "get_parallel().tp_size", "get_device().gpu_id",
                 "self.init_weight_updater()"):
        assert attr in src, attr
    ctx = {n.name for n in tree("sglang.srt.runtime_context").body if isinstance(n, ast.FunctionDef)}
    assert {"get_parallel", "get_device"} <= ctx
    upd = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
    for meth in ("release_memory_occupation", "resume_memory_occupation"):
        assert args_of(find(f"{upd}.{meth}")) == ["self", "recv_req", "*"]
    for cls in ("ReleaseMemoryOccupationReqInput", "ResumeMemoryOccupationReqInput"):
        node = find(f"sglang.srt.managers.io_struct.{cls}")
        fields = [n.target.id for n in node.body if isinstance(n, ast.AnnAssign)]
        assert fields == ["tags"], (cls, fields)


@check
def memory_regions_are_the_three_tags():
    from coldsnap_engines.sglang.control import MEMORY_TAGS

    consts = {}
    for node in tree("sglang.srt.constants").body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            consts[node.targets[0].id] = node.value.value
    assert {consts["GPU_MEMORY_TYPE_WEIGHTS"], consts["GPU_MEMORY_TYPE_KV_CACHE"],
            consts["GPU_MEMORY_TYPE_CUDA_GRAPH"]} == set(MEMORY_TAGS)
    runner = module_file("sglang.srt.model_executor.model_runner").read_text()
    assert "self.token_to_kv_pool" in runner and "memory_saver_adapter" in runner
    pool = module_file("sglang.srt.mem_cache.memory_pool").read_text()
    assert "self.k_buffer" in pool and "self.v_buffer" in pool and "self.kv_buffer" in pool


@check
def server_flags_named_by_the_engine_rules_exist():
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.engines import ENGINES

    spec = ENGINES["sglang"]
    # 0.5.23 generates its CLI from annotated config fields: --enable-memory-saver <- enable_memory_saver
    fields = set()
    for f in (SRC / "sglang" / "srt" / "arg_groups" / "fields").glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                fields.add(node.target.id)
    for flag in (*spec.required_args, *spec.forbidden_args, spec.load_format_flag):
        assert flag[2:].replace("-", "_") in fields, flag
    fmts = {n.value.value for n in find("sglang.srt.configs.load_config.LoadFormat").body
            if isinstance(n, ast.Assign)}
    assert set(spec.capture_load_formats) <= fmts, fmts


@check
def torch_memory_saver_api():
    text = (ROOT / "tms" / "torch_memory_saver" / "entrypoint.py").read_text()
    node = ast.parse(text)
    tms = next(n for n in node.body if isinstance(n, ast.ClassDef) and n.name == "TorchMemorySaver")
    meths = {n.name: args_of(n) for n in tms.body if isinstance(n, ast.FunctionDef)}
    assert meths["pause"][:2] == ["self", "tag"] and meths["resume"][:2] == ["self", "tag"]
    assert meths["region"][:2] == ["self", "tag"]
    adapter = module_file("sglang.srt.utils.torch_memory_saver_adapter").read_text()
    assert "def pause(self, tag" in adapter and "def resume(self, tag" in adapter


print(json.dumps(RESULTS))
