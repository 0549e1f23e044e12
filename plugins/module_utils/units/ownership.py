"""Who owns what ColdSnap writes as root on behalf of a user: the rank containers of runtime
``docker`` run as root, and everything they wrote (the capture directory, the workload
directory, the unit run files, the node payload cache) is given back to the invoking user
afterwards, also when the run failed, with mode bits (set-id bits included) kept and the
model packs' validation records kept valid.
"""

from __future__ import annotations

import contextlib
import json
import os
import pkgutil
import stat
import textwrap
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import dockerapi
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import records
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import ownership_walk
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.containers import (
    LABEL_ROLE,
    OWNERSHIP_HELPER_CAPS,
    _default_probe_image,
    create_container,
)


@dataclass(frozen=True)
class Owner:
    """The invoking user: who owns the state ColdSnap writes."""

    uid: int
    gid: int


def parse_owner(value: Any) -> Owner | None:
    """``{'uid': U, 'gid': G}``, ``'U:G'`` or None (leave ownership as written)."""
    if value in (None, "", {}):
        return None
    try:
        if isinstance(value, dict):
            uid, gid = int(value["uid"]), int(value["gid"])
        else:
            left, sep, right = str(value).partition(":")
            if not sep:
                raise ValueError(value)
            uid, gid = int(left), int(right)
    except (KeyError, TypeError, ValueError):
        raise ColdSnapError(f"owner {value!r} is not a uid/gid pair",
                            fix="pass coldsnap_owner as {'uid': 1000, 'gid': 1000} or '1000:1000'") from None
    if uid < 0 or gid < 0:
        raise ColdSnapError(f"owner {value!r} has a negative id", fix="pass the invoking user's numeric uid and gid")
    return Owner(uid, gid)


def restore_ownership(paths: Iterable[str | Path], uid: int, gid: int) -> int:
    """Give every entry below ``paths`` to uid:gid without changing mode bits; return how many changed.

    Symlinks are changed themselves, never followed; entries that already belong to uid:gid are left
    alone (no ctime change); see :mod:`.ownership_walk`.
    """
    changed = 0
    for given in paths:
        root = os.fspath(given)
        if os.path.lexists(root):
            changed += ownership_walk.give_tree(root, uid, gid)
    return changed


def _sidecar_script() -> str:
    """The ownership sidecar's program: :mod:`.ownership_walk` itself (one implementation), then a call."""
    walker = pkgutil.get_data(__name__.rsplit(".", 1)[0], "ownership_walk.py")
    if walker is None:
        raise ColdSnapError("the ownership walker is missing from this installation", fix="reinstall the collection")
    return walker.decode() + textwrap.dedent("""
        import json, sys
        spec = json.loads(sys.argv[1])
        n = sum(give_tree(p, spec["uid"], spec["gid"]) for p in spec["paths"] if os.path.lexists(p))
        print(json.dumps({"changed": n}))
        """)


def _check_owned_paths(paths: Iterable[str | Path]) -> list[str]:
    out: list[str] = []
    for p in paths:
        s = os.path.normpath(os.fspath(p))
        if not s.startswith("/") or s in ("/", "/etc", "/usr", "/var", "/home", "/root", "/bin", "/lib", "/opt",
                                          "/tmp", "/proc", "/sys", "/dev", "/run", "/boot", "/srv"):
            raise ColdSnapError(f"state path {s!r} is not a dedicated ColdSnap path",
                                fix="pass the exact state directories ColdSnap wrote, never a system directory")
        if os.path.islink(s):
            raise ColdSnapError(f"state path {s} is a symlink", fix="pass the real directory, not a link to it")
        planted = _user_link_above(s)
        if planted is not None:
            raise ColdSnapError(f"state path {s} lies below {planted}, a symbolic link that is not root's: handing "
                                "the path over would change what the link points at",
                                fix=f"replace {planted} with the directory itself (the state root's tree holds no "
                                    "links)")
        if s not in out:
            out.append(s)
    return out


def _user_link_above(path: str) -> str | None:
    """The first directory on ``path``'s way from ``/`` that is a symbolic link owned by someone other than
    root: a link the invoking user planted in a tree they own (root's own links, such as a state root on
    another disk, are the administrator's)."""
    cur = "/"
    for part in path.strip("/").split("/")[:-1]:
        cur = os.path.join(cur, part)
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid != 0:
                return cur
            cur = os.path.realpath(cur)
    return None


def chown_state_paths(paths: list[Path], uid: int, gid: int, *, method: str = "auto", image: str | None = None,
                      client: Any = None) -> dict[str, Any]:
    """Give the state paths ColdSnap wrote to the invoking user (uid/gid), keeping mode bits.

    ``method``: ``in-process`` (needs root, or ownership of everything already),
    ``container`` (a short-lived helper container, no network, binding only
    these paths, from ``image`` or the newest local runtime image), or
    ``auto`` (in-process when root, else the container). Returns
    ``{"method", "changed", "paths"}``; missing paths are skipped.
    """
    if not (isinstance(uid, int) and isinstance(gid, int) and uid >= 0 and gid >= 0):
        raise ColdSnapError(f"uid/gid {uid!r}/{gid!r} are not numeric ids", fix="pass the invoking user's uid and gid")
    wanted = [p for p in _check_owned_paths(paths) if os.path.lexists(p)]
    if method not in ("auto", "in-process", "container"):
        raise ColdSnapError(f"ownership method {method!r} is unknown", fix="use auto, in-process or container")
    if not wanted:
        return {"method": "none", "changed": 0, "paths": []}
    if method == "auto":
        method = "in-process" if os.geteuid() == 0 else "container"
    if method == "in-process":
        try:
            changed = restore_ownership(wanted, uid, gid)
        except PermissionError as exc:
            raise ColdSnapError(f"cannot change the owner of {exc.filename} in-process (not root)",
                                fix="use method='container' (a helper container with CAP_CHOWN)") from exc
        return {"method": "in-process", "changed": changed, "paths": wanted}
    return _chown_in_container(wanted, uid, gid, image=image, client=client)


