"""Every wire and file format number ColdSnap speaks, in one place."""

from __future__ import annotations

REQUEST_FORMAT = 4
ARTIFACT_FORMAT = 9
RECEIPT_FORMAT = 2
TIMING_FORMAT = 1
CSKV_VERSION = 1
ACTIVATION_RUNTIME_ABI = 1
CAPABILITIES_FORMAT = 1
VALIDATION_RECORD_FORMAT = 1
NATIVE_MANIFEST_FORMAT = 1
REPLAY_PLAN_FORMAT = 1
ENDPOINT_FORMAT = 1
EVIDENCE_FORMAT = 1
UNIT_SPEC_FORMAT = 1
ARTIFACT_STORE_FORMAT = 1
OVERLAY_FORMAT = 1

REQUEST_KIND = "coldsnap-operation-request"
ARTIFACT_KIND = "coldsnap-snapshot-artifact"
RECEIPT_KIND = "coldsnap-operation-receipt"
TIMING_KIND = "coldsnap-timing-event"
CAPABILITIES_KIND = "coldsnap-capabilities"
VALIDATION_RECORD_KIND = "coldsnap-payload-validation"
NATIVE_MANIFEST_KIND = "coldsnap-native-manifest"
REPLAY_PLAN_KIND = "coldsnap-replay-plan"
ENDPOINT_KIND = "coldsnap-coordinator-endpoint"
EVIDENCE_KIND = "coldsnap-unit-evidence"
UNIT_SPEC_KIND = "coldsnap-unit-spec"
STORE_IDENTITY_KIND = "coldsnap-artifact-identity"
STORE_GENERATION_KIND = "coldsnap-artifact-generation"
OVERLAY_KIND = "coldsnap-target-overlay"

COLDSNAP_VERSION = "0.1.0"
