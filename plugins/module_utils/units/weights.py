"""Weights planning on a restore host: which provider fills each of this host's workers
(``policy.weights.mode``), and where its bytes are."""

from __future__ import annotations

from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import units_on_host
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import PayloadRef
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.provider import resolve_provider


def model_dir(request: dict) -> str | None:
    """Where the recovery provider reads the pinned safetensors on this host."""
    src = request["launch"]["model"]["source"]
    if src["kind"] == "local-safetensors":
        return src["path"]
    return None


def plan_weights(request: dict, artifact: dict, *, host: str, state_root: Path) -> dict:
    """Provider per worker of this host's units, as policy.weights.mode decides it."""
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
            entry = {"provider": res.provider, "reasons": list(res.reasons), "pack": None}
            if res.provider == "native":
                entry["pack"] = PayloadRef(path=str(NodeCache(state_root).path_for(pl["sha256"])),
                                           size=pl["size"], sha256=pl["sha256"]).to_json()
        finally:
            res.close()
        providers.add(res.provider)
        plan["workers"][w["worker"]] = entry
    plan["provider"] = providers.pop() if len(providers) == 1 else "mixed"
    if "recovery" in {e["provider"] for e in plan["workers"].values()} and not plan["model_dir"]:
        raise ColdSnapError("the recovery provider needs the pinned safetensors on the host, but the model source "
                            "is not a local directory", fix="stage the pinned snapshot and use a local-safetensors "
                            "source, or stage the native payload")
    return plan
