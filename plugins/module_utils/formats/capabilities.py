"""``coldsnap capabilities``: the machine-readable list of what this ColdSnap speaks."""

from __future__ import annotations

from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import versions as v
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.drivers import SNAPSHOT_DRIVERS
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.engines import ENGINES
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import (
    OPERATIONS,
    RUNTIMES,
    WEIGHT_MODES,
)


def capabilities() -> dict:
    """Supported operations, format numbers, engines, snapshot drivers and runtimes."""
    return {
        "format": v.CAPABILITIES_FORMAT,
        "kind": v.CAPABILITIES_KIND,
        "version": v.COLDSNAP_VERSION,
        "operations": list(OPERATIONS),
        "formats": {
            "request": v.REQUEST_FORMAT,
            "artifact": v.ARTIFACT_FORMAT,
            "receipt": v.RECEIPT_FORMAT,
            "timing": v.TIMING_FORMAT,
            "cskv": v.CSKV_VERSION,
            "activation_runtime": v.ACTIVATION_RUNTIME_ABI,
            "native_manifest": v.NATIVE_MANIFEST_FORMAT,
            "validation_record": v.VALIDATION_RECORD_FORMAT,
        },
        "engines": [e.as_capability() for e in ENGINES.values()],
        "snapshot_drivers": [d.as_capability() for d in SNAPSHOT_DRIVERS.values()],
        "runtimes": list(RUNTIMES),
        "weight_modes": list(WEIGHT_MODES),
        "activation_runtime": {"content_addressed": True, "abi": v.ACTIVATION_RUNTIME_ABI},
    }
