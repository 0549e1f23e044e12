"""Edges of the controller CLI: a closed stdout, relative and empty state roots, receipts that are no
regular file, `runs list -n N` on many runs, and an interpreter that answers no environment digest.
Each fails with one message naming the object and the fix (exit 2), never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import environment

import coldsnap.runs
from coldsnap import api
from coldsnap.cli import main
from coldsnap.commands._io import MAX_INPUT_BYTES
from coldsnap.receipts import receipt_bytes

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
RECEIPT = FIXTURES / "receipts" / "restore-reference-tiny.json"
EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "reference"
CLI = "import sys; from coldsnap.cli import main; sys.exit(main(sys.argv[1:]))"


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _invalid_receipt(tmp_path: Path) -> Path:
    """A receipt with many problems: its --json-errors report is larger than a pipe's buffer."""
    doc = json.loads(RECEIPT.read_text())
    doc.update({f"unexpected_{i}": i for i in range(1500)})  # some 200 KB of errors
    path = tmp_path / "bad-receipt.json"
    path.write_text(json.dumps(doc))
    return path


# ----------------------------------------------------------------------------- 1. stdout closed


def test_an_invalid_document_exits_2_when_stdout_is_a_closed_pipe(tmp_path, monkeypatch) -> None:
    """`coldsnap validate --json-errors BAD | true`: the reader is gone, the verdict stays 2."""
    bad = _invalid_receipt(tmp_path)
    read_end, write_end = os.pipe()
    os.close(read_end)
    broken = open(write_end, "w", encoding="utf-8")
    monkeypatch.setattr(sys, "stdout", broken)
    try:
        rc = main(["validate", "--receipt-json", str(bad), "--json-errors"])
    finally:
        monkeypatch.undo()
        broken.close()  # what was left goes to /dev/null now: no second BrokenPipeError
    assert rc == 2


@pytest.mark.parametrize("redirect", ["| true", ">&-"])
def test_an_invalid_document_exits_2_in_a_shell_that_closed_stdout(tmp_path, redirect) -> None:
    bad = _invalid_receipt(tmp_path)
    script = (f'"$0" -c "$1" validate --receipt-json "$2" --json-errors {redirect}; '
              'echo "rc=${PIPESTATUS[0]}" >&2')
    r = subprocess.run(["bash", "-c", script, sys.executable, CLI, str(bad)], capture_output=True, text=True,
                       timeout=120, check=False)
    assert "rc=2" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_valid_document_with_stdout_closed_is_no_traceback(tmp_path) -> None:
    r = subprocess.run(["bash", "-c", '"$0" -c "$1" validate --receipt-json "$2" >&-; echo "rc=$?" >&2',
                        sys.executable, CLI, str(RECEIPT)], capture_output=True, text=True, timeout=120, check=False)
    assert "rc=0" in r.stderr and "Traceback" not in r.stderr, r.stderr


# ----------------------------------------------------------------------------- 2. state roots


def test_a_relative_state_root_is_taken_from_the_current_directory(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("COLDSNAP_STATE_ROOT", raising=False)
    assert api.resolve_state_root("relsr") == tmp_path / "relsr"
    assert api.resolve_state_root(Path("relsr")).is_absolute()
    monkeypatch.setenv("COLDSNAP_STATE_ROOT", "from-env")
    assert api.resolve_state_root(None) == tmp_path / "from-env"
    run_dir = tmp_path / "relsr" / "runs" / "op-1"
    run_dir.mkdir(parents=True)
    (run_dir / "receipt.json").write_bytes(RECEIPT.read_bytes())
    rc, out, _err = _run(capsys, "runs", "list", "--state-root", "relsr", "--json")
    assert rc == 0
    (row,) = json.loads(out)
    assert row["run_dir"] == str(run_dir) and row["receipt"] == str(run_dir / "receipt.json")


def test_an_operation_gets_an_absolute_state_root(tmp_path, monkeypatch, capsys) -> None:
    """The playbook runs from its own directory: a relative state root would point somewhere else there."""
    seen: dict = {}

    class Stop(Exception):
        pass

    def fake_run_playbook(*_a, **kwargs):
        seen["state_root"] = kwargs["state_root"]
        raise Stop

    monkeypatch.setattr(api, "run_playbook", fake_run_playbook)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Stop):
        main(["status", "--request-json", str(EXAMPLES / "status.json"),
              "--state-root", "relsr", "--json"])
    assert seen["state_root"] == tmp_path / "relsr"


