"""Per-worker payload work over a live :class:`AllocationTable`: export at capture,
hydration on restore/wake (native pack + residual, or safetensors replay +
residual), and materialization into the node cache.

This is the engine-neutral glue to ``module_utils.payload``; the vLLM and SGLang
integrations call it from inside their worker processes, with the table their
allocator gives and the extents the :mod:`observer` recorded.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import atomic_write_json
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import ModelExtent

from coldsnap_engines.common.allocations import AllocationTable, close_io

LAYOUT_NAME = "engine-layout.json"
LAYOUT_FORMAT = 1
LAYOUT_KIND = "coldsnap-engine-layout"
CHUNK = 16 << 20


def _hash_file_ranges(fd: int, ranges: Sequence[tuple[int, int]]) -> str:
    h = hashlib.sha256()
    for off, n in ranges:
        pos = off
        end = off + n
        while pos < end:
            data = os.pread(fd, min(CHUNK, end - pos), pos)
            if not data:
                raise IntegrityError(f"checkpoint file ends at byte {pos}", fix="download the pinned model revision")
            h.update(data)
            pos += len(data)
    return h.hexdigest()


def _hash_resident(reader, extent: ModelExtent) -> str:
    h = hashlib.sha256()
    pos = 0
    while pos < extent.size:
        n = min(CHUNK, extent.size - pos)
        h.update(reader.read(extent.allocation, extent.offset + pos, n))
        pos += n
    return h.hexdigest()


def verify_extents(extents: Sequence[ModelExtent], reader, model_dir: Path) -> tuple[list[ModelExtent], list[ModelExtent]]:
    """Split observed extents into (kept, demoted): kept ones hold exactly their checkpoint slice.

    A demoted extent's bytes were changed after the loader wrote them by something
    the observer did not see (a raw kernel, an in-place transform outside torch's
    dispatcher); they stay in the residual, so recovery replay can never write
    different bytes than the captured process held.
    """
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.safetensors import (
        SafetensorsFile,
        slice_ranges,
    )

    opened: dict[str, SafetensorsFile] = {}
    kept: list[ModelExtent] = []
    demoted: list[ModelExtent] = []
    try:
        for e in extents:
            src = e.source
            st = opened.get(src.file)
            if st is None:
                st = opened[src.file] = SafetensorsFile(Path(model_dir) / src.file)
            info = st.tensors.get(src.tensor)
            if info is None or info.dtype != src.dtype or tuple(info.shape) != tuple(src.shape):
                demoted.append(e)
                continue
            if _hash_file_ranges(st.fd, slice_ranges(info, src.slice)) == _hash_resident(reader, e):
                kept.append(e)
            else:
                demoted.append(e)
    finally:
        for st in opened.values():
            st.close()
    return kept, demoted


def payload_json(result) -> dict:
    """The control API's view of a ``WorkerPayload`` (same shape as the reference engine's)."""
    def ref(r):
        if r is None:
            return None
        return {k: getattr(r, k) for k in ("path", "size", "sha256") if hasattr(r, k)}

    return {"pack": ref(result.pack), "residual": ref(result.residual), "manifest": ref(result.manifest),
            "replay": ref(result.replay), "model_bytes": result.model_bytes,
            "residual_bytes": result.residual_bytes, "allocations": result.allocations}


def export(table: AllocationTable, extents: Sequence[ModelExtent], out_dir: Path, *, export_pack: bool,
           state_root: str | None, model: dict, model_dir: Path | None, verify: bool = True,
           layout: dict | None = None, progress_dir: str | None = None, progress_name: str = "export") -> dict:
    """Write weights.blob, native-manifest.json, replay-plan.json (and the pack) for one worker.

    ``progress_dir``: where the byte progress of the export goes (live, while it runs).

    Must run while the allocations are resident and the engine is quiesced (the
    pack writer re-checks each extent's CRC between its two passes).
    """
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.progress import ProgressWriter
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.pack import write_worker_payload

    if not len(table):
        raise ColdSnapError("the engine has no stable weight allocations to export",
                            fix="start the engine with its sleep-mode / memory-saver allocator enabled")
    check_mapped_packs()
    out_dir = Path(out_dir)
    cache = NodeCache(Path(state_root)) if (export_pack and state_root) else None
    if export_pack and cache is None:
        raise ColdSnapError("exporting the model payload needs the node cache (state_root)",
                            fix="pass state_root in the export request")
    rd = table.reader()
    demoted: list[ModelExtent] = []
    try:
        kept = list(extents)
        if verify and model_dir is not None and kept:
            kept, demoted = verify_extents(kept, rd, Path(model_dir))
        writer = ProgressWriter(progress_dir, progress_name, phase="capture export",
                                message="residual + manifest" + (" + pack" if export_pack else ""))
        result = write_worker_payload(out_dir, table.payload_allocations(), kept, rd, export_pack=export_pack,
                                      cache=cache, model=model, safetensors_dir=model_dir, progress=writer)
        writer.done()
    finally:
        close_io(rd)
    if layout is not None:
        atomic_write_json(out_dir / LAYOUT_NAME, {"format": LAYOUT_FORMAT, "kind": LAYOUT_KIND, **layout})
    out = payload_json(result)
    out["demoted_extents"] = len(demoted)
    out["demoted_bytes"] = sum(e.size for e in demoted)
    return out


def hydrate(table: AllocationTable, spec: dict, *, relocatable: bool = False, progress=None) -> dict:
    """Fill every stable allocation from pack + residual (native) or safetensors + residual (recovery).

    ``spec`` is the control API's resume/wake body: provider, manifest, residual,
    replay, pack {path, sha256, size}, model_dir. ``relocatable`` admits a rebuilt
    layout at new addresses (same ids and sizes): the template-restore loader. ``progress(done,
    total)`` hears the bytes written.
    """
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import hydrate as hy
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import PayloadVerifier

    opened = time.monotonic()
    sink = table.sink()  # on a GPU its staging is page-locked from now on, while the manifest and payload are checked
    sink_open = time.monotonic() - opened
    provider = spec.get("provider")
    try:
        manifest = hy.load_manifest(Path(spec["manifest"]))
        table.check_manifest(manifest.allocations, relocatable=relocatable)
        if provider == "native":
            pack = spec.get("pack") or {}
            if not pack.get("path"):
                raise ColdSnapError("native hydration needs the staged model payload (pack.path)",
                                    fix="stage the payload (coldsnap.fleet.payload_stage) or use provider 'recovery'")
            with PayloadVerifier().verify(Path(pack["path"]), pack["sha256"], pack["size"]) as verified:
                stats = hy.hydrate_native(manifest, verified, Path(spec["residual"]), sink, progress=progress)
        elif provider == "recovery":
            if not spec.get("model_dir"):
                raise ColdSnapError("recovery hydration needs the pinned checkpoint directory (model_dir)",
                                    fix="mount the pinned model revision and pass its directory")
            stats = hy.hydrate_recovery(manifest, Path(spec["replay"]), Path(spec["model_dir"]),
                                        Path(spec["residual"]), sink, progress=progress)
        else:
            raise ColdSnapError(f"unknown weight provider {provider!r}", fix="use 'native' or 'recovery'")
    finally:
        closing = time.monotonic()
        close_io(sink)
        sink_close = time.monotonic() - closing
    out = stats.as_dict()
    out["provider"] = provider
    out["sink_open_s"], out["sink_close_s"] = round(sink_open, 6), round(sink_close, 6)  # outside ``seconds``
    return out


def check_mapped_packs() -> None:
    """Weights mapped from a pack (CPU hydration without copying) must still be the verified bytes:
    re-check each mapped pack's identity (IntegrityError when it changed) before they are read."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import mapfill

    mapfill.check_leases()


def check_released() -> None:
    """After the weights were released: no mapping or descriptor of a node-cache pack may remain in
    this process (a CRIU image would otherwise refer to the pack)."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import mapfill

    left = mapfill.pack_references()
    if left:
        raise ColdSnapError(f"the released engine still refers to model payloads: {'; '.join(left[:4])}",
                            fix="report this as a bug: a CPU arena mapped from a pack was not released")


def materialize(table: AllocationTable, spec: dict) -> dict:
    """Write the resident model bytes into the node cache with the canonical pack writer."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import hydrate as hy
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.pack import write_pack_from_resident

    manifest = hy.load_manifest(Path(spec["manifest"]))
    table.check_manifest(manifest.allocations, relocatable=True)
    rd = table.reader()
    try:
        ref = write_pack_from_resident(manifest, rd, NodeCache(Path(spec["state_root"])))
    finally:
        close_io(rd)
    return {"sha256": ref.sha256, "size": ref.size, "path": ref.path}


def tensor_layout(named_tensors, table: AllocationTable) -> dict:
    """Where each named parameter/buffer lives: {name: [allocation, offset, nbytes, dtype, shape]}.

    Written beside the manifest at capture so a rebuilt layout (template restore)
    can be checked tensor by tensor before any byte is hydrated.
    """
    out = {}
    for name, t in named_tensors:
        if t.device.type == "meta" or t.numel() == 0:
            continue
        dev = "cpu" if t.device.type == "cpu" else f"{t.device.type}:{t.device.index or 0}"
        hit = table.locate(dev, t.data_ptr(), t.numel() * t.element_size())
        if hit is not None:
            out[name] = [hit[0].id, hit[1], t.numel() * t.element_size(), str(t.dtype).removeprefix("torch."),
                         list(t.shape)]
    return out


def check_layout(expected: dict, actual: dict) -> None:
    """Refuse a rebuilt model whose tensors do not sit where the capture's did."""
    missing = sorted(set(expected) - set(actual))
    if missing:
        raise IntegrityError(f"the rebuilt model lacks {len(missing)} captured tensors (first: {missing[0]!r})",
                             fix="restore with the engine build and options the capture used")
    for name, want in expected.items():
        if actual[name] != want:
            raise IntegrityError(f"tensor {name!r} sits at {actual[name]}, the capture had {want}",
                                 fix="restore with the engine build and options the capture used")
