"""The activation runtime on a host: content-addressed staging and digest checks.

``<state_root>/activation-runtime/sha256/<digest>/`` holds one exact copy of the
runtime files; the digest covers every file's path, mode bit (x) and bytes, so a
changed file is a different runtime and a tampered copy is refused.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import shutil
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import fsync_dir
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import StateLayout
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.identifiers import parse_digest
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.housekeeping import clean_stale_temps

SKIP = ("__pycache__", ".pyc", ".pytest_cache")


def _files(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP)
        for f in sorted(filenames):
            if not f.endswith(SKIP) and not f.startswith("."):
                out.append(Path(dirpath) / f)
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def bytecode_in(root: Path) -> list[str]:
    """Compiled files or ``__pycache__`` directories below ``root`` (the digest excludes them)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        out += [os.path.join(dirpath, d) for d in dirnames if d == "__pycache__"]
        out += [os.path.join(dirpath, f) for f in filenames if f.endswith((".pyc", ".pyo"))]
    return sorted(out)


def is_staged(path: Path, digest: str) -> bool:
    """``path`` holds the runtime ``digest`` names, intact and without stray bytecode (which the digest
    does not see, and which Python would load instead of the sources)."""
    return path.is_dir() and not bytecode_in(path) and tree_digest(path) == digest


def _entries_digest(entries) -> str:
    """``sha256:<hex>`` over (relative path, executable bit, content) of ``(name, bytes, executable)``
    entries in name order: one definition for a tree on disk and a file map in memory."""
    h = hashlib.sha256()
    for rel, data, executable in entries:
        name = rel.encode()
        h.update(len(name).to_bytes(4, "big") + name + (b"x" if executable else b"-") + len(data).to_bytes(8, "big"))
        h.update(data)
    return "sha256:" + h.hexdigest()


def tree_digest(root: Path) -> str:
    """``sha256:<hex>`` over (relative path, executable bit, content) of every file."""
    root = Path(root)
    return _entries_digest((f.relative_to(root).as_posix(), f.read_bytes(), os.access(f, os.X_OK))
                           for f in _files(root))


def runtime_dirs(paths: list) -> list[Path]:
    """Activation runtime directories on the control node: ``paths``, or the collection's own
    ``runtime_image/activation``; each must hold ``coldsnap_activation/__main__.py``."""
    dirs = [Path(p) for p in paths] or [Path(__file__).resolve().parents[3] / "runtime_image" / "activation"]
    for d in dirs:
        if not (d / "coldsnap_activation" / "__main__.py").is_file():
            raise ColdSnapError(f"{d} is not an activation runtime directory (no coldsnap_activation/__main__.py)",
                                fix="give the collection's runtime_image/activation directory, or nothing")
    return dirs


def file_map(root: Path) -> dict[str, dict]:
    """The runtime's files as one value for a module option: relative path -> ``{"content": base64,
    "executable": bool}``, exactly the files :func:`tree_digest` covers (read on the control node, so
    the runtime reaches a host in the module's own arguments: one task, no per-file copies)."""
    root = Path(root)
    return {f.relative_to(root).as_posix(): {"content": base64.b64encode(f.read_bytes()).decode("ascii"),
                                             "executable": os.access(f, os.X_OK)} for f in _files(root)}


def _safe_relpath(rel: object) -> str:
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\x00" in rel or "\\" in rel:
        raise ColdSnapError(f"activation runtime file name {rel!r} is not a relative path",
                            fix="pass the map the coldsnap.fleet.activation_files lookup returns")
    parts = rel.split("/")
    if any(part in ("", ".", "..") or part.startswith(".") or part in SKIP or part.endswith(SKIP)
           for part in parts):
        raise ColdSnapError(f"activation runtime file name {rel!r} is not a plain relative path of the runtime",
                            fix="pass the map the coldsnap.fleet.activation_files lookup returns")
    return rel


def decode_files(files: dict, digest: str) -> list[tuple[str, bytes, bool]]:
    """The runtime given as :func:`file_map`'s map, checked in memory: plain relative names, base64
    content, and exactly ``digest`` (as :func:`tree_digest` computes it). [(name, bytes, executable)]."""
    parse_digest(digest, what="activation runtime digest")
    if not isinstance(files, dict) or not files:
        raise ColdSnapError("the activation runtime file map is empty",
                            fix="pass the map the coldsnap.fleet.activation_files lookup returns")
    out = []
    for name, entry in sorted(files.items()):
        rel = _safe_relpath(name)
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise ColdSnapError(f"activation runtime file {rel!r} has no base64 content",
                                fix="pass the map the coldsnap.fleet.activation_files lookup returns")
        try:
            data = base64.b64decode(entry["content"], validate=True)
        except (binascii.Error, ValueError):
            raise ColdSnapError(f"activation runtime file {rel!r} is not valid base64",
                                fix="pass the map the coldsnap.fleet.activation_files lookup returns") from None
        out.append((rel, data, bool(entry.get("executable"))))
    got = _entries_digest(out)  # sorted by name, as tree_digest walks a tree
    if got != digest:
        raise IntegrityError(f"the activation runtime files given have digest {got}, expected {digest}",
                             fix="pass the files and the digest of the same collection version")
    return out


