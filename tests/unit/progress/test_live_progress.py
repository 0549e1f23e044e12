"""The live-progress files of long module steps: writer, reader, lease, and the job_wait result shaping."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common import async_job
from ansible_collections.coldsnap.fleet.plugins.module_utils.common import progress as pg
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError

from coldsnap.runner.contract import RESULT_PROGRESS_KEY
from coldsnap.runner.progress import format_progress


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_writer_is_throttled_atomic_and_private(tmp_path: Path) -> None:
    clock = FakeClock()
    d = pg.private_dir(tmp_path / "runs" / "op" / "progress" / "stage")
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE(d.parent.stat().st_mode) == 0o700  # parents made here are private too
    w = pg.ProgressWriter(d, "stage/w0", phase="payload staging", clock=clock)
    w(10, 100)
    w(20, 100)  # within the interval: not written
    records = pg.read_progress(d)
    assert records[0]["done"] == 10 and records[0]["total"] == 100 and records[0]["phase"] == "payload staging"
    clock.now += 0.6
    w(30, 100)
    assert pg.read_progress(d)[0]["done"] == 30
    assert w.writes == 2
    files = list(d.iterdir())
    assert [f.name for f in files] == ["stage-w0" + pg.PROGRESS_SUFFIX]  # no temp file left, name made safe
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
    w.done("verified")
    rec = pg.read_progress(d)[0]
    assert rec["done"] == 100 and rec["state"] == "done" and rec["message"] == "verified"


def test_writer_without_a_directory_or_with_a_broken_one_never_fails(tmp_path: Path) -> None:
    nowhere = pg.ProgressWriter(None, "x", phase="p")
    nowhere(1, 2)
    assert not nowhere.enabled
    gone = pg.ProgressWriter(tmp_path / "missing", "x", phase="p")
    gone(1, 2)  # the directory does not exist: the writer turns itself off
    assert not gone.enabled


def test_reader_skips_broken_records_and_renders(tmp_path: Path) -> None:
    pg.ProgressWriter(tmp_path, "a", phase="capture export")(512, 1024)
    (tmp_path / ("b" + pg.PROGRESS_SUFFIX)).write_text("{half")
    (tmp_path / pg.LEASE_FILE).write_text("")
    records = pg.read_progress(tmp_path)
    assert len(records) == 1
    line = format_progress(records)[0]
    assert line.startswith("capture export: 512/1024 bytes (50%)")
    assert pg.read_progress(tmp_path / "none") == [] and pg.read_progress(None) == []


def test_capsule_events_count_blobs(tmp_path: Path) -> None:
    w = pg.ProgressWriter(tmp_path, "push-u0", phase="capsule push", unit="layers", min_interval=0)
    report = pg.mapping_progress(w)
    report({"unit": "u0", "status": "Pushing", "id": "abc"})
    report({"unit": "u0", "status": "pushed", "digest": "sha256:1", "bytes": 10})
    report({"unit": "u0", "status": "exists", "digest": "sha256:2"})
    rec = pg.read_progress(tmp_path)[0]
    assert rec["done"] == 2 and "exists sha256:2" in rec["message"]


def test_lease_watchdog_stops_an_unattended_job(tmp_path: Path) -> None:
    stopped = []
    dog = pg.LeaseWatchdog(tmp_path, 0.3, poll_s=0.05, on_expiry=lambda: stopped.append(True)).start()
    try:
        for _look in range(6):  # a waiter looks every 0.1 s: the job keeps running
            time.sleep(0.1)
            pg.refresh_lease(tmp_path)
        assert not stopped
        deadline = time.monotonic() + 5
        while not stopped and time.monotonic() < deadline:  # nobody looks any more
            time.sleep(0.05)
    finally:
        dog.stop()
    assert stopped == [True] and dog.expired
    assert any(r.get("phase") == "cancelled" for r in pg.read_progress(tmp_path))


def test_session_watches_only_under_async(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(pg.ASYNC_DIR_ENV, raising=False)
    with pg.ProgressSession(tmp_path / "p") as session:
        assert session.watchdog is None and session.directory.is_dir()
    jobs = tmp_path / "jobs"
    jobs.mkdir(mode=0o755)
    os.chmod(jobs, 0o755)
    monkeypatch.setenv(pg.ASYNC_DIR_ENV, str(jobs))
    with pg.ProgressSession(tmp_path / "q", lease_s=60) as session:
        assert session.watchdog is not None
        assert (tmp_path / "q" / pg.LEASE_FILE).exists()
    assert stat.S_IMODE(jobs.stat().st_mode) == 0o700  # the job's result file lands in a private directory
    with pg.ProgressSession(None) as session:
        assert not session.writer("x", phase="p").enabled


def _job(tmp_path: Path, content: dict | None) -> dict:
    jid = "j123.42"
    path = tmp_path / "async" / jid
    path.parent.mkdir(exist_ok=True)
    if content is not None:
        path.write_text(json.dumps(content))
    return {"ansible_job_id": jid, "results_file": str(path), "started": True, "finished": False, "changed": False}


def test_wait_returns_progress_while_the_job_runs(tmp_path: Path) -> None:
    job = _job(tmp_path, {"started": True, "finished": False, "ansible_job_id": "j123.42"})
    progress = tmp_path / "progress"
    pg.private_dir(progress)
    pg.ProgressWriter(progress, "stage", phase="payload staging")(5, 10)
    pg.refresh_lease(progress)  # the step's watchdog made it
    os.utime(progress / pg.LEASE_FILE, (1, 1))
    out = async_job.look(job, progress_dir=progress)
    assert out["finished"] is False and out["changed"] is False
    assert out[RESULT_PROGRESS_KEY][0]["done"] == 5
    assert pg.lease_age(progress) < 60  # the look refreshed the lease
    assert Path(job["results_file"]).exists()


def test_wait_returns_the_jobs_own_result_and_cleans_up(tmp_path: Path) -> None:
    result = {"changed": True, "path": "/x.pack", "verified": True, "coldsnap_timing": {"spans": [], "marks": []},
              "invocation": {"module_args": {"token": "VALUE_SPECIFIED_IN_NO_LOG_PARAMETER"}}}
    job = _job(tmp_path, result)
    progress = pg.private_dir(tmp_path / "progress")
    out = async_job.look(job, progress_dir=progress)
    assert out == {**result, "finished": True, "ansible_job_id": "j123.42"}
    assert not Path(job["results_file"]).exists() and not progress.exists()


def test_wait_hands_back_a_failure_with_the_modules_message(tmp_path: Path) -> None:
    job = _job(tmp_path, {"failed": True, "msg": "payload digest mismatch: expected sha256:aa", "quarantined": None})
    out = async_job.look(job)
    assert out["failed"] is True and out["msg"] == "payload digest mismatch: expected sha256:aa"
    assert out["finished"] is True
    silent = async_job.look(_job(tmp_path, {"failed": True}))
    assert silent["msg"]


def test_wait_passes_a_foreground_or_skipped_result_through(tmp_path: Path) -> None:
    skipped = {"changed": False, "skipped": True, "skip_reason": "Conditional result was False"}
    assert async_job.look(skipped) == skipped
    foreground = {"changed": True, "units": [1]}
    assert async_job.look(foreground, progress_dir=tmp_path / "p") == foreground
    # The step's own task reported its spans: handed on, they would be in the receipt twice.
    timed = {**foreground, "coldsnap_timing": {"spans": [{"name": "unit.criu.restore"}]}}
    assert async_job.look(timed) == foreground


def test_wait_refuses_what_is_not_an_async_launch(tmp_path: Path) -> None:
    job = _job(tmp_path, None)
    with pytest.raises(ColdSnapError, match="is gone"):
        async_job.look(job)
    with pytest.raises(ColdSnapError, match="does not name job"):
        async_job.look({**job, "results_file": str(tmp_path / "other")})
    half = _job(tmp_path, None)
    Path(half["results_file"]).write_text("")  # not written yet: still running
    assert async_job.look(half)["finished"] is False


def test_a_job_file_that_is_a_directory_is_an_error_not_a_job_that_runs_for_ever(tmp_path: Path) -> None:
    job = _job(tmp_path, None)
    Path(job["results_file"]).mkdir()
    with pytest.raises(ColdSnapError, match="cannot be read") as err:
        async_job.look(job)
    assert "register unchanged" in err.value.fix


def test_controller_shows_each_wait_retry_live() -> None:
    import io

    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.timing import SpanRecorder

    from coldsnap.runner.events import EventCollector
    from coldsnap.runner.progress import ProgressReporter
    from coldsnap.runner.redaction import Redactor

    out = io.StringIO()
    collector = EventCollector(SpanRecorder("controller"), parent_span_id=None, redactor=Redactor(),
                               progress=ProgressReporter(True, stream=out))
    running = {"finished": False, "ansible_job_id": "j1.2", "attempts": 1, "retries": 10}
    task = "Restore the units on this host"
    live = {**running, RESULT_PROGRESS_KEY: [{"phase": "unit u0", "message": "restore: unit.resume",
                                              "elapsed_s": 3.2}]}
    collector({"event": "runner_retry", "event_data": {"host": "gpu-a", "task": task, "res": live}})
    # Nothing reported yet: no line.
    collector({"event": "runner_retry", "event_data": {"host": "gpu-a", "task": task, "res": running}})
    other = {"attempts": 2, "retries": 5}
    collector({"event": "runner_retry", "event_data": {"host": "h", "task": "Wait for port", "res": other}})
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert "progress" in lines[0] and "unit u0: restore: unit.resume [3s]" in lines[0]
    assert "retrying Wait for port (2/5)" in lines[1]


def test_a_wait_never_creates_the_progress_directory(tmp_path: Path) -> None:
    job = _job(tmp_path, {"started": True, "finished": False})
    async_job.look(job, progress_dir=tmp_path / "never-made")  # check mode: the step wrote no progress
    assert not (tmp_path / "never-made").exists()


def test_a_wait_given_someone_elses_directory_removes_nothing_of_theirs(tmp_path: Path) -> None:
    """``progress_dir`` pointing at a directory with other files (a typo, a shared path): the step's own
    files go once the job ended, theirs and the directory stay; nothing is created there meanwhile."""
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "notes.txt").write_text("keep")
    (victim / "sub" / "data.txt").write_text("keep")
    running = _job(tmp_path, {"started": True, "finished": False, "ansible_job_id": "j123.42"})
    async_job.look(running, progress_dir=victim)
    assert not (victim / pg.LEASE_FILE).exists()
    pg.ProgressWriter(victim, "stage", phase="payload staging")(5, 10)
    (victim / ".stage.progress.json.tmp-1-2").write_text("{")
    Path(running["results_file"]).write_text(json.dumps({"changed": True}))
    assert async_job.look(running, progress_dir=victim)["finished"] is True
    assert sorted(p.name for p in victim.rglob("*")) == ["data.txt", "notes.txt", "sub"]


def test_job_wait_checks_its_options_also_when_the_step_ran_in_the_foreground() -> None:
    from module_runner import run_module

    typo = run_module("job_wait", {"job": {"changed": True, "foo": 1}, "progress_dri": "/tmp/x"})
    assert typo.get("failed") and "progress_dri" in typo["msg"], typo
    wrong = run_module("job_wait", {"job": {"changed": True}, "cleanup": "notabool"})
    assert wrong.get("failed") and "cleanup" in wrong["msg"], wrong
    handed = run_module("job_wait", {"job": {"changed": True, "units": [1]}})
    assert handed["finished"] is True and handed["changed"] is True and handed["units"] == [1], handed
