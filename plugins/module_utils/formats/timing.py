"""Timing events, format 1 (NDJSON), and the timing envelope a receipt embeds.

Spans are recorded on a named clock ("controller" or "unit:<id>"); monotonic
times of different clocks are never subtracted. The stream's last event is an
``envelope`` event carrying the digest of the complete envelope, which the
receipt embeds; a broken live stream never changes an operation's result.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.canonical import canonical_sha256
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.schema import (
    INT64_MAX,
    AnyJSON,
    Const,
    Field,
    Int,
    Nullable,
    Obj,
    Str,
    json_safe,
    validate_document,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.strictjson import strict_loads
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.versions import (
    TIMING_FORMAT,
    TIMING_KIND,
)

EVENTS = ("span-start", "span-end", "mark", "envelope")
ENVELOPE_KIND = "coldsnap-timing-envelope"

EVENT_SCHEMA = Obj({
    "format": Field(Const(TIMING_FORMAT)),
    "kind": Field(Const(TIMING_KIND)),
    "event": Field(Str(enum=EVENTS)),
    "span_id": Field(Nullable(Str())),
    "parent_id": Field(Nullable(Str())),
    "name": Field(Str(min_len=1)),
    "host": Field(Nullable(Str())),
    "unit": Field(Nullable(Str())),
    "clock": Field(Str(pattern=r"controller|unit:[A-Za-z0-9._-]+", pattern_fix="'controller' or 'unit:<id>'")),
    "t_ns": Field(Int(minimum=0, maximum=INT64_MAX)),
    "wall_unix_ns": Field(Int(minimum=0, maximum=INT64_MAX)),
    "attrs": Field(AnyJSON(object_only=True)),
})


def validate_event(value: Any) -> dict:
    """Validate one decoded timing event."""
    return validate_document(EVENT_SCHEMA, value, document="timing event")


def parse_ndjson(text: str) -> list[dict]:
    """Parse and validate a timing NDJSON stream."""
    # NDJSON lines end at "\n" only (U+2028 and friends may stand unescaped inside JSON strings).
    return [validate_event(strict_loads(line, document="timing event")) for line in text.split("\n") if line.strip()]


class SpanRecorder:
    """Records spans on one clock and streams them as timing events.

    ``sink`` receives each event dict as it happens (the live view); failures in
    the sink are swallowed after the first so they degrade live reporting only.
    """

    def __init__(self, clock: str, *, host: str | None = None, unit: str | None = None,
                 sink: Callable[[dict], None] | None = None, prefix: str = "") -> None:
        self.clock = clock
        self.host = host
        self.unit = unit
        self.sink = sink
        self.prefix = prefix
        self.spans: list[dict] = []
        self.marks: list[dict] = []
        self._ids = itertools.count(1)
        self._stack = threading.local()
        self._lock = threading.Lock()
        self.sink_broken = False

    def _emit(self, event: dict) -> None:
        if self.sink is None or self.sink_broken:
            return
        try:
            self.sink(json_safe(event))
        except Exception:  # a broken live stream must never change the operation's result
            self.sink_broken = True

    def _event(self, kind: str, name: str, t_ns: int, attrs: dict, *, span_id: str | None = None,
               parent: str | None = None) -> dict:
        return {
            "format": TIMING_FORMAT, "kind": TIMING_KIND, "event": kind, "span_id": span_id, "parent_id": parent,
            "name": name, "host": self.host, "unit": self.unit, "clock": self.clock, "t_ns": t_ns,
            "wall_unix_ns": time.time_ns(), "attrs": attrs,
        }

    @contextlib.contextmanager
    def span(self, name: str, **attrs: Any) -> Iterator[dict]:
        """Time a block; attributes added to the yielded dict's 'attrs' are kept."""
        with self._lock:
            span_id = f"{self.prefix}{self.clock}/{next(self._ids)}"
        stack = getattr(self._stack, "ids", None)
        if stack is None:
            stack = self._stack.ids = []
        parent = stack[-1] if stack else None
        start = time.monotonic_ns()
        record = {"span_id": span_id, "parent_id": parent, "name": name, "host": self.host, "unit": self.unit,
                  "clock": self.clock, "start_ns": start, "end_ns": None, "wall_start_unix_ns": time.time_ns(),
                  "status": "ok", "attrs": dict(attrs)}
        self._emit(self._event("span-start", name, start, dict(attrs), span_id=span_id, parent=parent))
        stack.append(span_id)
        try:
            yield record
        except BaseException as exc:
            record["status"] = "error"
            record["attrs"]["error"] = str(exc)[:500]
            raise
        finally:
            stack.pop()
            record["end_ns"] = time.monotonic_ns()
            with self._lock:
                self.spans.append(record)
            self._emit(self._event("span-end", name, record["end_ns"],
                                   {**record["attrs"], "status": record["status"],
                                    "duration_ns": record["end_ns"] - start},
                                   span_id=span_id, parent=parent))

    def start_span(self, name: str, *, parent_id: str | None = None, **attrs: Any) -> dict:
        """Open a span that :meth:`end_span` closes later (begin and end seen in different callbacks)."""
        with self._lock:
            span_id = f"{self.prefix}{self.clock}/{next(self._ids)}"
        start = time.monotonic_ns()
        record = {"span_id": span_id, "parent_id": parent_id, "name": name, "host": self.host, "unit": self.unit,
                  "clock": self.clock, "start_ns": start, "end_ns": None, "wall_start_unix_ns": time.time_ns(),
                  "status": "ok", "attrs": dict(attrs)}
        self._emit(self._event("span-start", name, start, dict(attrs), span_id=span_id, parent=parent_id))
        return record

    def end_span(self, record: dict, *, status: str = "ok", **attrs: Any) -> None:
        """Close a span opened by :meth:`start_span`; extra attributes are merged into its attrs."""
        record["end_ns"] = time.monotonic_ns()
        record["status"] = status
        record["attrs"].update(attrs)
        with self._lock:
            self.spans.append(record)
        self._emit(self._event("span-end", record["name"], record["end_ns"],
                               {**record["attrs"], "status": status,
                                "duration_ns": record["end_ns"] - record["start_ns"]},
                               span_id=record["span_id"], parent=record["parent_id"]))

    def add_span(self, name: str, start_ns: int, end_ns: int, **attrs: Any) -> None:
        """Record a span measured elsewhere on this same clock."""
        with self._lock:
            span_id = f"{self.prefix}{self.clock}/{next(self._ids)}"
            self.spans.append({"span_id": span_id, "parent_id": None, "name": name, "host": self.host,
                               "unit": self.unit, "clock": self.clock, "start_ns": start_ns, "end_ns": end_ns,
                               "wall_start_unix_ns": time.time_ns() - (time.monotonic_ns() - start_ns),
                               "status": "ok", "attrs": attrs})

    def mark(self, name: str, **attrs: Any) -> None:
        """A point in time on this clock."""
        t = time.monotonic_ns()
        with self._lock:
            self.marks.append({"name": name, "clock": self.clock, "host": self.host, "unit": self.unit,
                               "t_ns": t, "wall_unix_ns": time.time_ns(), "attrs": attrs})
        self._emit(self._event("mark", name, t, attrs))

    def import_spans(self, spans: list[dict], marks: list[dict] | None = None) -> None:
        """Adopt spans recorded on another clock (a unit's), keeping their clock."""
        with self._lock:
            self.spans.extend(spans)
            self.marks.extend(marks or [])
        for s in spans:
            self._emit({**self._event("span-end", s["name"], s["end_ns"] or 0,
                                      {**s.get("attrs", {}), "imported": True,
                                       "duration_ns": (s["end_ns"] or 0) - s["start_ns"]},
                                      span_id=s["span_id"], parent=s.get("parent_id")),
                        "host": s.get("host"), "unit": s.get("unit"), "clock": s["clock"]})

    def envelope(self, operation_id: str) -> dict:
        """The complete timing record for the receipt: JSON its loader takes back (attributes are whatever the
        code recorded: an error's text may hold a file name that is not UTF-8, a rate may be NaN)."""
        with self._lock:
            spans = sorted(self.spans, key=lambda s: (s["clock"], s["start_ns"]))
            marks = list(self.marks)
        return json_safe({"format": TIMING_FORMAT, "kind": ENVELOPE_KIND, "operation_id": operation_id,
                          "spans": spans, "marks": marks})

    def finish(self, operation_id: str) -> dict:
        """Emit the closing envelope event and return the envelope."""
        env = self.envelope(operation_id)
        self._emit(self._event("envelope", "envelope", time.monotonic_ns(),
                               {"sha256": canonical_sha256(env), "spans": len(env["spans"])}))
        return env


def ndjson_line(event: dict) -> str:
    """One event as a compact JSON line that :func:`parse_ndjson` takes back (:func:`.schema.json_safe`: a
    non-finite number in attrs is written as null, a lone surrogate as U+FFFD)."""
    return json.dumps(json_safe(event), separators=(",", ":"), sort_keys=True, allow_nan=False) + "\n"


def span_seconds(envelope: dict, name: str) -> float | None:
    """Duration of the first span called ``name`` in an envelope, in seconds."""
    for s in envelope.get("spans", []):
        if s["name"] == name and s.get("end_ns") is not None:
            return (s["end_ns"] - s["start_ns"]) / 1e9
    return None
