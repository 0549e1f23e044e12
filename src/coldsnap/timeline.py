"""Draw a receipt's timing envelope as a Gantt-style PNG.

One lane per clock and host: ``controller`` (the operation span), ``controller
-> <host>`` (the tasks the controller ran on that host, measured on the
controller's clock), and ``unit:<id> @ <host>`` (spans a unit recorded on its
own clock). Monotonic clocks of different hosts cannot be compared, so every
clock is drawn relative to its own first event; the axis label says so.
Overlapping spans of one lane (nested spans, parallel tasks) stack in sub-rows.

Uses matplotlib's object API with the Agg canvas (no pyplot, no global backend
switch), so it works headless and inside other programs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError

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


def timeline_model(receipt: Mapping[str, Any]) -> TimelineModel:
    """Lanes, bars and legend of a receipt's timing envelope."""
    spans = [s for s in (receipt.get("timing") or {}).get("spans", [])
             if isinstance(s, Mapping) and isinstance(s.get("start_ns"), int)
             and (s.get("end_ns") is None or isinstance(s.get("end_ns"), int))]
    origins: dict[str, int] = {}
    for s in spans:
        clock = str(s.get("clock"))
        origins[clock] = min(origins.get(clock, s["start_ns"]), s["start_ns"])
    for m in (receipt.get("timing") or {}).get("marks", []):
        if isinstance(m, Mapping) and m.get("clock") in origins and isinstance(m.get("t_ns"), int):
            origins[m["clock"]] = min(origins[m["clock"]], m["t_ns"])

    phase_colors: dict[str, str] = {}
    legend: dict[str, str] = {}
    lane_order: list[str] = []
    placed: dict[str, list[list[tuple[float, float]]]] = {}
    bars: list[Bar] = []
    ordered = sorted(spans, key=lambda s: (s.get("clock") != "controller", str(s.get("clock")), _lane(s),
                                           s["start_ns"], -(s.get("end_ns") or s["start_ns"])))
    for s in ordered:
        lane = _lane(s)
        if lane not in lane_order:
            lane_order.append(lane)
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
        row = next((i for i, used in enumerate(rows) if all(end <= a or start >= b for a, b in used)), len(rows))
        if row == len(rows):
            rows.append([])
        rows[row].append((start, max(end, start + 1e-9)))
        bars.append(Bar(lane=lane, row=row, start_s=start, end_s=end, name=str(s.get("name")), color_key=key,
                        color=color))
    marks: list[tuple[str, float, str]] = []
    for m in (receipt.get("timing") or {}).get("marks", []):
        if not (isinstance(m, Mapping) and m.get("clock") in origins and isinstance(m.get("t_ns"), int)):
            continue
        lane = _lane({"clock": m["clock"], "host": m.get("host"), "attrs": m.get("attrs") or {}})
        if lane in lane_order:
            marks.append((lane, (m["t_ns"] - origins[m["clock"]]) / 1e9, str(m.get("name"))))
    state = receipt.get("state", "?")
    if ((receipt.get("result") or {}).get("runner") or {}).get("cancelled"):
        state = f"{state} (cancelled)"
    duration = receipt.get("duration_seconds")
    title = (f"coldsnap {receipt.get('operation', '?')}{' --prepare-only' if receipt.get('prepare_only') else ''}"
             f" {receipt.get('operation_id', '')}: {state}"
             + (f" in {duration:.2f} s" if isinstance(duration, int | float) else ""))
    return TimelineModel(title=title, lanes=tuple(lane_order), rows={k: len(v) for k, v in placed.items()},
                         bars=tuple(bars), legend=legend, marks=tuple(marks))


def render_timeline(receipt: Mapping[str, Any], out: Path, *, dpi: int = 110) -> Path:
    """Write the timeline PNG of ``receipt`` to ``out``; returns ``out``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise ColdSnapError("coldsnap timeline needs matplotlib, which is not installed",
                            fix="pip install 'coldsnap[timeline]'") from None

    model = timeline_model(receipt)
    # Lane geometry: each lane is as tall as its number of sub-rows; lanes listed top to bottom.
    offsets: dict[str, float] = {}
    y = 0.0
    for lane in model.lanes:
        offsets[lane] = y
        y += model.rows.get(lane, 1) + 0.6
    total_rows = max(y, 1.0)
    x_max = max((b.end_s for b in model.bars), default=1.0) or 1.0

    fig = Figure(figsize=(13, min(2.2 + 0.42 * total_rows, 40)), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for b in model.bars:
        row_y = offsets[b.lane] + b.row
        width = max(b.end_s - b.start_s, x_max * 0.002)  # instant spans stay visible
        ax.barh(row_y, width, left=b.start_s, height=0.8, color=b.color, edgecolor="#333333", linewidth=0.4)
        if width >= x_max * 0.06:
            label = b.name if len(b.name) <= 48 else b.name[:45] + "..."
            ax.text(b.start_s + width / 2, row_y, label, ha="center", va="center", fontsize=7, clip_on=True,
                    color="white" if b.color_key in ("failed", "error", "unreachable", "cancelled") else "black")
    for lane, t, name in model.marks:
        ax.plot([t], [offsets[lane] - 0.5], marker="v", color="black", markersize=5)
        ax.text(t, offsets[lane] - 0.55, name, fontsize=6, ha="center", va="bottom")
    ticks = [offsets[lane] + (model.rows.get(lane, 1) - 1) / 2 for lane in model.lanes]
    ax.set_yticks(ticks)
    ax.set_yticklabels(list(model.lanes), fontsize=8)
    ax.set_ylim(total_rows, -0.8)
    ax.set_xlim(0, x_max * 1.02)
    ax.set_xlabel("seconds since the first event on each lane's clock "
                  "(clocks of different hosts/units are not aligned)", fontsize=9)
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    ax.set_title(model.title, fontsize=11)
    if model.legend:
        handles = [Patch(facecolor=c, edgecolor="#333333", label=k) for k, c in model.legend.items()]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False,
                  title="status / phase", title_fontsize=8)
    if not model.bars:
        ax.text(0.5, 0.5, "no timing spans in this receipt", transform=ax.transAxes, ha="center", va="center")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
