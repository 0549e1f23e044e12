"""Process trees as this host's /proc shows them (no dependency on any other ColdSnap layer)."""

from __future__ import annotations

import contextlib
from pathlib import Path


def process_tree(root: int) -> set[int]:
    """``root`` and every descendant (by parent pid), as this host sees them now."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(proc.name))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo.extend(children.get(pid, []))
    return tree
