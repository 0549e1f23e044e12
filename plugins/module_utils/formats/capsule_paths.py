"""What a capsule may hold, by path: the one policy for the state target and the declared
cache paths, used when a request is validated (before any host is touched) and again
when a capsule is built.

A capsule never carries model bytes (model mounts, Hugging Face caches), never overlays
a system directory, and its paths never nest. A declared cache never holds a secret (a
capsule may be pushed to a registry) nor lies where a restore may not write.

:func:`secrets_exposed` (which host trees hold credentials) is shared with the request's
mount rules: a unit never gets such a tree as a mount either.
"""

from __future__ import annotations

import posixpath

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import (
    ACTIVATION_RUNTIME,
    ARTIFACTS,
    CAPSULES,
    CAPTURES,
    DEFAULT_STATE_ROOT,
    LOCKS,
    RUNS,
    WORKLOADS,
)

NO_CAPSULE_UNDER = ("/proc", "/sys", "/dev")
SYSTEM_ROOTS = ("/", "/bin", "/boot", "/dev", "/etc", "/lib", "/lib64", "/proc", "/run", "/sbin", "/sys", "/usr",
                "/var", "/tmp", "/root", "/home", "/opt", "/opt/coldsnap")
# Where a host-runtime restore never adds cache files (a capsule run as a container may overlay anything
# its capture declared; the host's own system trees are not the capsule's to change). A cache path here is
# refused at validation too: such a capture could never be restored on a host.
NO_HOST_CACHE_UNDER = ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/boot", "/proc", "/sys", "/dev")
# Directories that hold a user's keys and tokens, wherever their home is.
CREDENTIAL_DIRS = frozenset({".ssh", ".gnupg", ".docker", ".kube", ".aws", ".azure", ".config"})
# Host trees that hold secrets: mounted secrets, every container's files, and the directories of ColdSnap's
# default state root that hold operation data (0600 endpoint and control tokens, unit specs, runner data,
# captured process memory, committed artifacts). The state root's other directories (models/, a Hugging
# Face cache of its own) hold model files and stay usable.
_STATE_DIRS = (RUNS, WORKLOADS, CAPTURES, CAPSULES, ARTIFACTS, LOCKS, ACTIVATION_RUNTIME)
SECRET_TREES = {
    "/run/secrets": "the host's mounted secrets",
    "/var/run/secrets": "the host's mounted secrets",
    "/var/lib/docker": "the container engine's data (every container's files and secrets)",
    "/var/lib/containerd": "the container engine's data (every container's files and secrets)",
    **{f"{DEFAULT_STATE_ROOT}/{d}": "ColdSnap's operation data (tokens, unit specs, runner data, captures)"
       for d in _STATE_DIRS},
}


def secrets_exposed(path: str) -> str | None:
    """What secrets a tree at the normalized absolute ``path`` holds, or None: a credential directory
    (a component such as ``.ssh``), a user's home (``/home/<user>``, or ``/home`` itself), or a
    :data:`SECRET_TREES` tree it is, lies below or holds (``/var/lib`` holds ``/var/lib/docker``)."""
    parts = [p for p in path.split("/") if p]
    creds = [p for p in parts if p in CREDENTIAL_DIRS]
    if creds:
        return f"a user's credentials ({creds[0]})"
    if parts[:1] == ["home"] and len(parts) <= 2:
        return "a user's home directory (its keys and tokens)" if len(parts) == 2 else "the users' home directories"
    for tree, what in SECRET_TREES.items():
        if paths_overlap(path, tree):
            return what if path == tree or path.startswith(tree + "/") else f"{what} (it holds {tree})"
    return None


def normalize_abs(path: str) -> str:
    """``posixpath.normpath`` of an absolute path, with POSIX's two leading slashes (``//etc``, which Linux
    reads as ``/etc``) collapsed to one."""
    norm = posixpath.normpath(path)
    return "/" + norm.lstrip("/") if norm.startswith("/") else norm


def _norm_abs(path: str, *, what: str) -> str:
    if not isinstance(path, str) or not path.startswith("/"):
        raise ColdSnapError(f"{what} {path!r} is not an absolute path", fix="give an absolute path inside the unit")
    if "\x00" in path or any(p == ".." for p in path.split("/")):
        raise ColdSnapError(f"{what} {path!r} contains '..' or NUL", fix="give a normalized absolute path")
    return normalize_abs(path)


