"""What a capsule may hold, by path: the one policy for the state target and the declared
cache paths, used when a request is validated (before any host is touched) and again
when a capsule is built.

A capsule never carries model bytes (model mounts, Hugging Face caches), never overlays
a system directory, and its paths never nest.
"""

from __future__ import annotations

import posixpath

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError

NO_CAPSULE_UNDER = ("/proc", "/sys", "/dev")
SYSTEM_ROOTS = ("/", "/bin", "/boot", "/dev", "/etc", "/lib", "/lib64", "/proc", "/run", "/sbin", "/sys", "/usr",
                "/var", "/tmp", "/root", "/home", "/opt", "/opt/coldsnap")


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
    if looks_like_hf_cache(norm):
        raise ColdSnapError(f"capsule cache path {norm!r} looks like a Hugging Face cache",
                            fix="model bytes travel as payloads or pinned snapshots, never inside a capsule; "
                                "remove this path from policy.cache.paths")
    if state is not None and paths_overlap(norm, state):
        raise ColdSnapError(f"capsule cache path {norm!r} overlaps the state target {state!r}",
                            fix="keep derived caches outside the capture state directory")
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
