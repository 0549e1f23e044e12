"""Draw a receipt's timing envelope as a Gantt-style PNG.

One lane per clock and host: ``controller`` (the operation span), ``controller
-> <host>`` (the tasks the controller ran on that host, measured on the
controller's clock), and ``unit:<id> @ <host>`` (spans a unit recorded on its
own clock). Monotonic times of different clocks are never subtracted. Instead
every span also records the wall-clock time of its start (``wall_start_unix_ns``,
taken by :class:`SpanRecorder` next to the monotonic reading, on the host that
measured it; marks carry ``wall_unix_ns``), so each clock has an anchor: the
wall-clock time of its zero, ``wall - monotonic`` (the median over its events,
which a wall-clock step in mid-run cannot drag). Clocks with an anchor are drawn
on one axis, seconds since the operation started; a clock without one (an old
or foreign receipt) falls back to its own first event and its lane says so.
Units on the controller's host share its wall clock, so their spans land where
they happened; units elsewhere are off by the hosts' clock skew (NTP: ms).
Overlapping spans of one lane (nested spans, parallel tasks) stack in sub-rows.

Uses matplotlib's object API with the Agg canvas (no pyplot, no global backend
switch), so it works headless and inside other programs.
"""

from __future__ import annotations

import io
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import write_output

STATUS_COLORS = {
    "failed": "#d62728",
    "error": "#d62728",
    "unreachable": "#9467bd",
    "cancelled": "#4d4d4d",
    "incomplete": "#7f7f7f",
    "skipped": "#c7c7c7",
    "changed": "#ff9f1c",
    "ok": "#2ca02c",
}
PHASE_PALETTE = ("#1f77b4", "#17becf", "#8c564b", "#e377c2", "#bcbd22", "#aec7e8", "#98df8a", "#ffbb78",
                 "#c5b0d5", "#c49c94")
BAD_STATUSES = ("failed", "error", "unreachable", "cancelled", "incomplete", "skipped")
# A wall-clock reading before 2001-09-09 (1e18 ns) is no reading: tests and old tools write 0.
MIN_WALL_NS = 1_000_000_000_000_000_000
ALIGNED_LABEL = "seconds since the operation started (unit clocks placed by their recorded wall-clock anchor)"
UNALIGNED_NOTE = "lanes marked (own t=0) have no wall-clock anchor and start at their own first event"


@dataclass(frozen=True)
class Bar:
    """One span as drawn: seconds relative to its clock's first event."""

    lane: str
    row: int
    start_s: float
    end_s: float
    name: str
    color_key: str
    color: str


@dataclass(frozen=True)
class TimelineModel:
    """Everything the PNG shows, computed from a receipt (testable without drawing)."""

    title: str
    lanes: tuple[str, ...]
    rows: Mapping[str, int]
    bars: tuple[Bar, ...]
    legend: Mapping[str, str]
    marks: tuple[tuple[str, float, str], ...] = ()
    # Lanes whose clock had no wall-clock anchor: drawn relative to their own first event.
    unaligned_lanes: tuple[str, ...] = ()
    anchors: Mapping[str, int] | None = None


