"""Make the collection importable as ``ansible_collections.coldsnap.fleet`` from the controller.

A dev checkout gets it from ``<venv>/collections`` (a .pth file set up by
scripts/setup-venv.sh). An installed controller finds the collection in the
configured Ansible collections paths; we add the first one that holds it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def collection_root() -> Path:
    """Directory that contains ``ansible_collections/coldsnap/fleet``."""
    candidates = []
    env = os.environ.get("ANSIBLE_COLLECTIONS_PATH") or os.environ.get("ANSIBLE_COLLECTIONS_PATHS") or ""
    candidates += [Path(p) for p in env.split(os.pathsep) if p]
    candidates += [Path(sys.prefix) / "collections", Path.home() / ".ansible" / "collections",
                   Path("/usr/share/ansible/collections")]
    for c in candidates:
        if (c / "ansible_collections" / "coldsnap" / "fleet" / "plugins").is_dir():
            return c
    raise RuntimeError(
        "collection coldsnap.fleet not found; run scripts/setup-venv.sh (dev checkout) or "
        "'ansible-galaxy collection install' the collection and set ANSIBLE_COLLECTIONS_PATH"
    )


def _ensure_importable() -> None:
    try:
        import ansible_collections.coldsnap.fleet.plugins.module_utils  # noqa: F401
        return
    except ImportError:
        pass
    sys.path.insert(0, str(collection_root()))


_ensure_importable()
