"""Make the collection importable as ``ansible_collections.coldsnap.fleet`` from the controller.

A dev checkout gets it from ``<venv>/collections`` (a .pth file set up by
scripts/setup-venv.sh). An installed controller finds the collection in the
configured Ansible collections paths; we add the first one that holds it.

When it is nowhere, importing ``coldsnap`` still works (``coldsnap --help`` does),
and the first import of the collection raises :class:`CollectionNotFound`, an
ImportError that says how to install it, instead of "No module named ...".
"""

from __future__ import annotations

import os
import sys
from importlib.abc import MetaPathFinder
from pathlib import Path

INSTALL_FIX = (
    "in a dev checkout run scripts/setup-venv.sh; otherwise install the collection "
    "('ansible-galaxy collection install coldsnap-fleet-<version>.tar.gz') and set ANSIBLE_COLLECTIONS_PATH "
    "to the directory it went to"
)


class CollectionNotFound(ImportError):
    """The Ansible collection coldsnap.fleet is not installed where the controller looks."""

    def __init__(self, searched: list[Path]) -> None:
        self.searched = searched
        self.fix = INSTALL_FIX
        super().__init__(f"the Ansible collection coldsnap.fleet is not importable (looked in "
                         f"{', '.join(map(str, searched))}); {INSTALL_FIX}")


def _candidates() -> list[Path]:
    env = os.environ.get("ANSIBLE_COLLECTIONS_PATH") or os.environ.get("ANSIBLE_COLLECTIONS_PATHS") or ""
    return [*(Path(p) for p in env.split(os.pathsep) if p), Path(sys.prefix) / "collections",
            Path.home() / ".ansible" / "collections", Path("/usr/share/ansible/collections")]


def collection_root() -> Path:
    """Directory that contains ``ansible_collections/coldsnap/fleet``; CollectionNotFound if none does."""
    candidates = _candidates()
    for c in candidates:
        if (c / "ansible_collections" / "coldsnap" / "fleet" / "plugins").is_dir():
            return c
    raise CollectionNotFound(candidates)


class _ReportMissing(MetaPathFinder):
    """Last on ``sys.meta_path``: asked only when no other finder has the collection."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname == "ansible_collections" or fullname.startswith("ansible_collections.coldsnap"):
            raise CollectionNotFound(_candidates())


def _ensure_importable() -> None:
    try:
        import ansible_collections.coldsnap.fleet.plugins.module_utils  # noqa: F401
        return
    except ImportError:
        pass
    try:
        sys.path.insert(0, str(collection_root()))
    except CollectionNotFound:
        sys.meta_path.append(_ReportMissing())


_ensure_importable()
