"""The OCI labels of ColdSnap's images: a capsule's own, and those marking its unit containers;
and the ways a capsule is stored (its ``layout``).

Read by anything that recognises ColdSnap's images and containers (capsule build, inspect and
publish, the docker runtime), so they live here rather than with any one of them.
"""

from __future__ import annotations

LABEL_KIND = "org.coldsnap.kind"
LABEL_FORMAT = "org.coldsnap.capsule.format"
LABEL_UNIT = "org.coldsnap.unit"
LABEL_CAPTURE = "org.coldsnap.capture-id"
LABEL_STATE_TARGET = "org.coldsnap.capsule.state-target"
LABEL_CACHE_PATHS = "org.coldsnap.capsule.cache-paths"
LABEL_BASE = "org.coldsnap.capsule.base"
RESERVED_LABELS = (LABEL_KIND, LABEL_FORMAT, LABEL_UNIT, LABEL_CAPTURE, LABEL_STATE_TARGET, LABEL_CACHE_PATHS,
                   LABEL_BASE)

#: How a capsule is stored: a local Docker image, or an OCI image layout directory.
CAPSULE_LAYOUTS = ("docker", "oci-layout")
