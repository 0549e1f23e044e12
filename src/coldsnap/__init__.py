"""The ColdSnap controller: strict requests in, ansible-runner playbooks, receipts out."""

from __future__ import annotations

from coldsnap import _collection  # noqa: F401  (makes ansible_collections.coldsnap.fleet importable)

# isort: split
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.versions import COLDSNAP_VERSION

__version__ = COLDSNAP_VERSION
