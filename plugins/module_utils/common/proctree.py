"""Process trees as this host's /proc shows them (no dependency on any other ColdSnap layer)."""

from __future__ import annotations

from pathlib import Path


def process_tree(root: int) -> set[int]:
    """``root`` and every descendant (by parent pid), as this host sees them now."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        ppid = parent_pid(int(proc.name))
        if ppid is not None:
            children.setdefault(ppid, []).append(int(proc.name))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo.extend(children.get(pid, []))
    return tree


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid`` (None when it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def start_time(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot, /proc's field 22; None when it is gone): with the pid,
    what tells one process from a later one that reuses its number."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def environment_value(pid: int, name: str) -> bytes | None:
    """The value of environment variable ``name`` in ``pid``'s initial environment (None if unset or unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = name.encode() + b"="
    for item in raw.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix):]
    return None


def marked_root(pid: int, name: str) -> int:
    """The oldest ancestor of ``pid`` (``pid`` itself at least) that was started with the same value of
    environment variable ``name`` as ``pid``: the process a launcher started, when ``pid`` is its
    child (an engine whose control API lives in an engine-core process under its API server)."""
    mark = environment_value(pid, name)
    root = pid
    if mark is None:
        return root
    while True:
        up = parent_pid(root)
        if up is None or up <= 1 or environment_value(up, name) != mark:
            return root
        root = up
