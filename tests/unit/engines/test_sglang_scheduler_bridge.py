"""The SGLang control bridge: steps run on the scheduler's own thread between iterations,
and a quiesced scheduler is held inside the hook until serving resumes.

A real thread plays SGLang's event loop: each iteration it calls the same ``pump()`` the
``Scheduler.ingest_requests`` hook calls, then does one unit of "batch" work while busy.
"""

from __future__ import annotations

import threading
import time

import pytest
from coldsnap_engines.sglang.control import SglangControl


class Loop:
    def __init__(self) -> None:
        self.busy = 3  # batches still running when quiesce arrives
        self.iterations = 0
        self.stop = False
        self.control: SglangControl | None = None
        self.thread = threading.Thread(target=self.run, daemon=True)

    def is_fully_idle(self, **_kw) -> bool:
        return self.busy == 0

    def run(self) -> None:
        while not self.stop:
            self.control.pump()
            if self.busy:
                self.busy -= 1
            self.iterations += 1
            time.sleep(0.01)


@pytest.fixture
def bridge():
    loop = Loop()
    control = SglangControl(loop)
    loop.control = control
    loop.thread.start()
    yield loop, control
    loop.stop = True
    control.hold = False
    loop.thread.join(5)


def test_steps_run_on_the_scheduler_thread(bridge):
    loop, control = bridge
    assert control._call(threading.get_ident) == loop.thread.ident


def test_quiesce_waits_for_idle_then_holds_the_loop_until_resume(bridge):
    loop, control = bridge
    control.pause_serving()
    assert loop.busy == 0 and control.hold
    held_at = loop.iterations
    time.sleep(0.3)
    assert loop.iterations == held_at, "a held scheduler runs no iteration"
    assert control._call(lambda: 42) == 42, "but it still runs control steps"
    control.resume_serving()
    time.sleep(0.2)
    assert loop.iterations > held_at


def test_a_failing_step_reports_to_the_caller(bridge):
    _loop, control = bridge

    def boom():
        raise RuntimeError("release failed")

    with pytest.raises(RuntimeError, match="release failed"):
        control._call(boom)
