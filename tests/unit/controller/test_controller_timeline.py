"""The timeline PNG: lanes per clock/host, each clock relative to its own first event."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

from coldsnap.timeline import render_timeline, timeline_model


def _span(name: str, clock: str, start: int, end: int, *, unit_host: str | None = None, status: str = "ok",
          **attrs) -> dict:
    """A controller task span carries its target host in attrs; a unit span in its host field."""
    return {"span_id": f"{clock}/{name}", "parent_id": None, "name": name, "host": unit_host, "unit": None,
            "clock": clock, "start_ns": start, "end_ns": end, "wall_start_unix_ns": 0, "status": status,
            "attrs": attrs}


def _receipt() -> dict:
    # Controller clock around 5e12 ns, unit clocks with unrelated origins: they must not be subtracted.
    spans = [
        _span("coldsnap.restore", "controller", 5_000_000_000_000, 5_004_000_000_000),
        _span("Admission", "controller", 5_000_500_000_000, 5_001_000_000_000, host="gpu-a"),
        _span("Stage payload", "controller", 5_001_000_000_000, 5_003_000_000_000, changed=True, host="gpu-b"),
        _span("Evict", "controller", 5_003_000_000_000, 5_003_500_000_000, status="failed", host="gpu-b"),
        _span("unit.restore", "unit:unit-0", 10, 2_000_000_010, unit_host="gpu-a"),
        _span("unit.criu.restore", "unit:unit-0", 10, 1_000_000_010, unit_host="gpu-a"),
        _span("unit.hydrate", "unit:unit-1", 777_000_000_000, 777_500_000_000, unit_host="gpu-b"),
    ]
    marks = [{"name": "unit.ready", "clock": "unit:unit-0", "host": "gpu-a", "unit": "unit-0",
              "t_ns": 2_000_000_010, "wall_unix_ns": 0, "attrs": {}}]
    return {"operation": "restore", "operation_id": "op-7", "state": "failed", "duration_seconds": 4.0,
            "prepare_only": False, "timing": {"spans": spans, "marks": marks}}


def test_model_lanes_and_relative_clocks() -> None:
    model = timeline_model(_receipt())
    assert model.lanes == ("controller", "controller -> gpu-a", "controller -> gpu-b",
                           "unit:unit-0 @ gpu-a", "unit:unit-1 @ gpu-b")
    bars = {b.name: b for b in model.bars}
    assert bars["coldsnap.restore"].start_s == 0.0 and bars["coldsnap.restore"].end_s == 4000.0 / 1000
    # Each unit clock starts at 0 on its own lane, whatever its raw origin.
    assert bars["unit.restore"].start_s == 0.0 and bars["unit.hydrate"].start_s == 0.0
    assert bars["unit.hydrate"].end_s == 0.5
    # Nested spans of one lane stack in two rows.
    assert {bars["unit.restore"].row, bars["unit.criu.restore"].row} == {0, 1}
    assert model.rows["unit:unit-0 @ gpu-a"] == 2
    assert bars["Evict"].color_key == "failed" and bars["Stage payload"].color_key == "changed"
    assert bars["unit.criu.restore"].color_key == "phase:criu"
    assert "restore op-7: failed in 4.00 s" in model.title
    assert model.marks == (("unit:unit-0 @ gpu-a", 2.0, "unit.ready"),)


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    (crc,) = struct.unpack(">I", data[29:33])
    assert crc == zlib.crc32(data[12:29])
    return width, height


def test_render_png(tmp_path: Path) -> None:
    out = render_timeline(_receipt(), tmp_path / "sub" / "timeline.png")
    data = out.read_bytes()
    width, height = _png_size(data)
    assert width >= 1000 and height >= 250
    assert len(data) > 20_000  # bars, labels and a legend, not an empty canvas


def test_render_png_without_spans(tmp_path: Path) -> None:
    empty = {"operation": "status", "operation_id": "x", "state": "succeeded", "timing": {"spans": [], "marks": []}}
    width, height = _png_size(render_timeline(empty, tmp_path / "t.png").read_bytes())
    assert width > 0 and height > 0


def test_without_matplotlib_the_cli_names_the_extra(tmp_path: Path, monkeypatch, capsys) -> None:
    """matplotlib is the optional extra ``timeline``: without it, one line says what to install."""
    import sys

    from coldsnap.cli import main

    for name in ("matplotlib", "matplotlib.backends.backend_agg", "matplotlib.figure", "matplotlib.patches"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    receipt = Path(__file__).resolve().parents[2] / "fixtures" / "receipts" / "restore-reference-tiny.json"
    assert main(["timeline", str(receipt), "-o", str(tmp_path / "t.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'coldsnap[timeline]'" in err, err
    assert not (tmp_path / "t.png").exists()
