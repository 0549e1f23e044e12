"""The timeline PNG: lanes per clock/host on one axis (wall-clock anchors), or per clock without anchors."""

from __future__ import annotations

import os
import stat
import struct
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import pytest

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
    out = render_timeline(_receipt(), tmp_path / "timeline.png")
    data = out.read_bytes()
    width, height = _png_size(data)
    assert width >= 1000 and height >= 250
    assert len(data) > 20_000  # bars, labels and a legend, not an empty canvas


def test_the_png_replaces_a_link_never_writes_through_it_and_needs_its_directory(tmp_path: Path) -> None:
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    link = tmp_path / "link.png"
    link.symlink_to(victim)
    render_timeline(_receipt(), link)
    assert victim.read_text() == "keep me" and not link.is_symlink() and _png_size(link.read_bytes())[0] >= 1000
    with pytest.raises(ColdSnapError, match="is not a directory"):
        render_timeline(_receipt(), tmp_path / "missing" / "t.png")
    assert not (tmp_path / "missing").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.png", "victim.txt"]  # no temporary file left


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


# ----------------------------------------------------------------------------- one axis for all clocks

WALL0 = 1_795_951_617_872_942_871  # the wall clock when the operation started (Unix ns)


def _anchored(name: str, clock: str, start: int, end: int, *, anchor: int, unit_host: str | None = None,
              **attrs) -> dict:
    """A span as SpanRecorder writes it: wall_start_unix_ns = the clock's anchor + start_ns."""
    return {**_span(name, clock, start, end, unit_host=unit_host, **attrs), "wall_start_unix_ns": anchor + start}


def test_unit_spans_land_at_their_true_offset() -> None:
    # The controller's monotonic clock reads 5e12 at the start; unit-0's (another host, or a restored process
    # in a time namespace) reads 777e9 when the operation is 10.5 s old; unit-1 has no anchor (an old receipt).
    c0, u0 = 5_000_000_000_000, 777_000_000_000
    a_ctl = WALL0 - c0
    a_unit = WALL0 + 10_500_000_000 - u0
    spans = [
        _anchored("coldsnap.restore", "controller", c0, c0 + 12_000_000_000, anchor=a_ctl),
        _anchored("Restore the units on this host", "controller", c0 + 10_200_000_000, c0 + 10_900_000_000,
                  anchor=a_ctl, host="gpu-a"),
        _anchored("unit.admission", "unit:unit-0", u0, u0 + 1_000_000, anchor=a_unit, unit_host="gpu-a"),
        _anchored("unit.criu.restore", "unit:unit-0", u0, u0 + 141_000_000, anchor=a_unit, unit_host="gpu-a"),
        # one wall reading stepped by NTP in mid-run: the median keeps the anchor
        _anchored("unit.resume", "unit:unit-0", u0 + 142_000_000, u0 + 154_000_000, anchor=a_unit + 2_000_000_000,
                  unit_host="gpu-a"),
        _anchored("unit.http.ready", "unit:unit-0", u0 + 154_000_000, u0 + 200_000_000, anchor=a_unit,
                  unit_host="gpu-a"),
        _span("unit.hydrate", "unit:unit-1", 42_000_000_000, 42_500_000_000, unit_host="gpu-b"),
    ]
    marks = [{"name": "first_token", "clock": "unit:unit-0", "host": "gpu-a", "unit": "unit-0",
              "t_ns": u0 + 261_000_000, "wall_unix_ns": a_unit + u0 + 261_000_000, "attrs": {}}]
    receipt = {"operation": "restore", "operation_id": "op-8", "state": "succeeded", "duration_seconds": 12.0,
               "timing": {"spans": spans, "marks": marks}}
    model = timeline_model(receipt)
    bars = {b.name: b for b in model.bars}
    assert bars["coldsnap.restore"].start_s == 0.0 and bars["coldsnap.restore"].end_s == 12.0
    assert bars["unit.admission"].start_s == pytest.approx(10.5, abs=1e-9)
    assert bars["unit.criu.restore"].end_s == pytest.approx(10.641, abs=1e-9)
    assert bars["unit.resume"].start_s == pytest.approx(10.642, abs=1e-9)
    task = bars["Restore the units on this host"]
    assert task.start_s <= bars["unit.admission"].start_s and bars["unit.http.ready"].end_s <= task.end_s
    assert model.marks[0] == ("unit:unit-0 @ gpu-a", pytest.approx(10.761, abs=1e-9), "first_token")
    # Without an anchor a clock still starts at its own first event, and its lane says so.
    assert bars["unit.hydrate"].start_s == 0.0
    assert model.unaligned_lanes == ("unit:unit-1 @ gpu-b",)
    assert set(model.anchors) == {"controller", "unit:unit-0"}


