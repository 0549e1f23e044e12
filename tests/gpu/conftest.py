"""GPU tests: real CUDA checkpoint/VMM on an NVIDIA GPU; they skip cleanly without one.

They use only the per-host code (no Ansible), so they also run on a GPU host that has
just torch, cuda-python and CRIU (``COLDSNAP_CRIU``), e.g. with plain ``python3 -m pytest``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _importable() -> None:
    try:
        import ansible_collections.coldsnap.fleet.plugins.module_utils  # noqa: F401
    except ImportError:
        coll = Path(tempfile.mkdtemp(prefix="coldsnap-coll-"))
        (coll / "ansible_collections" / "coldsnap").mkdir(parents=True)
        (coll / "ansible_collections" / "coldsnap" / "fleet").symlink_to(REPO)
        sys.path.insert(0, str(coll))
        os.environ["PYTHONPATH"] = os.pathsep.join([str(coll), os.environ.get("PYTHONPATH", "")])
    integ = str(REPO / "runtime_image" / "integrations")
    if integ not in sys.path:
        sys.path.insert(0, integ)
        os.environ["PYTHONPATH"] = os.pathsep.join([integ, os.environ.get("PYTHONPATH", "")])


_importable()


@pytest.fixture(scope="session", autouse=True)
def native_fill_built():
    """Build native/fill.c when a C compiler is there, so restores hydrate through the C fill
    (as a GPU host set up with scripts/setup-venv.sh does); without one they take the Python loop."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import native_fill

    if native_fill.compiler():
        native_fill.ensure_built()
    path = native_fill.default_library_path()
    return bool(path and path.is_file())


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        ok = torch.cuda.is_available()
    except Exception:
        ok = False
    if not ok:
        skip = pytest.mark.skip(reason="no NVIDIA GPU")
        for item in items:
            if "tests/gpu/" in str(item.fspath).replace(os.sep, "/"):
                item.add_marker(skip)
