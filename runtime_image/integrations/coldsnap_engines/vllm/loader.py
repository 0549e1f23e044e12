"""vLLM model loaders: the observing wrapper used at capture and the ``coldsnap`` load format.

``ObservingLoader`` subclasses vLLM's ``DefaultModelLoader`` and keeps its I/O
(safetensors, fastsafetensors, instanttensor): it only records which files the
loader prepared, registers each tensor the checkpoint iterator yields, and runs
``load_model`` under :class:`~coldsnap_engines.common.observer.LoadObserver`.

``ColdSnapModelLoader`` (``--load-format coldsnap``) never reads the checkpoint
through vLLM: it builds the model (the same allocations, same order), runs the
post-load processing so the layout matches the captured one, and then hydrates
every stable allocation from the native pack + residual or from the pinned
safetensors replay plan (the recovery loader). Used on a template restore and
whenever a restored engine reloads its weights.

Classes are built on first use (``loader_classes``) so importing this module
needs no vLLM.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.engines import (
    ENGINES,
    preferred_load_format,
)

from coldsnap_engines.common import worker
from coldsnap_engines.common.allocations import AllocationTable, from_cumem, from_segments
from coldsnap_engines.common.observer import LoadObserver, SourceIndex
from coldsnap_engines.vllm.state import STATE

LOAD_FORMAT = ENGINES["vllm"].restore_load_format  # "coldsnap"
OBSERVED_FORMATS = ENGINES["vllm"].capture_load_formats  # the safetensors-backed normal loaders
SPEC_ENV = "COLDSNAP_HYDRATION_SPEC"
# The extra-config keys vLLM's DefaultModelLoader (every capture load format) accepts.
DEFAULT_LOADER_EXTRA_KEYS = ("enable_multithread_load", "num_threads", "enable_weights_track")
EXTRA_CONFIG_KEY = "coldsnap_spec"


def installed_loaders() -> list[str]:
    """The optional fast loaders importable in this process."""
    return [name for name in ENGINES["vllm"].loader_preference if importlib.util.find_spec(name) is not None]


def weights_table(model=None) -> AllocationTable:
    """The worker's stable weight allocations: on CPU the arena the loader moved the parameters
    into; on GPU CuMemAllocator's 'weights' pool (sleep mode), else the caching-allocator
    segments holding the model's tensors."""
    if STATE.arena is not None:
        return STATE.arena.table()
    try:
        from vllm.device_allocator.cumem import CuMemAllocator, cumem_available
    except ImportError:
        cumem_available = False
    if cumem_available and CuMemAllocator.instance is not None:
        table = from_cumem(CuMemAllocator.instance, "weights")
        if len(table):
            return table
    if model is None:
        raise ColdSnapError("no stable weight allocations: vLLM runs without its sleep-mode allocator",
                            fix="start vLLM with --enable-sleep-mode")
    tensors = [pair[1] for pair in named_tensors(model)]
    return from_segments(tensors, "weights")


def kv_table() -> AllocationTable | None:
    try:
        from vllm.device_allocator.cumem import CuMemAllocator, cumem_available
    except ImportError:
        return None
    if not cumem_available or CuMemAllocator.instance is None:
        return None
    return from_cumem(CuMemAllocator.instance, "kv_cache")


def unexpected_extra_config(extra: dict | None) -> set[str]:
    """The ``--model-loader-extra-config`` keys the ``coldsnap`` loader refuses. A restore keeps the captured
    command, so the keys vLLM's default loader took at capture (its thread options, which hydration does not
    need) are accepted and ignored, like ColdSnap's own spec key."""
    return set(extra or {}) - {EXTRA_CONFIG_KEY, *DEFAULT_LOADER_EXTRA_KEYS}


def hydration_spec(load_config) -> dict | None:
    """The spec the coldsnap loader hydrates from: armed by RPC, named by the environment, or
    given as ``--model-loader-extra-config '{"coldsnap_spec": PATH}'``."""
    spec = STATE.take_armed()
    if spec:
        return spec
    path = os.environ.get(SPEC_ENV) or (load_config.model_loader_extra_config or {}).get(EXTRA_CONFIG_KEY)
    if path:
        return json.loads(Path(path).read_text())
    return None


def _on_cpu(model) -> bool:
    first = next(iter(model.parameters()), None)
    return first is not None and first.device.type == "cpu"


