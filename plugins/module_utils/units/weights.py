"""Weights planning on a restore host: which provider fills each of this host's workers
(``policy.weights.mode``), and where its bytes are."""

from __future__ import annotations

import os
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import readahead
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import units_on_host
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import PayloadRef, WorkerFiles
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import recovery_source
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.provider import (
    resolve_provider,
)


def model_dir(request: dict) -> str | None:
    """The directory a unit container mounts so the recovery provider can read the pinned safetensors
    (the local model directory, or the Hugging Face cache holding the pinned snapshot)."""
    return recovery_source.mount_root(request)


def plan_weights(request: dict, artifact: dict, *, host: str, state_root: Path,
                 staging_failures: dict | None = None, worker_dirs: dict | None = None,
                 contact_hub: bool = False, hub_token: str | None = None, dry_run: bool = False) -> dict:
    """Provider per worker of this host's units, as policy.weights.mode decides it.
    ``staging_failures``: why staging a worker's native payload failed (the role's rescue), listed
    first among that worker's reasons. ``worker_dirs``: each worker's captured unit directory on this
    host, where its replay plan is (its recovery source is then checked here). ``contact_hub``: a
    Hugging Face recovery source may be downloaded now (prepare), else only looked up in the cache;
    ``dry_run`` (check mode) neither downloads nor looks it up, and verifies cached packs read-only (no
    record, no lock file, no quarantine)."""
    weights = request["policy"]["weights"]
    host_units = {u["id"] for u in units_on_host(request, host)}
    plan: dict = {"workers": {}, "model_dir": None, "materialize": weights["native"]["materialize"]}
    providers = set()
    for w in artifact["weights"]["workers"]:
        if w["unit"] not in host_units:
            continue
        pl = w["payload"]
        ref = PayloadRef(path=pl["path"], size=pl["size"], sha256=pl["sha256"]) if pl else None
        res = resolve_provider(weights["mode"], state_root=state_root, pack=ref,
                               recovery_enabled=weights["recovery"]["enabled"], write_record=not dry_run)
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
    source = request["launch"]["model"]["source"]
    if source["kind"] == "local-safetensors":
        plan["model_dir"] = source["path"]
    elif recovering and not dry_run:
        plan["model_dir"] = str(recovery_source.recovery_dir(
            request, contact_hub=contact_hub and weights["mode"] != "cache-only-auto", token=hub_token))
    # The recovery source is checked here, before anything is evicted: every file the replay plan reads,
    # its size and safetensors header as the capture pinned them.
    for wid in recovering:
        directory = (worker_dirs or {}).get(wid)
        replay = WorkerFiles.of(directory, wid).replay if directory else None
        if replay is not None and replay.is_file():
            try:
                recovery_source.check_recovery_source(replay, Path(plan["model_dir"]))
            except ColdSnapError as exc:
                raise ColdSnapError(f"worker {wid} would be filled from the pinned safetensors, which fail here: "
                                    f"{exc.problem}", fix=exc.fix) from None
    return plan


def require_materialize_space(plan: dict, artifact: dict, *, state_root: Path) -> None:
    """``policy.weights.native.materialize: required``: a recovery restore writes each recovered worker's pack
    into the node cache before its engine serves, so a file system without room for them would fail the
    restore after the running workload was evicted. Checked in prepare (read-only), naming the bytes."""
    if plan.get("materialize") != "required":
        return
    payloads = {w["worker"]: w.get("payload") or {} for w in artifact["weights"]["workers"]}
    # One object per digest: workers whose packs are the same bytes write it once.
    packs = {payloads[wid].get("sha256"): int(payloads[wid].get("size") or 0)
             for wid, e in plan.get("workers", {}).items() if e.get("provider") == "recovery" and wid in payloads}
    need = sum(packs.values())
    if not need:
        return
    where = NodeCache(state_root).objects
    while not where.exists() and where.parent != where:
        where = where.parent  # the cache is made on first use: its file system is its nearest existing parent's
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise ColdSnapError(
            f"policy.weights.native.materialize is required: this recovery restore writes {need} bytes of model "
            f"payload into the node cache, and the file system of {where} has {free} bytes free",
            fix="free space there, point coldsnap_state_root at a larger file system, or set "
                "policy.weights.native.materialize to async (written in the background; a failure does not stop "
                "the restore) or off")


def read_packs_ahead(plan: dict) -> list[str]:
    """Queue reads of the packs ``plan`` hydrates from into the page cache, without waiting: the
    engine reads them only after eviction and the CRIU and CUDA restores (a CPU engine maps the
    pack and faults it in on its first request), and a pack that left the page cache since it was
    verified would then come off the disk in page-fault-sized reads on the critical path. The
    packs whose reads were queued."""
    packs = sorted({e["pack"]["path"] for e in plan.get("workers", {}).values()
                    if e.get("provider") == "native" and e.get("pack")})
    return [p for p in packs if readahead(p)]