def paths_overlap(a: str, b: str) -> bool:
    """True when one absolute path is the other or lies below it (component-wise)."""
    a, b = a.rstrip("/") or "/", b.rstrip("/") or "/"
    if a in (b, "/") or b == "/":
        return True
    return a.startswith(b + "/") or b.startswith(a + "/")


def looks_like_hf_cache(path: str) -> bool:
    """Hugging Face hub caches: a 'huggingface' component, HF_HOME-style '.../hub', or 'models--*' dirs."""
    parts = [p for p in path.split("/") if p]
    if "huggingface" in parts or (parts and parts[-1] == "hub"):
        return True
    return any(p.startswith("models--") or p.startswith("datasets--") for p in parts)


def _check_path(norm: str, what: str, *, state: str | None, forbidden: list[str], caches: list[str]) -> None:
    if norm in SYSTEM_ROOTS or any(paths_overlap(norm, r) for r in NO_CAPSULE_UNDER):
        raise ColdSnapError(f"capsule {what} {norm!r} would overlay a system directory",
                            fix="use a dedicated directory such as /var/lib/coldsnap/state or /root/.cache/<engine>")
    for f in forbidden:
        if paths_overlap(norm, f):
            raise ColdSnapError(f"capsule {what} {norm!r} overlaps mount {f!r} (it overlaps the unit's mount, "
                                "whose bytes never enter a capsule)",
                                fix="model mounts and other launch mounts never enter a capsule; "
                                    "remove the path from policy.cache.paths")
    if what != "cache path":
        return
    for tree in NO_HOST_CACHE_UNDER:
        if paths_overlap(norm, tree):
            raise ColdSnapError(f"capsule cache path {norm!r} lies in the host's system tree {tree!r}, where a "
                                "restore never writes caches (such a capture could never be restored)",
                                fix="keep derived caches under /root/.cache/<engine>, /var/cache/<engine> or the "
                                    "engine's own cache root; remove this path from policy.cache.paths")
    if looks_like_hf_cache(norm):
        raise ColdSnapError(f"capsule cache path {norm!r} looks like a Hugging Face cache",
                            fix="model bytes travel as payloads or pinned snapshots, never inside a capsule; "
                                "remove this path from policy.cache.paths")
    if state is not None and paths_overlap(norm, state):
        raise ColdSnapError(f"capsule cache path {norm!r} overlaps the state target {state!r}",
                            fix="keep derived caches outside the capture state directory")
    secret = secrets_exposed(norm)
    if secret:
        raise ColdSnapError(f"capsule cache path {norm!r} would put {secret} into the capsule, which "
                            "'coldsnap publish' pushes to a registry",
                            fix="declare only the engine's derived cache directories (e.g. /root/.cache/<engine>); "
                                "remove this path from policy.cache.paths")
    for other in caches:
        if paths_overlap(norm, other):
            raise ColdSnapError(f"capsule cache paths {other!r} and {norm!r} overlap",
                                fix="declare each cache directory once, without nesting")


def check_capsule_paths(state_target: str, cache_paths: list[str], forbidden_paths: list[str]) -> tuple[str, list[str]]:
    """Refuse capsule targets that would carry model data or overlay the system; return them normalized.

    ``forbidden_paths`` are the request's mount targets (model mounts, the
    activation runtime, ...): neither the state nor a cache may overlap one.
    """
    state = _norm_abs(state_target, what="capsule state target")
    forbidden = [_norm_abs(p, what="forbidden path") for p in forbidden_paths]
    _check_path(state, "state target", state=None, forbidden=forbidden, caches=[])
    caches: list[str] = []
    for c in cache_paths:
        norm = _norm_abs(c, what="capsule cache path")
        _check_path(norm, "cache path", state=state, forbidden=forbidden, caches=caches)
        caches.append(norm)
    return state, caches


def cache_path_problems(cache_paths: list[str], forbidden_paths: list[str]) -> list[tuple[int, str, str]]:
    """``(index, problem, fix)`` for each declared cache path a capsule build would refuse (the state
    target is not known before capture; its own checks run at build time)."""
    out: list[tuple[int, str, str]] = []
    caches: list[str] = []
    forbidden = [posixpath.normpath(p) for p in forbidden_paths if isinstance(p, str) and p.startswith("/")]
    for i, c in enumerate(cache_paths):
        try:
            norm = _norm_abs(c, what="capsule cache path")
            _check_path(norm, "cache path", state=None, forbidden=forbidden, caches=caches)
            caches.append(norm)
        except ColdSnapError as exc:
            out.append((i, exc.problem, exc.fix or ""))
    return out