def named_tensors(model):
    yield from model.named_parameters()
    yield from model.named_buffers()


@functools.cache
def loader_classes():
    """(ColdSnapModelLoader, ObservingLoader), subclasses of vLLM's loader classes."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    class ObservingLoader(DefaultModelLoader):
        """vLLM's default loader, unchanged I/O, with every checkpoint-to-destination write observed."""

        def __init__(self, load_config):
            configured = load_config.load_format
            chosen = preferred_load_format("vllm", configured, installed_loaders())
            if chosen and chosen != configured:
                # Capture prefers installed fast loaders: instanttensor, then fastsafetensors.
                load_config.load_format = chosen
            super().__init__(load_config)
            self._coldsnap_files: list[str] = []
            self._coldsnap_folder: str | None = None
            self._coldsnap_index: SourceIndex | None = None
            self._coldsnap_observer = LoadObserver()

        def _prepare_weights(self, *args, **kwargs):
            result = super()._prepare_weights(*args, **kwargs)
            hf_folder, files, use_safetensors = result[0], result[1], result[2]
            if use_safetensors and self._coldsnap_folder is None:
                self._coldsnap_folder = hf_folder
                self._coldsnap_files = [f for f in files if f.endswith(".safetensors")]
            return result

        def load_weights(self, model, model_config) -> None:
            # On CPU the parameters first move into one stable allocation (vLLM's CPU worker has
            # no sleep-mode allocator); the loader's writes then land there, observed.
            if _on_cpu(model):
                from coldsnap_engines.vllm.cpu import relocate_parameters

                STATE.arena = relocate_parameters(model)
            super().load_weights(model, model_config)

        def get_all_weights(self, model_config, model):
            for name, tensor in super().get_all_weights(model_config, model):
                if self._coldsnap_folder is not None:
                    if self._coldsnap_index is None:
                        self._coldsnap_index = SourceIndex(self._coldsnap_folder, self._coldsnap_files)
                    self._coldsnap_observer.register(tensor, self._coldsnap_index.lookup(name))
                yield name, tensor

        def load_model(self, vllm_config, model_config, prefix: str = ""):
            with self._coldsnap_observer:
                model = super().load_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
            with STATE.lock:
                STATE.observer = self._coldsnap_observer
                STATE.model_dir = Path(self._coldsnap_folder) if self._coldsnap_folder else None
                STATE.load_format = self.load_config.load_format
            return model

    class ColdSnapModelLoader(BaseModelLoader):
        """``--load-format coldsnap``: rebuild the captured layout, hydrate it (native or recovery)."""

        def __init__(self, load_config):
            unexpected = unexpected_extra_config(load_config.model_loader_extra_config)
            if unexpected:
                raise ValueError(f"Unexpected extra config keys for load format {LOAD_FORMAT}: {unexpected}")
            super().__init__(load_config)

        def download_model(self, model_config) -> None:
            """Nothing to download: bytes come from the staged pack or the pinned local checkpoint."""

        def load_weights(self, model, model_config) -> None:
            spec = hydration_spec(self.load_config)
            if spec is None:
                raise ColdSnapError(
                    f"load format {LOAD_FORMAT!r} has no hydration spec",
                    fix=f"restore through ColdSnap, or set {SPEC_ENV} to a spec file "
                        "(provider, manifest, residual, replay, pack, model_dir)")
            table = weights_table(model)
            layout_file = Path(spec["manifest"]).with_name(worker.LAYOUT_NAME)
            if layout_file.exists():
                expected = json.loads(layout_file.read_text()).get("tensors", {})
                worker.check_layout(expected, worker.tensor_layout(named_tensors(model), table))
            STATE.last_hydration = worker.hydrate(table, spec, relocatable=True)

        def load_model(self, vllm_config, model_config, prefix: str = ""):
            import torch

            load_config = vllm_config.load_config
            device = vllm_config.device_config.device if load_config.device is None else load_config.device
            target = torch.device(device)
            with set_default_torch_dtype(model_config.dtype):
                with target:
                    model = self.create_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
                # The post-load processing runs before hydration so the allocations it makes
                # match the capture's; hydration then writes the captured (processed) bytes.
                process_weights_after_loading(model, model_config, target)
                self.load_weights(model, model_config)
            return model.eval()

    return ColdSnapModelLoader, ObservingLoader
