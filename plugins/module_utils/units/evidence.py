"""What the per-host modules return of the units' evidence."""

from __future__ import annotations


def timing_of(evidence: list[dict]) -> dict:
    """The units' spans and marks, merged (returned as ``coldsnap_timing``)."""
    spans, marks = [], []
    for ev in evidence:
        t = ev.get("timing") or {}
        spans.extend(t.get("spans", []))
        marks.extend(t.get("marks", []))
    return {"spans": spans, "marks": marks}


def public(ev: dict) -> dict:
    """Evidence without bulky timing (returned separately as coldsnap_timing)."""
    return {k: v for k, v in ev.items() if k != "timing"}
