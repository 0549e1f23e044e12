# Copyright: ColdSnap maintainers
# Apache License 2.0 (see LICENSE)
"""Shared option documentation for coldsnap.fleet modules."""

from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  state_root:
    description:
      - ColdSnap's state directory on the host. It holds C(model-payloads/sha256/),
        C(activation-runtime/sha256/), C(captures/), C(capsules/), C(workloads/) and C(runs/).
      - Use the same path on every host of a workload (restored processes keep their paths).
    type: path
    default: /var/lib/coldsnap
"""

    REQUEST = r"""
options:
  request:
    description:
      - The normalized operation request (format 4), as the C(coldsnap) controller passes it in
        the extra variable C(coldsnap_request). It is validated again strictly on the host.
    type: dict
    required: true
"""
