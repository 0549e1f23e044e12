"""Native payload publication (``coldsnap publish-native``): capture-local packs to a Hugging Face repository.

On each capture host every payload its units captured is re-hashed with the one
payload verifier (``rehash=True``: a record is not enough to publish). Each
distinct digest is uploaded once, even when several workers (on one host or
several) share it: the object is owned by the capture host of the first worker
that names it, in the descriptor's worker order, so every host decides the same
thing on its own. Objects go to ``model-payloads/sha256/<hex>.pack`` (the path
restore downloads) with ``huggingface_hub``'s ``HfApi.create_commit``; an object
the branch already holds with the same LFS SHA-256 and size is not uploaded again.

After every host uploaded, the control node resolves the upload branch to its
immutable commit (``HfApi.list_repo_refs``) and checks, at that commit, that
every payload path is there with the expected LFS SHA-256 and size
(``HfApi.get_paths_info``). Only that commit is recorded, never the branch.

The token is a parameter only: it is never logged, stored or put in a message
(library errors are scrubbed of it). The pack stays locked (its per-digest
lock) from the re-hash until the upload finished, so the bytes sent are the
bytes hashed.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import identifiers as ids
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import pack_relpath
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import (
    PayloadVerifier,
    VerifiedPayload,
)

BRANCH = r"[A-Za-z0-9][A-Za-z0-9._/-]{0,199}"
HUB_FIX = "check the repository, the token (write access), the branch and the endpoint (HF_ENDPOINT)"


@dataclass(frozen=True)
class PayloadObject:
    """One distinct payload of a descriptor: its digest, size, repository path, workers and uploading host."""

    sha256: str
    size: int
    path: str
    workers: tuple[str, ...]
    hosts: tuple[str, ...]
    upload_host: str

    def as_dict(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "size": self.size, "path": self.path, "workers": list(self.workers),
                "hosts": list(self.hosts), "upload_host": self.upload_host}


def payload_objects(artifact: dict) -> list[PayloadObject]:
    """The descriptor's distinct payloads, in worker order, each with the host that uploads it."""
    host_of_unit = {c["unit"]: c["host"] for c in artifact["capsule"]["units"]}
    seen: dict[str, dict[str, Any]] = {}
    for w in artifact["weights"]["workers"]:
        p = w["payload"]
        if p is None:
            continue
        entry = seen.setdefault(p["sha256"], {"size": p["size"], "path": p["path"], "workers": [], "hosts": []})
        if entry["size"] != p["size"]:
            raise IntegrityError(f"payload {p['sha256']} is recorded with sizes {entry['size']} and {p['size']}",
                                 fix="the descriptor is inconsistent; recapture")
        entry["workers"].append(w["worker"])
        host = host_of_unit[w["unit"]]
        if host not in entry["hosts"]:
            entry["hosts"].append(host)
    return [PayloadObject(sha, e["size"], e["path"], tuple(e["workers"]), tuple(e["hosts"]), e["hosts"][0])
            for sha, e in seen.items()]


def check_target(repository: str, branch: str) -> None:
    """Refuse a malformed repository or branch before anything is contacted."""
    if not re.fullmatch(ids.MODEL_ID, repository or "") or "/" not in repository:
        raise ColdSnapError(f"Hugging Face repository {repository!r} is not 'org/name'",
                            fix="set policy.weights.native.repository to the repository that receives the payloads")
    if not re.fullmatch(BRANCH, branch or "") or ".." in branch:
        raise ColdSnapError(f"upload branch {branch!r} is not a branch name", fix="use e.g. 'main'")


def hub_api(*, endpoint: str | None, token: str | None) -> Any:
    """An ``HfApi`` for ``endpoint`` (None: the library's, i.e. HF_ENDPOINT or the public Hub)."""
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.utils import disable_progress_bars
    except ImportError:
        raise ColdSnapError("publishing native payloads needs the huggingface_hub library on this host",
                            fix="pip install huggingface_hub") from None
    disable_progress_bars()  # module stdout must stay JSON
    return HfApi(endpoint=endpoint, token=token if token else False)


def _scrub(text: str, token: str | None) -> str:
    return text.replace(token, "********") if token else text


