"""Run ColdSnap's vLLM integration against the REAL vLLM source (engine-contract env).

Executed in a subprocess by test_vllm_contract.py with PYTHONPATH = <env>/vllm:<env>/site.
Prints one JSON object: {check name: "ok" | error text}.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
import tempfile
import traceback
import types
from pathlib import Path

RESULTS: dict[str, str] = {}
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def check(fn):
    try:
        fn()
        RESULTS[fn.__name__] = "ok"
    except Exception:
        RESULTS[fn.__name__] = traceback.format_exc(limit=4)[-1500:]
    return fn


def params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


os.environ["COLDSNAP_CONTROL_FILE"] = str(Path(tempfile.mkdtemp()) / "control.json")


@check
def version_is_pinned():
    import vllm

    assert vllm.__version__ == os.environ.get("EXPECT_VLLM", "0.33.0"), vllm.__version__


@check
def register_is_idempotent_and_registers_the_coldsnap_format():
    from coldsnap_engines.vllm.plugin import register
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    register()
    register()
    loader = get_model_loader(LoadConfig(load_format="coldsnap", model_loader_extra_config={"coldsnap_spec": "/x"}))
    assert isinstance(loader, BaseModelLoader) and type(loader).__name__ == "ColdSnapModelLoader"
    try:
        get_model_loader(LoadConfig(load_format="coldsnap", model_loader_extra_config={"bogus": 1}))
    except ValueError as exc:
        assert "bogus" in str(exc)
    else:
        raise AssertionError("unexpected extra config keys must be refused")


@check
def observing_loader_wraps_the_safetensors_backed_formats():
    from coldsnap_engines.vllm.loader import installed_loaders
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    for fmt in ("auto", "safetensors", "fastsafetensors", "instanttensor"):
        loader = get_model_loader(LoadConfig(load_format=fmt))
        assert isinstance(loader, DefaultModelLoader) and type(loader).__name__ == "ObservingLoader", fmt
    assert installed_loaders() == []  # no fast loader on a CPU machine: auto stays auto
    assert get_model_loader(LoadConfig(load_format="auto")).load_config.load_format == "auto"


@check
def default_loader_internals_the_observer_relies_on():
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    assert params(DefaultModelLoader._prepare_weights) == [
        "self", "model_name_or_path", "subfolder", "revision", "fall_back_to_pt", "allow_patterns_overrides"]
    assert params(DefaultModelLoader.get_all_weights) == ["self", "model_config", "model"]
    assert params(DefaultModelLoader.load_model) == ["self", "vllm_config", "model_config", "prefix"]
    assert {f.name for f in dataclasses.fields(DefaultModelLoader.Source)} >= {"model_or_path", "revision", "prefix"}


@check
def observer_classifies_a_load_through_vllms_own_safetensors_iterator():
    import torch
    from coldsnap_engines.common.observer import LoadObserver
    from coldsnap_engines.reference.config import ModelConfig
    from coldsnap_engines.reference.loader import load
    from coldsnap_engines.vllm.loader import loader_classes
    from engines_testlib import arenas_for, make_reference_model, table_of
    from vllm.config.load import LoadConfig

    model_dir = Path(tempfile.mkdtemp()) / "model"
    make_reference_model(model_dir)
    _cold, observing = loader_classes()
    loader = observing(LoadConfig(load_format="safetensors"))
    cfg, plan, arenas = arenas_for(model_dir, 1, 2)
    dtype = getattr(torch, cfg.dtype)
    by_name = {p.name: p for p in plan}
    obs: LoadObserver = loader._coldsnap_observer
    model_config = types.SimpleNamespace(model=str(model_dir), revision=None)
    with obs:
        for name, full in loader.get_all_weights(model_config, torch.nn.Module()):
            p = by_name[name]
            src = full if p.slice is None else full.narrow(p.slice[0], p.slice[1], p.slice[2] - p.slice[1])
            arenas["params"].tensor(p.offset, p.shape, dtype).copy_(src)
    got = obs.resolve(table_of(arenas))
    want = sorted(load(model_dir, ModelConfig.load(model_dir), rank=1, world=2, device="cpu").extents,
                  key=lambda e: (e.allocation, e.offset))
    assert got == want, (len(got), len(want))
    assert loader._coldsnap_folder == str(model_dir)


@check
def sleep_backend_registers_as_a_cumem_backend():
    from vllm.device_allocator.sleep_mode_backend import (
        CuMemBackend,
        SleepModeBackend,
        SleepModeBackendFactory,
    )

    cls = SleepModeBackendFactory.get_backend_class("coldsnap")
    assert issubclass(cls, CuMemBackend)
    assert params(cls.resume) == params(SleepModeBackend.resume) == ["self", "tags"]
    assert params(SleepModeBackend.suspend) == ["self", "level"]


@check
def model_config_selects_backend_and_extension():
    from vllm.config.load import LoadConfig
    from vllm.config.model import ModelConfig
    from vllm.config.parallel import ParallelConfig

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert {"enable_sleep_mode", "sleep_mode_backend"} <= fields
    assert "worker_extension_cls" in {f.name for f in dataclasses.fields(ParallelConfig)}
    assert {"load_format", "model_loader_extra_config", "device"} <= {f.name for f in dataclasses.fields(LoadConfig)}
    from vllm.engine.arg_utils import EngineArgs

    args = {f.name for f in dataclasses.fields(EngineArgs)}
    assert {"load_format", "enable_sleep_mode", "sleep_mode_backend", "worker_extension_cls"} <= args


@check
def worker_extension_mixes_into_the_gpu_worker():
    from coldsnap_engines.vllm.worker import ColdSnapWorkerExtension
    from vllm.v1.worker import gpu_worker, worker_base

    clashes = [a for a in dir(ColdSnapWorkerExtension)
               if not a.startswith("__") and hasattr(gpu_worker.Worker, a)]
    assert clashes == [], clashes  # vLLM asserts on any clash when it mixes the extension in
    base_init = inspect.getsource(worker_base.WorkerBase.__init__)
    for attr in ("self.vllm_config", "self.rank", "self.local_rank"):
        assert attr in base_init, attr
    src = inspect.getsource(gpu_worker)
    assert "self.model_runner" in src and "def wake_up" in src and "def sleep" in src
    assert "sleep_mode_backend.resume(tags)" in inspect.getsource(gpu_worker.Worker.wake_up)


@check
def engine_client_offers_every_call_the_control_plane_makes():
    from vllm.v1.engine.async_llm import AsyncLLM

    want = {
        "pause_generation": ["self", "mode", "clear_cache"], "resume_generation": ["self"], "is_paused": ["self"],
        "checkpoint_prepare": ["self"], "checkpoint_restore": ["self"], "release_kv_cache_memory": ["self"],
        "sleep": ["self", "level", "mode"], "wake_up": ["self", "tags"],
        "collective_rpc": ["self", "method", "timeout", "args", "kwargs"],
    }
    for name, sig in want.items():
        fn = getattr(AsyncLLM, name)
        assert inspect.iscoroutinefunction(fn), name
        assert params(fn) == sig, (name, params(fn))


@check
def endpoint_plugin_satisfies_the_protocol():
    from coldsnap_engines.vllm.endpoint import ColdSnapEndpointPlugin, make_plugin
    from vllm.plugins import ENDPOINT_PLUGINS_GROUP
    from vllm.plugins.endpoint_plugins.interface import EndpointPlugin

    assert ENDPOINT_PLUGINS_GROUP == "vllm.endpoint_plugins"
    plugin = make_plugin()
    assert isinstance(plugin, EndpointPlugin)
    assert params(ColdSnapEndpointPlugin.init_state) == params(EndpointPlugin.init_state)
    assert inspect.iscoroutinefunction(ColdSnapEndpointPlugin.init_state)


@check
def entry_point_groups_are_vllms():
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    assert DEFAULT_PLUGINS_GROUP == "vllm.general_plugins"
    found = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert "coldsnap" in found, sorted(found)


@check
def cumem_allocation_data_maps_to_the_allocation_table():
    from coldsnap_engines.common.allocations import from_cumem
    from vllm.device_allocator import AllocationData

    fake = types.SimpleNamespace(pointer_to_data={
        0x7F0000000000: AllocationData((0, 1 << 21, 0x7F0000000000, 11), "weights"),
        0x7F0000400000: AllocationData((0, 1 << 22, 0x7F0000400000, 12), "kv_cache"),
        0x7F0000200000: AllocationData((0, 1 << 21, 0x7F0000200000, 13), "weights"),
    })
    table = from_cumem(fake, "weights")
    assert [(a.id, a.address, a.size, a.device) for a in table.allocations] == [
        ("weights.0", 0x7F0000000000, 1 << 21, "cuda:0"), ("weights.1", 0x7F0000200000, 1 << 21, "cuda:0")]
    from vllm.device_allocator.cumem import CuMemAllocator

    assert {"sleep", "wake_up", "discard", "use_memory_pool", "get_instance"} <= set(dir(CuMemAllocator))
    assert "self.pointer_to_data" in inspect.getsource(CuMemAllocator.__init__)


print(json.dumps(RESULTS))
