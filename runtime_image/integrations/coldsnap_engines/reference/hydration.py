"""Engine-side glue to the payload library: hydrate arenas (native or recovery) and
materialize resident model bytes into the node cache with the canonical writer."""

from __future__ import annotations

from pathlib import Path

from coldsnap_engines.reference.loader import LoadedWeights


def _sink(loaded: LoadedWeights):
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import hydrate as hy

    arenas = loaded.arenas
    first = next(iter(arenas.values()))
    if first.device == "cpu":
        return hy.MemorySink({a.id: a.view() for a in arenas.values()})
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cuda import CudaSink

    return CudaSink.for_restore({a.id: a.address for a in arenas.values()}, first.device_index,
                                sizes={a.id: a.size for a in arenas.values()})


def reader(loaded: LoadedWeights):
    """AllocationReader for the payload writer: the arenas themselves (CPU) or pinned D2H copies (GPU)."""
    first = next(iter(loaded.arenas.values()))
    if first.device == "cpu":
        return loaded
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cuda import CudaReader

    return CudaReader({a.id: a.address for a in loaded.arenas.values()}, first.device_index)


def close(obj) -> None:
    """Free staging buffers (pinned host memory must not end up in a snapshot)."""
    fn = getattr(obj, "close", None)
    if callable(fn):
        fn()


def hydrate(loaded: LoadedWeights, spec: dict) -> dict:
    """Fill every arena from pack + residual (native) or safetensors + residual (recovery)."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import IntegrityError
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import hydrate as hy
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import PayloadVerifier

    manifest = hy.load_manifest(Path(spec["manifest"]))
    for alloc in manifest.allocations:
        arena = loaded.arenas.get(alloc.id)
        if arena is None or arena.address != alloc.address or arena.size != alloc.size:
            raise IntegrityError(
                f"allocation {alloc.id!r} in the manifest ({alloc.address:#x}, {alloc.size} bytes) does not match "
                f"the restored process", fix="restore the capsule that belongs to this manifest")
    sink = _sink(loaded)
    provider = spec["provider"]
    try:
        if provider == "native":
            pack = spec["pack"]
            with PayloadVerifier().verify(Path(pack["path"]), pack["sha256"], pack["size"]) as verified:
                stats = hy.hydrate_native(manifest, verified, Path(spec["residual"]), sink)
        elif provider == "recovery":
            stats = hy.hydrate_recovery(manifest, Path(spec["replay"]), Path(spec["model_dir"]),
                                        Path(spec["residual"]), sink)
        else:
            raise ValueError(f"unknown weight provider {provider!r}")
    finally:
        close(sink)
    out = stats.as_dict() if hasattr(stats, "as_dict") else dict(vars(stats))
    out["provider"] = provider
    return out


def materialize(loaded: LoadedWeights, spec: dict) -> dict:
    """Write the resident model bytes into the node cache (recovery read-through cache)."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import hydrate as hy
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.pack import write_pack_from_resident

    manifest = hy.load_manifest(Path(spec["manifest"]))
    rd = reader(loaded)
    try:
        ref = write_pack_from_resident(manifest, rd, NodeCache(Path(spec["state_root"])))
    finally:
        if rd is not loaded:
            close(rd)
    return {"sha256": ref.sha256, "size": ref.size, "path": ref.path}