def _hub_error(what: str, exc: BaseException, token: str | None) -> ColdSnapError:
    msg = _scrub(f"{type(exc).__name__}: {exc}", token).strip().splitlines()
    return ColdSnapError(f"{what}: {msg[0] if msg else type(exc).__name__}", fix=HUB_FIX)


def remote_objects(api: Any, repository: str, revision: str, paths: list[str], *,
                   token: str | None) -> dict[str, tuple[str | None, int]]:
    """``{path: (lfs sha256 hex or None, size)}`` of the given paths that exist at ``revision``."""
    if not paths:
        return {}
    try:
        infos = api.get_paths_info(repository, paths, revision=revision)
    except Exception as exc:  # the library raises many types; all mean "cannot tell"
        raise _hub_error(f"cannot list {len(paths)} payload path(s) of {repository}@{revision}", exc, token) from None
    out: dict[str, tuple[str | None, int]] = {}
    for info in infos:
        lfs = getattr(info, "lfs", None)
        if hasattr(info, "size"):
            out[info.path] = (lfs.sha256 if lfs is not None else None, int(info.size))
    return out


def branch_head(api: Any, repository: str, branch: str, *, token: str | None) -> str | None:
    """The commit ``branch`` points to now, or None when the branch does not exist."""
    try:
        refs = api.list_repo_refs(repository)
    except Exception as exc:
        raise _hub_error(f"cannot read the refs of {repository}", exc, token) from None
    for ref in refs.branches:
        if ref.name == branch:
            return ref.target_commit
    return None


def upload_host_payloads(*, artifact: dict, host: str, state_root: Path, repository: str, branch: str,
                         token: str | None, endpoint: str | None, check_mode: bool = False,
                         create_branch: bool = True, api: Any = None) -> dict[str, Any]:
    """Re-hash this capture host's payloads and upload the distinct objects it owns; one commit at most.

    Returns ``{"changed", "objects": [...], "commit"}``; each object says
    ``action`` (``uploaded``, ``present``, ``verified`` (owned by another host),
    ``would-upload``) and how long its re-hash took.
    """
    check_target(repository, branch)
    objects = [o for o in payload_objects(artifact) if host in o.hosts]
    if not objects:
        return {"changed": False, "objects": [], "commit": None, "msg": f"no payload was captured on {host}"}
    cache = NodeCache(state_root)
    verifier = PayloadVerifier()
    results: list[dict[str, Any]] = []
    verified: dict[str, VerifiedPayload] = {}
    with contextlib.ExitStack() as stack:
        if not check_mode:
            # Every lock before any hash, in one order on every host: two publishes that share
            # payloads never hold one each and wait on the other.
            for digest in sorted({o.sha256 for o in objects}):
                stack.enter_context(cache.lock(digest))
        for obj in objects:
            if check_mode:
                vp = verifier.verify(cache, obj.sha256, obj.size, write_record=False, rehash=True)
            else:
                # The lock is held until the upload finished: nothing replaces the pack between hash and send.
                vp = verifier.verify_locked(cache.path_for(obj.sha256), obj.sha256, obj.size, rehash=True)
            stack.callback(vp.close)
            verified[obj.sha256] = vp
            results.append({**obj.as_dict(), "rehash_seconds": round(vp.seconds, 6), "bytes_hashed": vp.bytes_hashed,
                            "action": "verified"})
        mine = [o for o in objects if o.upload_host == host]
        if not mine:
            return {"changed": False, "objects": results, "commit": None}
        api = api or hub_api(endpoint=endpoint, token=token)
        head = branch_head(api, repository, branch, token=token)
        remote = remote_objects(api, repository, head, [o.path for o in mine], token=token) if head else {}
        todo = []
        for obj, res in ((o, next(r for r in results if r["sha256"] == o.sha256)) for o in mine):
            got = remote.get(obj.path)
            if got is not None and got == (obj.sha256.split(":", 1)[1], obj.size):
                res["action"] = "present"
            else:
                res["action"] = "would-upload" if check_mode else "uploaded"
                todo.append(obj)
        if not todo or check_mode:
            return {"changed": bool(todo), "objects": results, "commit": None}
        if head is None:
            if not create_branch:
                raise ColdSnapError(f"branch {branch!r} does not exist in {repository}",
                                    fix="create it, or let publish-native create it (create_branch)")
            try:
                api.create_branch(repository, branch=branch, exist_ok=True)
            except Exception as exc:
                raise _hub_error(f"cannot create branch {branch!r} in {repository}", exc, token) from None
        commit = _commit(api, repository, branch, todo, verified, artifact=artifact, host=host, token=token)
    return {"changed": True, "objects": results, "commit": commit}


