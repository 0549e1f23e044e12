"""What a committed descriptor references on its hosts: its capture, capsules and payloads
(the unit of host-side cleanup, :mod:`.leftovers`)."""

from __future__ import annotations


def local_refs(artifact: dict, *, artifact_sha256: str | None = None, kind: str = "generation") -> dict:
    """The host-local things a descriptor references: its capture, capsules and payloads.

    ``cleanup.remove_local`` takes a list of these. A payload is ``published``
    when the descriptor pins a native provider revision: a shared published
    object is never removed implicitly.
    """
    hosts_of_unit = {u["id"]: u["host"] for u in artifact["launch"]["units"]}
    published = bool(artifact["weights"]["providers"]["native"].get("revision"))
    payloads: dict[str, dict] = {}
    for w in artifact["weights"]["workers"]:
        p = w["payload"]
        if not p:
            continue
        entry = payloads.setdefault(p["sha256"], {"sha256": p["sha256"], "size": p["size"], "hosts": [],
                                                  "published": published})
        host = hosts_of_unit.get(w["unit"])
        if host and host not in entry["hosts"]:
            entry["hosts"].append(host)
    capsules = [{k: c.get(k) for k in ("unit", "host", "layout", "image_id", "location", "repository_digest")}
                for c in artifact["capsule"]["units"]]
    hosts = sorted({c["host"] for c in capsules} | set(hosts_of_unit.values()))
    return {"kind": kind, "capture_id": artifact["capture_id"], "identity": artifact["identity"],
            "artifact_sha256": artifact_sha256, "capsules": capsules,
            "payloads": sorted(payloads.values(), key=lambda p: p["sha256"]), "hosts": hosts}
