"""The files a process tree maps or holds open, and whether a host still has them.

CRIU restores a file mapping or an open file by path and refuses a file whose
size changed; it skips that check only for a descriptor opened write-only with
``O_APPEND`` (a log), never for a mapping or an ``O_RDWR|O_APPEND`` descriptor. Capture records what the tree uses;
restore checks it in prepare, before anything running is evicted, so a host
that lacks a compiled-kernel cache or holds another version of a library fails
with the file's name instead of half-way through ``criu restore``.

Left out: pseudo files (``/dev``, ``/proc``, ``/sys``), files deleted while
held (CRIU keeps those in the image with ``--link-remap``), and memfd/SysV
segments (also in the image).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.process.ports import process_tree

PSEUDO_PREFIXES = ("/dev/", "/proc/", "/sys/", "/memfd:", "/SYSV", "/anon_hugepage", "/run/user/")
DELETED = " (deleted)"
O_APPEND = 0o2000
O_ACCMODE, O_WRONLY = 0o3, 0o1


def _regular(path: str) -> int | None:
    """The size of ``path`` when it is a regular file that a restore must find, else None."""
    if not path.startswith("/") or path.endswith(DELETED) or path.startswith(PSEUDO_PREFIXES):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size if os.path.isfile(path) else None


def used_files(pid: int) -> dict[str, dict]:
    """``path -> {"size", "append"}`` for the regular files ``pid`` maps or holds open."""
    out: dict[str, dict] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            parts = line.split(None, 5)
            if len(parts) == 6:
                path = parts[5]
                size = _regular(path)
                if size is not None:
                    out.setdefault(path, {"size": size, "append": False})
    fd_dir = Path(f"/proc/{pid}/fd")
    with contextlib.suppress(OSError):
        for fd in fd_dir.iterdir():
            with contextlib.suppress(OSError, ValueError):
                path = os.readlink(fd)
                size = _regular(path)
                if size is None:
                    continue
                flags = 0
                for line in Path(f"/proc/{pid}/fdinfo/{fd.name}").read_text().splitlines():
                    if line.startswith("flags:"):
                        flags = int(line.split()[1], 8)
                append = unchecked_size(flags)
                entry = out.setdefault(path, {"size": size, "append": append})
                entry["append"] = entry["append"] and append  # any use CRIU size-checks makes it checked
    return out


def unchecked_size(flags: int) -> bool:
    """Whether CRIU leaves the size of a file open with ``flags`` unchecked: write-only and append."""
    return (flags & O_ACCMODE) == O_WRONLY and bool(flags & O_APPEND)


def tree_files(root: int) -> list[dict]:
    """Every regular file the tree rooted at ``root`` maps or holds open, sorted by path."""
    merged: dict[str, dict] = {}
    for pid in sorted(process_tree(root)):
        for path, entry in used_files(pid).items():
            cur = merged.setdefault(path, dict(entry))
            cur["append"] = cur["append"] and entry["append"]
    return [{"path": p, **merged[p]} for p in sorted(merged)]


def file_problems(recorded: list[dict]) -> list[tuple[str, str]]:
    """``(path, problem)`` for each recorded file this host lacks or holds at another size."""
    problems = []
    for f in recorded:
        path = f["path"]
        try:
            st = os.stat(path)
        except FileNotFoundError:
            problems.append((path, "absent"))
            continue
        except OSError as exc:
            problems.append((path, f"unreadable ({exc.strerror})"))
            continue
        if not f.get("append") and st.st_size != f["size"]:
            problems.append((path, f"{st.st_size} bytes here, {f['size']} when captured"))
    return problems


def under(path: str, directory: str) -> bool:
    """Whether ``path`` lies inside ``directory`` (both absolute)."""
    directory = directory.rstrip("/")
    return path == directory or path.startswith(directory + "/")