def stage_files(files: dict, state_root: Path, digest: str) -> tuple[str, Path, bool]:
    """Stage a runtime given as :func:`file_map`'s map; it must have exactly ``digest`` (checked before
    anything lands under the content-addressed name). (digest, path, changed)."""
    entries = decode_files(files, digest)
    final = staged_path(state_root, digest)
    if is_staged(final, digest):
        return digest, final, False
    StateLayout(state_root).ensure_private_root()
    final.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # A temporary name the next operation removes if this one is killed (see .housekeeping).
    incoming = final.with_name(f".{final.name}.incoming.tmp-{os.getpid()}")
    shutil.rmtree(incoming, ignore_errors=True)
    incoming.mkdir(mode=0o700)
    try:
        for rel, data, executable in entries:
            dst = incoming / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)
            os.chmod(dst, 0o755 if executable else 0o644)
        got, path, changed = stage(incoming, state_root)  # hashes what was written, once
        if got != digest:
            raise IntegrityError(f"the activation runtime files written have digest {got}, expected {digest}",
                                 fix="check the state root's file system (the files given had the right digest)")
        return got, path, changed
    finally:
        shutil.rmtree(incoming, ignore_errors=True)


def require_runtime_dir(src: Path) -> None:
    """``src`` is an activation runtime directory (it holds ``coldsnap_activation/__main__.py``)."""
    if not src.is_dir():
        raise ColdSnapError(f"src {src} is not a directory" if src.exists() else f"src {src} does not exist",
                            fix="give the collection's runtime_image/activation directory, or leave src out to "
                                "ask whether a digest is staged")
    runtime_dirs([src])


def staged_path(state_root: Path, digest: str) -> Path:
    return StateLayout(state_root).activation_runtime(parse_digest(digest, what="activation runtime digest"))


def stage(source: Path, state_root: Path) -> tuple[str, Path, bool]:
    """Copy ``source`` into the content-addressed store; (digest, path, changed)."""
    StateLayout(state_root).ensure_private_root()
    digest = tree_digest(source)
    final = staged_path(state_root, digest)
    if final.is_dir() and not bytecode_in(final) and tree_digest(final) == digest:
        return digest, final, False
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    for f in _files(source):
        dst = tmp / f.relative_to(source)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dst)
    if tree_digest(tmp) != digest:
        shutil.rmtree(tmp, ignore_errors=True)
        raise IntegrityError(f"activation runtime copy from {source} changed while staging",
                             fix="stage again once the source is stable")
    for dirpath, _dirs, files in os.walk(tmp):
        os.chmod(dirpath, 0o755)
        for f in files:
            p = os.path.join(dirpath, f)
            os.chmod(p, 0o755 if os.access(p, os.X_OK) else 0o644)
    final.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if os.path.lexists(final):
        # A damaged copy under the final name: move it aside first, so the name always holds a whole tree.
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(final.parent)
    return digest, final, True


def require_staged(state_root: Path, digest: str) -> Path:
    """The staged runtime for ``digest``, verified; refuse a missing or altered copy."""
    path = staged_path(state_root, digest)
    if not path.is_dir():
        raise IntegrityError(f"activation runtime {digest} is not staged at {path}",
                             fix="run the coldsnap.fleet.activation role (or stage it with the unit module)")
    bytecode = bytecode_in(path)
    if bytecode:
        # Python would run these instead of the digested sources (the runtime never writes them).
        raise IntegrityError(f"staged activation runtime at {path} holds bytecode the digest does not cover "
                             f"({bytecode[0]})", fix=f"remove {path} and stage it again")
    got = tree_digest(path)
    if got != digest:
        raise IntegrityError(f"staged activation runtime at {path} has digest {got}, expected {digest}",
                             fix=f"remove {path} and stage it again")
    return path


def look(state_root: Path, digest: str, *, check_mode: bool = False) -> dict:
    """Is ``digest`` staged here, intact and without stray bytecode? Also clears what killed runs left.

    The module result both ``activation_runtime`` (without ``src``) and ``host_facts`` (with
    ``activation_digest``) return: ``changed`` (leftovers removed), ``staged``, ``digest``,
    ``path`` and ``cleaned``.
    """
    path = staged_path(state_root, digest)
    cleaned = clean_stale_temps(state_root, check_mode=check_mode)
    staged = is_staged(path, digest)
    return {"changed": bool(cleaned), "staged": staged, "digest": digest, "path": str(path), "cleaned": cleaned}