def _wall(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= MIN_WALL_NS:
        return value
    return None


def clock_anchors(spans: Iterable[Mapping[str, Any]], marks: Iterable[Mapping[str, Any]] = ()) -> dict[str, int]:
    """Per clock, the wall-clock time (Unix ns) of its zero: the median of ``wall - monotonic`` over its
    spans (``wall_start_unix_ns`` - ``start_ns``) and marks (``wall_unix_ns`` - ``t_ns``)."""
    samples: dict[str, list[int]] = {}
    for s in spans:
        wall = _wall(s.get("wall_start_unix_ns"))
        if wall is not None and isinstance(s.get("start_ns"), int):
            samples.setdefault(str(s.get("clock")), []).append(wall - s["start_ns"])
    for m in marks:
        wall = _wall(m.get("wall_unix_ns"))
        if wall is not None and isinstance(m.get("t_ns"), int):
            samples.setdefault(str(m.get("clock")), []).append(wall - m["t_ns"])
    return {clock: statistics.median_low(values) for clock, values in samples.items()}


def _lane(span: Mapping[str, Any]) -> str:
    clock = span.get("clock") or "?"
    attrs = span.get("attrs") or {}
    if clock == "controller":
        host = attrs.get("host")
        return f"controller -> {host}" if host else "controller"
    host = span.get("host")
    return f"{clock} @ {host}" if host else clock


def _phase(name: str) -> str:
    parts = name.split(".")
    # unit.criu.restore -> criu; coldsnap.capture -> capture; "Stage payload" -> Stage payload
    if len(parts) >= 3:
        return parts[1]
    return parts[-1] if len(parts) == 2 else name


def _color_key(span: Mapping[str, Any]) -> str:
    status = str(span.get("status") or "ok")
    attrs = span.get("attrs") or {}
    if status in BAD_STATUSES:
        return status
    if span.get("clock") == "controller":
        return "changed" if attrs.get("changed") else "ok"
    return "phase:" + _phase(str(span.get("name") or "?"))


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _drawable(event: Any, time_key: str) -> bool:
    """A span or mark the timeline can place: the types its lanes and bars read (a receipt is written by
    the controller, but one edited by hand or cut short must not stop the drawing)."""
    return (isinstance(event, Mapping) and isinstance(event.get(time_key), int)
            and isinstance(event.get("clock"), str | None) and isinstance(event.get("host"), str | None)
            and isinstance(event.get("attrs"), Mapping | None)
            and (time_key != "start_ns" or event.get("end_ns") is None or isinstance(event.get("end_ns"), int)))


def timeline_model(receipt: Mapping[str, Any]) -> TimelineModel:
    """Lanes, bars and legend of a receipt's timing envelope (events of other shapes are left out)."""
    timing = _mapping(receipt.get("timing"))
    spans = [s for s in (timing.get("spans") if isinstance(timing.get("spans"), list) else [])
             if _drawable(s, "start_ns")]
    marks_in = [m for m in (timing.get("marks") if isinstance(timing.get("marks"), list) else [])
                if _drawable(m, "t_ns")]
    # Every clock's own first event (the fallback origin of a clock without an anchor).
    firsts: dict[str, int] = {}
    for s in spans:
        clock = str(s.get("clock"))
        firsts[clock] = min(firsts.get(clock, s["start_ns"]), s["start_ns"])
    for m in marks_in:
        if m.get("clock") in firsts:
            firsts[m["clock"]] = min(firsts[m["clock"]], m["t_ns"])
    anchors = {c: a for c, a in clock_anchors(spans, marks_in).items() if c in firsts}
    # One axis for the anchored clocks: zero is the operation's start (the controller clock's first
    # event), else the earliest anchored event.
    if "controller" in anchors:
        zero_wall = firsts["controller"] + anchors["controller"]
    elif anchors:
        zero_wall = min(firsts[c] + a for c, a in anchors.items())
    else:
        zero_wall = 0
    # origins[clock]: the clock reading drawn at x = 0 on that clock's lanes.
    origins = {c: (zero_wall - anchors[c] if c in anchors else first) for c, first in firsts.items()}

    phase_colors: dict[str, str] = {}
    legend: dict[str, str] = {}
    lane_order: dict[str, None] = {}  # insertion-ordered set
    # Per lane, the end of each sub-row's last bar: spans come sorted by start within a lane, so a span
    # fits the first sub-row that ended by its start (linear in the sub-rows, not in the bars drawn).
    placed: dict[str, list[float]] = {}
    anchored_lanes: set[str] = set()
    bars: list[Bar] = []
    ordered = sorted(spans, key=lambda s: (s.get("clock") != "controller", str(s.get("clock")), _lane(s),
                                           s["start_ns"], -(s.get("end_ns") or s["start_ns"])))
    for s in ordered:
        lane = _lane(s)
        lane_order.setdefault(lane, None)
        if s.get("clock") in anchors:
            anchored_lanes.add(lane)
        origin = origins[str(s.get("clock"))]
        start = (s["start_ns"] - origin) / 1e9
        end = ((s.get("end_ns") if s.get("end_ns") is not None else s["start_ns"]) - origin) / 1e9
        key = _color_key(s)
        if key.startswith("phase:"):
            color = phase_colors.setdefault(key, PHASE_PALETTE[len(phase_colors) % len(PHASE_PALETTE)])
            legend.setdefault(f"unit phase {key[6:]}", color)
        else:
            color = STATUS_COLORS.get(key, STATUS_COLORS["ok"])
            legend.setdefault(key, color)
        rows = placed.setdefault(lane, [])
        row = next((i for i, row_end in enumerate(rows) if start >= row_end), len(rows))
        if row == len(rows):
            rows.append(0.0)
        rows[row] = max(end, start + 1e-9)
        bars.append(Bar(lane=lane, row=row, start_s=start, end_s=end, name=str(s.get("name")), color_key=key,
                        color=color))
    marks: list[tuple[str, float, str]] = []
    for m in marks_in:
        if m.get("clock") not in origins:
            continue
        lane = _lane({"clock": m["clock"], "host": m.get("host"), "attrs": m.get("attrs") or {}})
        if lane in lane_order:
            marks.append((lane, (m["t_ns"] - origins[m["clock"]]) / 1e9, str(m.get("name"))))
    state = receipt.get("state", "?")
    if _mapping(_mapping(receipt.get("result")).get("runner")).get("cancelled"):
        state = f"{state} (cancelled)"
    duration = receipt.get("duration_seconds")
    title = (f"coldsnap {receipt.get('operation', '?')}{' --prepare-only' if receipt.get('prepare_only') else ''}"
             f" {receipt.get('operation_id', '')}: {state}"
             + (f" in {duration:.2f} s" if isinstance(duration, int | float) else ""))
    unaligned = tuple(lane for lane in lane_order if anchors and lane not in anchored_lanes)
    return TimelineModel(title=title, lanes=tuple(lane_order), rows={k: len(v) for k, v in placed.items()},
                         bars=tuple(bars), legend=legend, marks=tuple(marks), unaligned_lanes=unaligned,
                         anchors=anchors)


def render_timeline(receipt: Mapping[str, Any], out: Path, *, dpi: int = 110) -> Path:
    """Write the timeline of ``receipt`` to ``out`` (PNG, or SVG/PDF by its suffix); returns ``out``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise ColdSnapError("coldsnap timeline needs matplotlib, which is not installed",
                            fix="pip install 'coldsnap[timeline]'") from None

    picture_format(out)  # before anything is drawn
    model = timeline_model(receipt)
    # Lane geometry: each lane is as tall as its number of sub-rows; lanes listed top to bottom.
    offsets: dict[str, float] = {}
    y = 0.0
    for lane in model.lanes:
        offsets[lane] = y
        y += model.rows.get(lane, 1) + 0.6
    total_rows = max(y, 1.0)
    x_max = max((b.end_s for b in model.bars), default=1.0) or 1.0
    x_min = min(0.0, min((b.start_s for b in model.bars), default=0.0))  # a span before the operation started

    fig = Figure(figsize=(13, min(2.2 + 0.42 * total_rows, 40)), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    by_color: dict[str, tuple[list[float], list[float], list[float]]] = {}
    for b in model.bars:
        row_y = offsets[b.lane] + b.row
        width = max(b.end_s - b.start_s, (x_max - x_min) * 0.002)  # instant spans stay visible
        ys, widths, lefts = by_color.setdefault(b.color, ([], [], []))
        ys.append(row_y)
        widths.append(width)
        lefts.append(b.start_s)
        if width >= (x_max - x_min) * 0.06:
            label = b.name if len(b.name) <= 48 else b.name[:45] + "..."
            ax.text(b.start_s + width / 2, row_y, _literal(label), ha="center", va="center", fontsize=7, clip_on=True,
                    color="white" if b.color_key in ("failed", "error", "unreachable", "cancelled") else "black")
    for color, (ys, widths, lefts) in by_color.items():  # one call per colour: thousands of spans draw in seconds
        ax.barh(ys, widths, left=lefts, height=0.8, color=color, edgecolor="#333333", linewidth=0.4)
    for lane, t, name in model.marks:
        ax.plot([t], [offsets[lane] - 0.5], marker="v", color="black", markersize=5)
        ax.text(t, offsets[lane] - 0.55, _literal(name), fontsize=6, ha="center", va="bottom")
    ticks = [offsets[lane] + (model.rows.get(lane, 1) - 1) / 2 for lane in model.lanes]
    ax.set_yticks(ticks)
    ax.set_yticklabels([_literal(f"{lane} (own t=0)" if lane in model.unaligned_lanes else lane)
                        for lane in model.lanes], fontsize=8)
    ax.set_ylim(total_rows, -0.8)
    ax.set_xlim(x_min - (x_max - x_min) * 0.01 if x_min < 0 else 0, x_max * 1.02)
    if not model.anchors:
        xlabel = "seconds since the first event on each lane's clock (no wall-clock anchors: clocks not aligned)"
    elif model.unaligned_lanes:
        xlabel = f"{ALIGNED_LABEL}; {UNALIGNED_NOTE}"
    else:
        xlabel = ALIGNED_LABEL
    ax.set_xlabel(xlabel, fontsize=9)
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    ax.set_title(_literal(model.title), fontsize=11)
    if model.legend:
        handles = [Patch(facecolor=c, edgecolor="#333333", label=k) for k, c in model.legend.items()]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False,
                  title="status / phase", title_fontsize=8)
    if not model.bars:
        ax.text(0.5, 0.5, "no timing spans in this receipt", transform=ax.transAxes, ha="center", va="center")
    fig.tight_layout()
    out = Path(out)
    if not out.parent.is_dir():
        raise ColdSnapError(f"cannot write the timeline to {out}: {out.parent} is not a directory",
                            fix="give -o a path in an existing directory")
    # Drawn whole, then written: an existing picture is replaced whole or not at all (temporary file and
    # rename), a link at ``out`` is replaced, never written through; a device or FIFO (/dev/stdout) is written to.
    picture = io.BytesIO()
    fig.savefig(picture, format=picture_format(out))
    write_output(out, picture.getvalue(), mode=0o644)
    return out


def _literal(text: str) -> str:
    """``text`` as matplotlib draws it literally: a task called ``Copy $SRC\\new`` is no maths markup."""
    return text.replace("$", r"\$")


PICTURE_FORMATS = ("png", "svg", "pdf")


def picture_format(out: Path) -> str:
    """The format ``out``'s suffix names (PNG without one); another suffix is refused, never written as PNG."""
    suffix = Path(out).suffix.lower().lstrip(".")
    if not suffix:
        return "png"
    if suffix not in PICTURE_FORMATS:
        raise ColdSnapError(f"cannot write the timeline as {Path(out).name}: .{suffix} is not a picture format "
                            "it draws", fix=f"give -o a name ending in {', '.join('.' + f for f in PICTURE_FORMATS)}")
    return suffix
