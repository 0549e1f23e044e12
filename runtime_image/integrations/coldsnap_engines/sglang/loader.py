"""SGLang load observation and the template-restore loader.

Capture: the safetensors-backed iterators of ``sglang.srt.model_loader.weight_utils``
are wrapped (their I/O unchanged) so every yielded tensor is registered as a
checkpoint source, and ``DefaultModelLoader.load_model`` runs under the
:class:`~coldsnap_engines.common.observer.LoadObserver`.

Template restore (``COLDSNAP_HYDRATION_SPEC`` set before SGLang starts): the
loader SGLang selects is replaced by one that builds the model without reading
the checkpoint (SGLang's dummy loader path), checks the rebuilt tensor layout
against the capture's, and hydrates every stable allocation (native or recovery).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError

from coldsnap_engines.common import worker
from coldsnap_engines.common.allocations import AllocationTable, from_segments
from coldsnap_engines.common.observer import LoadObserver, SourceIndex
from coldsnap_engines.sglang.state import STATE

SPEC_ENV = "COLDSNAP_HYDRATION_SPEC"
ITERATORS = ("safetensors_weights_iterator", "fastsafetensors_weights_iterator", "instanttensor_weights_iterator")
WEIGHT_UTILS = "sglang.srt.model_loader.weight_utils"
LOADER_MODULE = "sglang.srt.model_loader.loader"


def named_tensors(model):
    yield from model.named_parameters()
    yield from model.named_buffers()


def weights_table(model) -> AllocationTable:
    """The torch_memory_saver 'weights' region as allocations: the segments holding the model's tensors."""
    return from_segments([pair[1] for pair in named_tensors(model)], "weights")


def observe_iterator(original_fn, hf_weights_files, *args, **kwargs):
    """AROUND hook for a weights iterator: same tensors, each registered as a checkpoint source."""
    gen = original_fn(hf_weights_files, *args, **kwargs)
    observer = STATE.observer
    files = [str(f) for f in hf_weights_files if str(f).endswith(".safetensors")]
    if observer is None or not files:
        yield from gen
        return
    root = Path(os.path.commonpath([str(Path(f).parent) for f in files]))
    with STATE.lock:
        if STATE.model_dir is None:
            STATE.model_dir = root
        STATE.files = sorted(set(STATE.files) | set(files))
    index = SourceIndex(root, files) if root == STATE.model_dir else None
    for name, tensor in gen:
        if index is not None:
            observer.register(tensor, index.lookup(name))
        yield name, tensor


def observe_load_model(original_fn, loader, *args, **kwargs):
    """AROUND hook for ``DefaultModelLoader.load_model``: the whole load (and post-load) under the observer."""
    observer = LoadObserver()
    with STATE.lock:
        STATE.observer = observer
    with observer:
        return original_fn(loader, *args, **kwargs)


def hydration_spec() -> dict | None:
    path = os.environ.get(SPEC_ENV)
    return json.loads(Path(path).read_text()) if path else None


def select_loader(original_fn, load_config, *args, **kwargs):
    """AROUND hook for ``get_model_loader``: the template-restore loader when a hydration spec is set."""
    spec = hydration_spec()
    if spec is None:
        return original_fn(load_config, *args, **kwargs)
    return ColdSnapLoader(load_config, spec)


class ColdSnapLoader:
    """Build the model without checkpoint I/O, then hydrate the captured bytes (relocatable layout)."""

    def __init__(self, load_config, spec: dict) -> None:
        self.load_config = load_config
        self.spec = spec
        self.last_hydration: dict | None = None

    def download_model(self, model_config) -> None:
        """Nothing to download."""

    def load_model(self, *, model_config, device_config, **kwargs):
        from sglang.srt.model_loader.loader import DummyModelLoader

        model = DummyModelLoader(self.load_config).load_model(model_config=model_config, device_config=device_config,
                                                              **kwargs)
        table = weights_table(model)
        layout_file = Path(self.spec["manifest"]).with_name(worker.LAYOUT_NAME)
        if not layout_file.exists():
            raise ColdSnapError(f"{layout_file} is missing: a template restore cannot check the rebuilt layout",
                                fix="restore from a capture made by this integration")
        expected = json.loads(layout_file.read_text()).get("tensors", {})
        worker.check_layout(expected, worker.tensor_layout(named_tensors(model), table))
        self.last_hydration = worker.hydrate(table, self.spec, relocatable=True)
        return model
