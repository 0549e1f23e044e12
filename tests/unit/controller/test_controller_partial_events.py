"""Event files a killed controller left unscrubbed are dropped by the next run; a running one's are not."""

from __future__ import annotations

from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import file_lock

from coldsnap.runner.driver import _drop_stale_partial_events


def _partial(runs: Path, run: str) -> Path:
    events = runs / run / "artifacts" / "ident" / "job_events"
    events.mkdir(parents=True)
    (events / "7-abc.json").write_text('{"stdout": "scrubbed"}')
    partial = events / "abc-partial.json"
    partial.write_text('{"stdout": "token=KillTestSecret-98765"}')
    return partial


def test_partials_of_runs_no_controller_holds_are_dropped_and_a_running_ones_kept(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    killed, running, this = (_partial(runs, name) for name in ("op-killed", "op-running", "op-this"))
    (runs / "op-killed" / ".lock").write_text("")  # its controller died: the lock file stays, unheld
    with file_lock(runs / "op-running" / ".lock", timeout=0), file_lock(runs / "op-this" / ".lock", timeout=0):
        _drop_stale_partial_events(runs, runs / "op-this")
    assert not killed.exists() and not this.exists()
    assert running.exists()  # its controller scrubs it when it ends
    assert (killed.parent / "7-abc.json").exists()  # processed events stay