def test_an_empty_state_root_variable_is_refused_and_named(monkeypatch, capsys) -> None:
    """COLDSNAP_STATE_ROOT= (an unset shell variable exported) must not mean the default state root."""
    monkeypatch.setenv("COLDSNAP_STATE_ROOT", "")
    rc, _out, err = _run(capsys, "runs", "list")
    assert rc == 2 and "COLDSNAP_STATE_ROOT is set but empty" in err and "Traceback" not in err
    monkeypatch.setenv("COLDSNAP_STATE_ROOT", "  ")
    rc, _out, err = _run(capsys, "runs", "show", "op-1")
    assert rc == 2 and "COLDSNAP_STATE_ROOT is set but empty" in err
    rc, _out, err = _run(capsys, "runs", "list", "--state-root", "")
    assert rc == 2 and "--state-root is empty" in err and "Traceback" not in err


def test_a_bad_state_root_from_the_variable_names_the_variable(tmp_path, monkeypatch, capsys) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setenv("COLDSNAP_STATE_ROOT", str(afile))
    rc, _out, err = _run(capsys, "runs", "list")
    assert rc == 2 and f"state root {afile} (from COLDSNAP_STATE_ROOT) is not a directory" in err
    assert "set COLDSNAP_STATE_ROOT" in err and "--state-root" not in err
    rc, _out, err = _run(capsys, "runs", "list", "--state-root", str(afile))  # the option: named as before
    assert rc == 2 and f"state root {afile} is not a directory" in err and "pass --state-root" in err


# ----------------------------------------------------------------------------- 3. receipts that are no file


@pytest.fixture
def odd_receipts(tmp_path) -> Path:
    runs = tmp_path / "state" / "runs"
    for name in ("fifo", "zero", "sparse", "good"):
        (runs / name).mkdir(parents=True)
    os.mkfifo(runs / "fifo" / "receipt.json")
    (runs / "zero" / "receipt.json").symlink_to("/dev/zero")
    with open(runs / "sparse" / "receipt.json", "wb") as fh:
        fh.truncate(MAX_INPUT_BYTES + 1)  # sparse: no disk, but a read would take it all
    (runs / "good" / "receipt.json").write_bytes(RECEIPT.read_bytes())
    return tmp_path / "state"


def test_runs_list_reports_receipts_that_are_no_regular_file(odd_receipts, capsys) -> None:
    for limit in ("0", "20"):
        rc, out, err = _run(capsys, "runs", "list", "--state-root", str(odd_receipts), "--json", "-n", limit)
        assert rc == 0, err
        by_id = {r["operation_id"]: r for r in json.loads(out)}
        assert by_id["good"]["state"] == "succeeded"
        for name, why in (("fifo", "not a regular file (a FIFO)"), ("zero", "symbolic link"),
                          ("sparse", "larger than any receipt")):
            assert by_id[name]["state"] == "unreadable receipt", by_id[name]
            assert why in by_id[name]["problem"] and by_id[name]["receipt"] is None


@pytest.mark.parametrize("run_id", ["fifo", "zero", "sparse"])
def test_runs_show_of_a_receipt_that_is_no_regular_file(odd_receipts, capsys, run_id) -> None:
    rc, _out, err = _run(capsys, "runs", "show", run_id, "--state-root", str(odd_receipts))
    assert rc == 2 and f"run {run_id} has unreadable receipt" in err and "Traceback" not in err


def test_runs_show_of_an_unreadable_run_directory_exits_2(odd_receipts, capsys, monkeypatch) -> None:
    """A runs/ this user may not search (as root, simulated): the directory and the fix, exit 2 as list."""
    real_stat = Path.stat

    def stat(self, *a, **k):
        if self.name == "good":
            raise PermissionError(13, "Permission denied", str(self))
        return real_stat(self, *a, **k)

    monkeypatch.setattr(Path, "stat", stat)
    rc, _out, err = _run(capsys, "runs", "show", "good", "--state-root", str(odd_receipts))
    assert rc == 2 and f"run directory {odd_receipts / 'runs' / 'good'} cannot be read" in err
    assert "Permission denied" in err and "run as the user ColdSnap runs as" in err


@pytest.mark.parametrize(("run_id", "said"), [("x" * 100_000, "no run 'xxx"), ("a\0b", "is not an operation id")])
def test_runs_show_of_an_impossible_id_is_said_briefly(odd_receipts, capsys, run_id, said) -> None:
    rc, _out, err = _run(capsys, "runs", "show", run_id, "--state-root", str(odd_receipts))
    assert rc == 2 and said in err and len(err) < 1000 and "Traceback" not in err


def test_runs_show_json_prints_the_bytes_it_validated(odd_receipts, capsys) -> None:
    rc, out, _err = _run(capsys, "runs", "show", "good", "--state-root", str(odd_receipts), "--json")
    assert rc == 0 and out.encode() == RECEIPT.read_bytes()


# ----------------------------------------------------------------------------- 4. runs list -n N


