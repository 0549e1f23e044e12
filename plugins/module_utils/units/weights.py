"""Weights planning on a restore host: which provider fills each of this host's workers
(``policy.weights.mode``), and where its bytes are."""

from __future__ import annotations

from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import units_on_host
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import PayloadRef, WorkerFiles
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.hydrate import check_recovery_source
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.provider import resolve_provider


def model_dir(request: dict) -> str | None:
    """Where the recovery provider reads the pinned safetensors on this host."""
    src = request["launch"]["model"]["source"]
    if src["kind"] == "local-safetensors":
        return src["path"]
    return None


def plan_weights(request: dict, artifact: dict, *, host: str, state_root: Path,
                 staging_failures: dict | None = None, worker_dirs: dict | None = None) -> dict:
    """Provider per worker of this host's units, as policy.weights.mode decides it.
    ``staging_failures``: why staging a worker's native payload failed (the role's rescue), listed
    first among that worker's reasons. ``worker_dirs``: each worker's captured unit directory on this
    host, where its replay plan is (its recovery source is then checked here)."""
    weights = request["policy"]["weights"]
    host_units = {u["id"] for u in units_on_host(request, host)}
    plan: dict = {"workers": {}, "model_dir": model_dir(request), "materialize": weights["native"]["materialize"]}
    providers = set()
    for w in artifact["weights"]["workers"]:
        if w["unit"] not in host_units:
            continue
        pl = w["payload"]
        ref = PayloadRef(path=pl["path"], size=pl["size"], sha256=pl["sha256"]) if pl else None
        res = resolve_provider(weights["mode"], state_root=state_root, pack=ref,
                               recovery_enabled=weights["recovery"]["enabled"])
        try:
            staged = (staging_failures or {}).get(w["worker"])
            entry = {"provider": res.provider, "pack": None,
                     "reasons": ([f"native staging failed: {staged}"] if staged else []) + list(res.reasons)}
            if res.provider == "native":
                entry["pack"] = PayloadRef(path=str(NodeCache(state_root).path_for(pl["sha256"])),
                                           size=pl["size"], sha256=pl["sha256"]).to_json()
        finally:
            res.close()
        providers.add(res.provider)
        plan["workers"][w["worker"]] = entry
    plan["provider"] = providers.pop() if len(providers) == 1 else "mixed"
    recovering = [wid for wid, e in plan["workers"].items() if e["provider"] == "recovery"]
    if recovering and not plan["model_dir"]:
        raise ColdSnapError("the recovery provider needs the pinned safetensors on the host, but the model source "
                            "is not a local directory", fix="stage the pinned snapshot and use a local-safetensors "
                            "source, or stage the native payload")
    # The recovery source is checked here, before anything is evicted: every file the replay plan reads,
    # its size and safetensors header as the capture pinned them.
    for wid in recovering:
        directory = (worker_dirs or {}).get(wid)
        replay = WorkerFiles.of(directory, wid).replay if directory else None
        if replay is not None and replay.is_file():
            try:
                check_recovery_source(replay, Path(plan["model_dir"]))
            except ColdSnapError as exc:
                raise ColdSnapError(f"worker {wid} would be filled from the pinned safetensors, which fail here: "
                                    f"{exc.problem}", fix=exc.fix) from None
    return plan