def test_alignment_through_the_controller_import(tmp_path: Path, monkeypatch) -> None:
    """Real recorders: a unit clock 1 h ahead of the controller's (another host's monotonic clock), its spans
    going through the module result and the controller's import, land inside the task that ran them."""
    import time

    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.timing import SpanRecorder
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units.evidence import timing_of

    from coldsnap.runner.events import normalize_unit_timing

    ctl = SpanRecorder("controller")
    op = ctl.start_span("coldsnap.restore")
    time.sleep(0.05)
    task = ctl.start_span("Restore the units on this host", host="gpu-a")
    real = time.monotonic_ns
    monkeypatch.setattr(time, "monotonic_ns", lambda: real() + 3_600_000_000_000)
    unit = SpanRecorder("unit:unit-0", host="gpu-a", unit="unit-0")
    time.sleep(0.02)
    with unit.span("unit.criu.restore"):
        time.sleep(0.03)
    unit.mark("first_token")
    monkeypatch.setattr(time, "monotonic_ns", real)
    time.sleep(0.02)
    ctl.end_span(task)
    ctl.end_span(op)
    evidence = [{"unit": "unit-0", "timing": {"spans": unit.spans, "marks": unit.marks, "t0_ns": 0}}]
    spans, marks, problems = normalize_unit_timing(timing_of(evidence), host="gpu-a", tag="gpu-a#1.1")
    assert not problems
    ctl.import_spans(spans, marks)
    model = timeline_model({"operation": "restore", "operation_id": "op-9", "state": "succeeded",
                            "timing": ctl.finish("op-9")})
    bars = {b.name: b for b in model.bars}
    criu, ran = bars["unit.criu.restore"], bars["Restore the units on this host"]
    assert ran.start_s >= 0.05
    assert ran.start_s + 0.02 <= criu.start_s + 0.005 and criu.end_s <= ran.end_s
    assert criu.end_s - criu.start_s == pytest.approx(0.03, abs=0.02)
    assert not model.unaligned_lanes


def test_a_picture_cut_short_leaves_the_old_one_whole(tmp_path: Path, monkeypatch) -> None:
    """A write that fails half-way (a file-size limit, a full disk) never leaves a truncated PNG in place."""
    from matplotlib.figure import Figure

    out = render_timeline(_receipt(), tmp_path / "t.png")
    before = out.read_bytes()

    def half_then_full(self, fh, **_kw) -> None:
        fh.write(before[:100])
        raise OSError(27, "File too large")

    monkeypatch.setattr(Figure, "savefig", half_then_full)
    with pytest.raises(OSError, match="File too large"):
        render_timeline(_receipt(), out)
    assert out.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["t.png"]


def test_the_picture_format_follows_the_suffix_and_another_suffix_is_refused(tmp_path: Path) -> None:
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError

    assert render_timeline(_receipt(), tmp_path / "t.pdf").read_bytes()[:5] == b"%PDF-"
    assert b"<svg" in render_timeline(_receipt(), tmp_path / "t.svg").read_bytes()[:400]
    with pytest.raises(ColdSnapError, match=r"\.txt is not a picture format"):
        render_timeline(_receipt(), tmp_path / "t.txt")
    assert not (tmp_path / "t.txt").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="making a character device needs root")
def test_a_device_or_fifo_is_written_to_never_replaced(tmp_path: Path) -> None:
    """-o /dev/null as root used to rename a regular file over the device; -o /dev/stdout over the link."""
    null = tmp_path / "null"
    os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # the kernel's /dev/null, in a scratch directory
    render_timeline(_receipt(), null)
    assert stat.S_ISCHR(os.lstat(null).st_mode) and os.lstat(null).st_rdev == os.makedev(1, 3)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    render_timeline(_receipt(), fifo)
    reader.join(30)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and _png_size(got[0])[0] >= 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["null", "pipe"]  # no temporary file left


def test_the_cli_writes_a_png_to_stdout_for_dash_and_refuses_an_empty_name(tmp_path: Path) -> None:
    receipt = Path(__file__).resolve().parents[2] / "fixtures" / "receipts" / "restore-reference-tiny.json"
    cli = [str(Path(sys.executable).parent / "coldsnap"), "timeline", str(receipt)]
    out = subprocess.run([*cli, "-o", "-"], capture_output=True, timeout=120, check=False, cwd=tmp_path)
    assert out.returncode == 0 and _png_size(out.stdout)[0] >= 1000 and not (tmp_path / "-").exists()
    empty = subprocess.run([*cli, "-o", ""], capture_output=True, text=True, timeout=120, check=False)
    assert empty.returncode == 2 and "names no file" in empty.stderr and "Traceback" not in empty.stderr


def test_dollar_signs_in_names_are_drawn_as_text_not_maths(tmp_path: Path) -> None:
    receipt = _receipt()
    receipt["timing"]["spans"][2]["name"] = "Copy $SRC\\new to $DEST"  # half-open maths: a parse error once
    receipt["timing"]["spans"][4]["host"] = "$\\bad{$"
    receipt["timing"]["marks"][0]["name"] = "$x^2$ ready"
    out = render_timeline(receipt, tmp_path / "dollars.png")
    assert _png_size(out.read_bytes())[0] >= 1000


def test_thousands_of_spans_share_rows_where_they_do_not_overlap(tmp_path: Path) -> None:
    """One lane of 5000 back-to-back spans is one row; spans nested three deep take three; the picture is
    drawn (the layout used to compare each span with every one before it in its row)."""
    wall = 1_700_000_000_000_000_000
    spans = [{"name": f"unit.step.s{i}", "clock": "unit:u0", "host": "h", "start_ns": i * 1000,
              "end_ns": i * 1000 + 1000, "wall_start_unix_ns": wall + i * 1000} for i in range(5000)]
    spans += [{"name": f"unit.nest.n{d}", "clock": "unit:u1", "host": "h", "start_ns": d, "end_ns": 100 - d,
               "wall_start_unix_ns": wall + d} for d in range(3)]
    receipt = {"operation": "restore", "state": "succeeded", "timing": {"spans": spans, "marks": []}}
    model = timeline_model(receipt)
    assert model.rows == {"unit:u0 @ h": 1, "unit:u1 @ h": 3}
    assert [b.row for b in model.bars if b.lane == "unit:u1 @ h"] == [0, 1, 2]
    assert render_timeline(receipt, tmp_path / "t.png").stat().st_size > 0
