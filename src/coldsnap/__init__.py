"""The ColdSnap controller: strict requests in, ansible-runner playbooks, receipts out.

Run operations from Python with :mod:`coldsnap.api`, from a shell with ``coldsnap``.
"""

from __future__ import annotations

from coldsnap import _collection  # noqa: F401  (makes ansible_collections.coldsnap.fleet importable)

try:
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.versions import COLDSNAP_VERSION
except ImportError:  # no collection: `coldsnap --help` still works and says how to install it
    from importlib.metadata import version

    COLDSNAP_VERSION = version("coldsnap")

__version__ = COLDSNAP_VERSION