def _many_runs(root: Path, count: int) -> list[str]:
    """``count`` valid runs started a minute apart, in a shuffled order of creation; ids newest first."""
    import datetime as dt

    base = json.loads(RECEIPT.read_text())
    t0 = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
    started = {}
    for i in range(count):
        minute = (i * 37) % count
        op = f"run-{i:03d}"
        doc = json.loads(json.dumps(base))
        doc["operation_id"] = doc["timing"]["operation_id"] = op
        start = t0 + dt.timedelta(minutes=minute)
        doc["started_at"] = start.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        doc["completed_at"] = (start + dt.timedelta(seconds=doc["duration_seconds"])).strftime(
            "%Y-%m-%dT%H:%M:%S.%fZ")
        (root / "runs" / op).mkdir(parents=True)
        (root / "runs" / op / "receipt.json").write_bytes(receipt_bytes(doc))
        started[op] = minute
    return sorted(started, key=started.__getitem__, reverse=True)


def test_runs_list_n_reads_only_the_receipts_it_prints(tmp_path, capsys, monkeypatch) -> None:
    newest_first = _many_runs(tmp_path, 60)
    (tmp_path / "runs" / "broken").mkdir()
    (tmp_path / "runs" / "broken" / "receipt.json").write_text('{"format": 2}')
    for old in (tmp_path / "runs" / "broken" / "receipt.json", tmp_path / "runs" / "broken"):
        os.utime(old, (0, 0))  # an old run: no reason to read it for the newest five
    read: list[str] = []
    real = coldsnap.runs.load_receipt

    def counting(text):
        read.append("x")
        return real(text)

    monkeypatch.setattr(coldsnap.runs, "load_receipt", counting)
    rc, out, _err = _run(capsys, "runs", "list", "--state-root", str(tmp_path), "-n", "5", "--json")
    assert rc == 0 and [r["operation_id"] for r in json.loads(out)] == newest_first[:5]
    assert len(read) == 5, "only the five listed receipts are parsed"
    read.clear()
    rc, out, _err = _run(capsys, "runs", "list", "--state-root", str(tmp_path), "-n", "0", "--json")
    rows = json.loads(out)
    assert [r["operation_id"] for r in rows] == [*newest_first, "broken"] and len(read) == 61
    entries = coldsnap.runs.list_runs(tmp_path, limit=3)
    assert all(e.receipt is None and e.raw is None for e in entries), "a listing keeps no parsed receipt"


def test_runs_list_n_of_receipts_not_written_by_the_controller_uses_modification_times(tmp_path, capsys) -> None:
    """Compact JSON (no indented started_at line to look at): ranked by the files' times, still exact when
    each receipt was written after its run started."""
    newest_first = _many_runs(tmp_path, 12)
    for age, op in enumerate(newest_first):
        path = tmp_path / "runs" / op / "receipt.json"
        path.write_text(json.dumps(json.loads(path.read_text())))
        os.utime(path, (1_900_000_000 - age * 60,) * 2)
        os.utime(path.parent, (0, 0))
    rc, out, _err = _run(capsys, "runs", "list", "--state-root", str(tmp_path), "-n", "4", "--json")
    assert rc == 0 and [r["operation_id"] for r in json.loads(out)] == newest_first[:4]


# ----------------------------------------------------------------------------- 5. environment-digest --python


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


@pytest.mark.parametrize(("body", "describe", "said"), [
    ('echo "$@"', False, "answered no environment digest"),  # /bin/echo
    ("exit 0", False, "it printed nothing"),  # /bin/true
    ('echo "{not json"', True, "answered no environment description"),
    ('echo "[1, 2]"', True, "answered no environment description"),
    ("echo sha256:abc", False, "answered no environment digest"),
])
def test_environment_digest_checks_the_interpreters_answer(tmp_path, capsys, body, describe, said) -> None:
    fake = _script(tmp_path, "fakepy", body)
    rc, out, err = _run(capsys, "environment-digest", "--python", str(fake), *(["--describe"] if describe else []))
    assert rc == 2 and out == "" and said in err and str(fake) in err and "Traceback" not in err, err


def test_environment_digest_of_a_hanging_interpreter_is_stopped(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(environment, "OF_PYTHON_TIMEOUT_S", 1)
    slow = _script(tmp_path, "slowpy", "exec sleep 60")
    rc, _out, err = _run(capsys, "environment-digest", "--python", str(slow))
    assert rc == 2 and "did not compute its environment digest within 1 s" in err and "Traceback" not in err


@pytest.mark.parametrize("empty", ["", " "])
def test_environment_digest_refuses_an_empty_python(capsys, empty) -> None:
    rc, out, err = _run(capsys, "environment-digest", "--python", empty)
    assert rc == 2 and out == "" and "--python is empty" in err


def test_environment_digest_of_a_real_interpreter(capsys) -> None:
    rc, out, _err = _run(capsys, "environment-digest", "--python", sys.executable)
    assert rc == 0 and out.startswith("sha256:") and len(out.strip()) == 71
    rc, out, _err = _run(capsys, "environment-digest", "--python", sys.executable, "--describe")
    assert rc == 0 and set(json.loads(out)) >= {"python", "distributions", "code"}