def _commit(api: Any, repository: str, branch: str, objects: list[PayloadObject],
            verified: dict[str, VerifiedPayload], *, artifact: dict, host: str, token: str | None) -> str:
    try:
        from huggingface_hub import CommitOperationAdd
    except ImportError:
        raise ColdSnapError("publishing native payloads needs huggingface_hub", fix="pip install huggingface_hub") \
            from None
    ops = []
    for obj in objects:
        vp = verified[obj.sha256]
        vp.recheck()  # the open file is still the one hashed
        # The library reads the verified inode through its descriptor, never the pack's name again: a file
        # put under that name since the re-hash is not what gets uploaded under its digest.
        op = CommitOperationAdd(path_in_repo=obj.path, path_or_fileobj=f"/proc/self/fd/{vp.fileno()}")
        # The digest was just verified under the lock: the library need not read the file to hash it again.
        op.upload_info.sha256 = bytes.fromhex(obj.sha256.split(":", 1)[1])
        ops.append(op)
    try:
        info = api.create_commit(repository, ops, revision=branch,
                                 commit_message=f"ColdSnap model payloads of capture {artifact['capture_id']}",
                                 commit_description=f"{len(ops)} content-addressed payload(s) uploaded from {host}.")
    except Exception as exc:
        raise _hub_error(f"upload of {len(ops)} payload(s) to {repository} (branch {branch!r}) failed", exc,
                         token) from None
    return str(info.oid)


def resolve_revision(*, artifact: dict, repository: str, branch: str, token: str | None, endpoint: str | None,
                     api: Any = None, check_mode: bool = False) -> dict[str, Any]:
    """Resolve ``branch`` to its immutable commit and prove every payload is there with its digest and size.

    In check mode the upload before it only said what it would upload: a branch that does not hold the
    payloads yet is what a real run would fix, so the answer is ``revision: None`` with ``pending: true``
    (the commit a real upload makes cannot be known in advance), not an error."""
    check_target(repository, branch)
    objects = payload_objects(artifact)
    if not objects:
        raise ColdSnapError(f"capture {artifact['capture_id']} has no native payload to publish",
                            fix="capture with policy.weights.native.export enabled")
    api = api or hub_api(endpoint=endpoint, token=token)
    commit = branch_head(api, repository, branch, token=token)
    pending = {"revision": None, "pending": True, "repository": repository, "branch": branch,
               "objects": [o.as_dict() for o in objects]}
    if commit is None and check_mode:
        return pending
    if commit is None:
        raise ColdSnapError(f"branch {branch!r} does not exist in {repository}", fix="upload the payloads first")
    if not re.fullmatch(ids.COMMIT, commit):
        raise IntegrityError(f"branch {branch!r} of {repository} resolved to {commit!r}, not a commit id",
                             fix="the endpoint is not a Hugging Face Hub")
    remote = remote_objects(api, repository, commit, [o.path for o in objects], token=token)
    missing = [o.path for o in objects if remote.get(o.path) != (o.sha256.split(":", 1)[1], o.size)]
    if missing and check_mode:
        return pending
    if missing:
        detail = ", ".join(f"{p} (absent)" if p not in remote else f"{p} (lfs {remote[p][0]}, {remote[p][1]} bytes)"
                           for p in missing[:5])
        raise IntegrityError(f"commit {commit} of {repository} does not hold the payloads as captured: {detail}",
                             fix="publish-native again; nothing was recorded")
    return {"revision": commit, "repository": repository, "branch": branch,
            "objects": [o.as_dict() for o in objects]}


def pack_path(state_root: Path, sha256: str) -> Path:
    """Where a payload object lives in a host's node cache."""
    return Path(state_root) / pack_relpath(ids.parse_digest(sha256, what="model payload digest"))