def _chown_in_container(paths: list[str], uid: int, gid: int, *, image: str | None, client: Any) -> dict[str, Any]:
    docker = dockerapi.docker_module()
    client = dockerapi.docker_client(client)
    img = (dockerapi.resolve_image(client, image, what="ownership helper image") if image
           else client.images.get(_default_probe_image(client)))
    mounts = [docker.types.Mount(target=p, source=p, type="bind", read_only=False) for p in paths]
    spec = json.dumps({"uid": uid, "gid": gid, "paths": paths})
    container = create_container(
        client, img.id, ["python3", "-c", _sidecar_script(), spec], entrypoint=[], user="0:0",
        labels={LABEL_ROLE: "ownership-helper"}, network_mode="none", cap_drop=["ALL"],
        cap_add=list(OWNERSHIP_HELPER_CAPS), security_opt=["no-new-privileges"], read_only=True, mounts=mounts)
    try:
        container.start()
        code = int(container.wait(timeout=600).get("StatusCode", -1))
        out = container.logs(stdout=True, stderr=True).decode("utf-8", "replace")
    finally:
        try:
            container.remove(force=True)
        except docker.errors.APIError:
            pass
    if code != 0:
        raise ColdSnapError(f"ownership helper failed (exit {code}) for {', '.join(paths)}: {out.strip()[-500:]}",
                            fix="check that the helper image has python3 and the paths are on local filesystems")
    try:
        changed = int(json.loads(out.strip().splitlines()[-1])["changed"])
    except (ValueError, KeyError, IndexError):
        changed = -1
    return {"method": "container", "changed": changed, "paths": paths}


def normalize_ownership(paths: list[Path], *, state_root: Path, owner: Owner | None, client: Any = None) -> dict:
    """Give ``paths`` to ``owner`` (keeping mode bits); keep model packs' validation records valid.

    A pack's record binds its ctime, which chown changes. For each pack being
    handed over whose record is valid right now, the record is re-written for
    the new identity while the digest's lock is held across the chown, so the
    next verification does not re-hash a pack whose bytes nothing touched.
    (A verifier that runs as another user than the record's owner, other than
    root, still re-hashes: records are trusted only from the verifier's user or root.)
    """
    if owner is None:
        return {"changed": 0, "paths": []}
    cache = NodeCache(state_root)
    existing = [p for p in paths if os.path.lexists(p)]
    if cache.locks.is_dir():
        # The lock files first: the settle below must be able to open them as the owner.
        chown_state_paths([cache.locks], owner.uid, owner.gid, client=client)
    settle: list[tuple[Path, str, int, records.FileIdentity, str]] = []
    with contextlib.ExitStack() as stack:
        if cache.objects.is_dir() and cache.root in [Path(p) for p in existing]:
            for pack in sorted(cache.objects.glob("*.pack")):
                st = os.lstat(pack)
                if (st.st_uid, st.st_gid) == (owner.uid, owner.gid) or not pack.is_file():
                    continue
                hexd = pack.name[:-5]
                try:
                    stack.enter_context(cache.lock(f"sha256:{hexd}", timeout=60))
                except ColdSnapError:
                    continue  # busy: it is re-hashed on its next verification instead
                ident = records.FileIdentity.of(os.lstat(pack))
                rec = records.record_path_for(pack)
                if records.check_record(rec, hexd, ident.st_size, ident).valid:
                    try:
                        method = json.loads(rec.read_text()).get("method", "full-sha256")
                    except (OSError, ValueError):
                        continue
                    settle.append((pack, hexd, ident.st_size, ident, method))
        result = chown_state_paths(existing, owner.uid, owner.gid, client=client)
        for pack, hexd, size, before, method in settle:
            fd = os.open(pack, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                now = records.FileIdentity.of_fd(fd)
                same = (now.st_dev, now.st_ino, now.st_size, now.st_mtime_ns) == \
                       (before.st_dev, before.st_ino, before.st_size, before.st_mtime_ns)
                if not same:
                    continue
                # A record taken within a timestamp tick of the change would be racy: wait it out.
                tick = records.timestamp_tick_ns(now)
                while time.time_ns() - now.last_change_ns() < tick:
                    time.sleep(tick / 1e9)
                observed = time.time_ns()
                if records.FileIdentity.of_fd(fd) != now:
                    continue
                rec = records.record_path_for(pack)
                records.write_record(rec, hexd, size, now, observed, method=method)
                if os.geteuid() == 0:
                    os.lchown(rec, owner.uid, owner.gid)
            finally:
                os.close(fd)
    return result
