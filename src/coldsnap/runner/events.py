"""Turn ansible-runner events into task results, stats, spans and progress.

One :class:`EventCollector` serves as the run's ``event_handler``. For every
event it first scrubs known secret values *in place* (ansible-runner writes the
very dict the handler received to ``job_events/``), then records:

* one row per (host, task) result, ordered by the event ``counter``;
* one ``controller`` span per (host, task) from ``runner_on_start`` to its result;
* unit-clock spans a module returned under ``coldsnap_timing`` (imported as is,
  never shifted onto the controller clock);
* progress lines (task start/finish and ``coldsnap_progress``);
* what a restore's evict step stopped and whether activation brought it back
  (``coldsnap_evicted``, by host: the receipt's ``result.eviction``);
* ``playbook_on_stats`` totals and the ``set_stats`` data (``artifact_data``).

It always returns True: a falsy return makes ansible-runner drop the event and
leaves ``r.stats`` empty.
"""

from __future__ import annotations

import collections
import json
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO, Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.eviction import RESULT_EVICTED_KEY
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.timing import SpanRecorder

from coldsnap.runner.contract import RESULT_PROGRESS_KEY, RESULT_TIMING_KEY
from coldsnap.runner.progress import ProgressReporter
from coldsnap.runner.redaction import Redactor

RESULT_EVENTS = {
    "runner_on_ok": "ok",
    "runner_on_failed": "failed",
    "runner_on_unreachable": "unreachable",
    "runner_on_skipped": "skipped",
}
ITEM_EVENTS = ("runner_item_on_ok", "runner_item_on_failed", "runner_item_on_skipped")
UNIT_CLOCK_RE = re.compile(r"unit:[A-Za-z0-9._-]+\Z")
MAX_MSG = 2000
STAT_KEYS = (("ok", "ok"), ("changed", "changed"), ("failures", "failures"), ("dark", "unreachable"),
             ("skipped", "skipped"), ("rescued", "rescued"), ("ignored", "ignored"))


@dataclass
class _OpenTask:
    span: dict
    host: str
    task: str
    action: str | None
    play: str | None
    started: float
    counter: int


def _truncate(text: str, limit: int = MAX_MSG) -> str:
    return text if len(text) <= limit else text[: limit - 15] + " ...[truncated]"


def _message_in_display(stdout: Any) -> str | None:
    """The ``msg`` of a result as ansible-playbook displayed it (``fatal: [h]: FAILED! => {...}``)."""
    if not isinstance(stdout, str) or "=> " not in stdout:
        return None
    text = stdout.split("=> ", 1)[1].strip()
    try:
        shown = json.loads(text)
    except ValueError:
        return _truncate(text) or None
    return result_message(shown, failed=True) if isinstance(shown, Mapping) else None


def result_message(res: Mapping[str, Any], *, failed: bool) -> str | None:
    """The human message of a module result: ``msg`` (plus stderr's tail on failure)."""
    msg = res.get("msg")
    if msg is not None and not isinstance(msg, str):
        msg = json.dumps(msg, sort_keys=True, default=str)
    parts = [msg] if msg else []
    if failed:
        stderr = res.get("stderr")
        if isinstance(stderr, str) and stderr.strip():
            parts.append("stderr: " + " / ".join(stderr.strip().splitlines()[-5:]))
        if isinstance(res.get("results"), list):
            # A loop's failure: Ansible sets only "One or more items failed"; the cause is in the items.
            inner = [result_message(r, failed=True) for r in res["results"]
                     if isinstance(r, Mapping) and r.get("failed")]
            parts.extend(m for m in inner if m and m not in parts)
    return _truncate("; ".join(parts)) if parts else None


def normalize_unit_timing(payload: Any, *, host: str, tag: str) -> tuple[list[dict], list[dict], list[str]]:
    """Check and normalize a module's ``coldsnap_timing`` value.

    Returns (spans, marks, problems). Spans must sit on a ``unit:<id>`` clock:
    a module cannot write onto the controller's clock. Span ids are prefixed
    with ``tag`` so several results of the same unit never collide.
    """
    problems: list[str] = []
    if not isinstance(payload, Mapping):
        return [], [], [f"{RESULT_TIMING_KEY} is {type(payload).__name__}, expected an object"]
    raw_spans = payload.get("spans") or []
    raw_marks = payload.get("marks") or []
    if not isinstance(raw_spans, list) or not isinstance(raw_marks, list):
        return [], [], [f"{RESULT_TIMING_KEY}.spans/marks must be lists"]
    ids = {s.get("span_id"): f"{tag}/{s.get('span_id')}" for s in raw_spans
           if isinstance(s, Mapping) and isinstance(s.get("span_id"), str)}
    spans: list[dict] = []
    for i, s in enumerate(raw_spans):
        where = f"{RESULT_TIMING_KEY}.spans[{i}]"
        if not isinstance(s, Mapping):
            problems.append(f"{where} is not an object")
            continue
        clock, name, start, end = s.get("clock"), s.get("name"), s.get("start_ns"), s.get("end_ns")
        if not isinstance(clock, str) or not UNIT_CLOCK_RE.match(clock):
            problems.append(f"{where}.clock {clock!r} is not 'unit:<id>'")
            continue
        if not isinstance(name, str) or not name:
            problems.append(f"{where}.name is missing")
            continue
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            problems.append(f"{where}.start_ns is not a non-negative integer")
            continue
        if end is not None and (not isinstance(end, int) or isinstance(end, bool) or end < start):
            problems.append(f"{where}.end_ns is not an integer >= start_ns")
            continue
        wall = s.get("wall_start_unix_ns")
        spans.append({
            "span_id": ids.get(s.get("span_id"), f"{tag}/{i}"),
            "parent_id": ids.get(s.get("parent_id")),
            "name": name,
            "host": s.get("host") if isinstance(s.get("host"), str) else host,
            "unit": s.get("unit") if isinstance(s.get("unit"), str) else clock[len("unit:"):],
            "clock": clock,
            "start_ns": start,
            "end_ns": end,
            "wall_start_unix_ns": wall if isinstance(wall, int) and not isinstance(wall, bool) else None,
            "status": s.get("status") if isinstance(s.get("status"), str) else "ok",
            "attrs": dict(s.get("attrs")) if isinstance(s.get("attrs"), Mapping) else {},
        })
    marks: list[dict] = []
    for i, m in enumerate(raw_marks):
        where = f"{RESULT_TIMING_KEY}.marks[{i}]"
        if not (isinstance(m, Mapping) and isinstance(m.get("clock"), str) and UNIT_CLOCK_RE.match(m["clock"])
                and isinstance(m.get("name"), str) and m["name"]
                and isinstance(m.get("t_ns"), int) and not isinstance(m.get("t_ns"), bool) and m["t_ns"] >= 0):
            problems.append(f"{where} needs name, clock 'unit:<id>' and an integer t_ns")
            continue
        wall = m.get("wall_unix_ns")
        marks.append({"name": m["name"], "clock": m["clock"],
                      "host": m.get("host") if isinstance(m.get("host"), str) else host,
                      "unit": m.get("unit") if isinstance(m.get("unit"), str) else m["clock"][len("unit:"):],
                      "t_ns": m["t_ns"], "wall_unix_ns": wall if isinstance(wall, int) else None,
                      "attrs": dict(m.get("attrs")) if isinstance(m.get("attrs"), Mapping) else {}})
    return spans, marks, problems


class EventCollector:
    """The ``event_handler`` of one run; see the module docstring."""

    def __init__(self, recorder: SpanRecorder, *, parent_span_id: str | None, redactor: Redactor,
                 progress: ProgressReporter, stdout_log: IO[str] | None = None,
                 on_playbook_start: Callable[[], None] | None = None) -> None:
        self.recorder = recorder
        self.parent_span_id = parent_span_id
        self.redactor = redactor
        self.progress = progress
        self.stdout_log = stdout_log
        self.on_playbook_start = on_playbook_start
        self.tasks: list[dict] = []
        self.stats: dict[str, dict[str, int]] = {}
        self.custom_stats: dict[str, Any] = {}
        self.stats_seen = False
        self.failures: list[dict] = []
        self.unreachable_hosts: list[str] = []
        self.open: dict[tuple[str, str], _OpenTask] = {}
        self.last_started: _OpenTask | None = None
        self.verbose_tail: collections.deque[str] = collections.deque(maxlen=40)
        self.handler_errors: list[str] = []
        self.timing_problems: list[str] = []
        self.events_seen = 0
        self.current_play: str | None = None
        # host -> {"units": what its evict step stopped (None: not known), "restored": activation passed}
        self.evictions: dict[str, dict[str, Any]] = {}

    # ansible-runner calls this for every event.
    def __call__(self, event: dict) -> bool:
        try:
            self.redactor.scrub_in_place(event)
        except Exception as exc:  # never let a bug of ours stop the run or the event record
            self.handler_errors.append(f"redaction: {type(exc).__name__}: {exc}")
            event.clear()
            event.update({"event": "redaction-failed"})
        try:
            self._handle(event)
        except Exception as exc:
            self.handler_errors.append(f"{event.get('event')}: {type(exc).__name__}: {exc}")
        return True  # falsy would suppress the event and empty r.stats

    def _handle(self, event: dict) -> None:
        self.events_seen += 1
        name = event.get("event")
        # ansible-playbook has read its ``-e @file`` once the playbook starts; with -v its banner and
        # configuration lines come as events before that, so "the first event" is too early.
        if self.on_playbook_start is not None and isinstance(name, str) and name.startswith("playbook_on_"):
            self.on_playbook_start()
            self.on_playbook_start = None
        ed = event.get("event_data") or {}
        stdout = event.get("stdout")
        if isinstance(stdout, str) and stdout:
            if self.stdout_log is not None:
                self.stdout_log.write(stdout.replace("\r\n", "\n") + "\n")
                self.stdout_log.flush()
            if name in ("verbose", "error", "warning", "deprecated") or not name:
                for line in stdout.replace("\r\n", "\n").splitlines():
                    if line.strip():
                        self.verbose_tail.append(line.rstrip())
        if name == "playbook_on_play_start":
            self.current_play = ed.get("name") or ed.get("play")
            self.progress.play(self.current_play or "(unnamed play)")
        elif name == "runner_on_start":
            self._task_started(event, ed)
        elif name in RESULT_EVENTS:
            self._task_finished(event, ed, RESULT_EVENTS[name])
        elif name in ITEM_EVENTS:
            res = ed.get("res") or {}
            if isinstance(res, Mapping) and RESULT_PROGRESS_KEY in res:
                self.progress.progress(str(ed.get("host")), self._task_name(ed), res[RESULT_PROGRESS_KEY])
        elif name == "runner_retry":
            res = ed.get("res") if isinstance(ed.get("res"), Mapping) else {}
            if RESULT_PROGRESS_KEY in res:
                # A coldsnap.fleet.job_wait look at a long step: its live progress.
                self.progress.progress(str(ed.get("host")), self._task_name(ed), res[RESULT_PROGRESS_KEY])
            elif "ansible_job_id" not in res:  # a job that reported nothing yet is not news
                self.progress.note(f"{ed.get('host')}: retrying {self._task_name(ed)} "
                                   f"({res.get('attempts', '?')}/{res.get('retries', '?')})")
        elif name == "playbook_on_stats":
            self._stats(ed)

    @staticmethod
    def _task_name(ed: Mapping[str, Any]) -> str:
        return str(ed.get("task") or ed.get("resolved_action") or ed.get("task_action") or "(unnamed task)")

    def _task_started(self, event: Mapping[str, Any], ed: Mapping[str, Any]) -> None:
        host = str(ed.get("host"))
        task = self._task_name(ed)
        action = ed.get("resolved_action") or ed.get("task_action")
        play = ed.get("play") or self.current_play
        span = self.recorder.start_span(task, parent_id=self.parent_span_id, host=host, action=action, play=play)
        opened = _OpenTask(span=span, host=host, task=task, action=action, play=play, started=time.monotonic(),
                           counter=int(event.get("counter") or 0))
        self.open[(host, str(ed.get("task_uuid") or task))] = opened
        self.last_started = opened
        self.progress.task_started(host, task)

    def _task_finished(self, event: Mapping[str, Any], ed: Mapping[str, Any], status: str) -> None:
        host = str(ed.get("host"))
        task = self._task_name(ed)
        res = ed.get("res") if isinstance(ed.get("res"), Mapping) else {}
        counter = int(event.get("counter") or 0)
        censored = "censored" in res and len(res) == 1
        ignored = status == "failed" and bool(ed.get("ignore_errors"))
        changed = bool(res.get("changed")) and status in ("ok", "failed")
        msg = None if censored else result_message(res, failed=status in ("failed", "unreachable"))
        if not msg and not res and status in ("failed", "unreachable"):
            # ansible-runner leaves out a result larger than its event limit (a huge module argument): the
            # message is still in the line ansible-playbook printed for the task.
            msg = _message_in_display(event.get("stdout"))
        opened = self.open.pop((host, str(ed.get("task_uuid") or task)), None)
        if opened is None:  # a result without a start event: record a zero-length span
            span = self.recorder.start_span(task, parent_id=self.parent_span_id, host=host,
                                            action=ed.get("resolved_action") or ed.get("task_action"),
                                            play=ed.get("play") or self.current_play)
            opened = _OpenTask(span=span, host=host, task=task, action=span["attrs"]["action"],
                               play=span["attrs"]["play"], started=time.monotonic(), counter=counter)
        span_attrs: dict[str, Any] = {"changed": changed}
        if isinstance(ed.get("duration"), int | float):
            span_attrs["ansible_duration_s"] = ed["duration"]
        if ignored:
            span_attrs["ignored"] = True
        self.recorder.end_span(opened.span, status=status, **span_attrs)
        row = {
            "counter": counter, "host": host, "task": task, "action": opened.action, "play": opened.play,
            "role": ed.get("role"), "status": status, "changed": changed, "ignored": ignored,
            "censored": censored, "msg": msg,
            "duration_seconds": ed.get("duration") if isinstance(ed.get("duration"), int | float) else None,
        }
        self.tasks.append(row)
        if status in ("failed", "unreachable") and not ignored:
            self.failures.append(row)
        if status == "unreachable" and host not in self.unreachable_hosts:
            self.unreachable_hosts.append(host)
        self.progress.task_finished(host, task, "ignored" if ignored else
                                    ("changed" if changed and status == "ok" else status),
                                    time.monotonic() - opened.started, msg)
        if not censored:
            self._import_from_result(res, host=host, task=task, counter=counter, span_id=opened.span["span_id"])
            self._note_eviction(res, host=host)

    def _note_eviction(self, res: Mapping[str, Any], *, host: str) -> None:
        """A restore's evict step (what it stopped, or null when it failed part way) and a successful
        activation (``restored``) report under ``coldsnap_evicted``; a failure carries it in ``details``."""
        details = res.get("details") if isinstance(res.get("details"), Mapping) else {}
        report = res.get(RESULT_EVICTED_KEY, details.get(RESULT_EVICTED_KEY))
        if not isinstance(report, Mapping):
            return
        mine = self.evictions.setdefault(host, {"units": None, "restored": False})
        if "units" in report:
            units = report["units"]
            mine["units"] = [dict(u) for u in units if isinstance(u, Mapping)] if isinstance(units, list) else None
        if report.get("restored") is True:
            mine["restored"] = True

    def _import_from_result(self, res: Mapping[str, Any], *, host: str, task: str, counter: int,
                            span_id: str) -> None:
        results = [res]
        loop = res.get("results")
        if isinstance(loop, list):
            results += [r for r in loop if isinstance(r, Mapping)]
        for n, r in enumerate(results):
            if RESULT_TIMING_KEY in r:
                spans, marks, problems = normalize_unit_timing(r[RESULT_TIMING_KEY], host=host,
                                                               tag=f"{host}#{counter}.{n}")
                for s in spans:
                    s["attrs"].setdefault("controller_span", span_id)
                if spans or marks:
                    self.recorder.import_spans(spans, marks)
                self.timing_problems.extend(f"{host}: {task}: {p}" for p in problems)
            # Loop items were shown live by their item events.
            if n == 0 and RESULT_PROGRESS_KEY in r:
                self.progress.progress(host, task, r[RESULT_PROGRESS_KEY])

    def _stats(self, ed: Mapping[str, Any]) -> None:
        self.stats_seen = True
        hosts: set[str] = set()
        for key, _label in (*STAT_KEYS, ("processed", "processed")):
            if isinstance(ed.get(key), Mapping):
                hosts.update(ed[key])
        self.stats = {h: {out: int((ed.get(key) or {}).get(h, 0)) for key, out in STAT_KEYS} for h in sorted(hosts)}
        artifact = ed.get("artifact_data")
        self.custom_stats = dict(artifact) if isinstance(artifact, Mapping) else {}
        # An unreachable result of a task with ignore_unreachable (a delegated task to a capture host, which
        # Ansible reports as the delegating host's) left its host in the play: the stats count it as ok.
        self.unreachable_hosts = [h for h in self.unreachable_hosts if h not in self.stats
                                  or self.stats[h]["unreachable"]]
        for h, s in self.stats.items():
            if s["unreachable"] and h not in self.unreachable_hosts:
                self.unreachable_hosts.append(h)

    def close_open_tasks(self, status: str) -> list[dict]:
        """End every span still open (cancellation, crash) and return those tasks."""
        closed = []
        for opened in sorted(self.open.values(), key=lambda o: o.counter):
            self.recorder.end_span(opened.span, status=status)
            self.progress.task_finished(opened.host, opened.task, status, time.monotonic() - opened.started)
            closed.append({"host": opened.host, "task": opened.task, "play": opened.play, "action": opened.action})
        self.open.clear()
        return closed

    def failed_hosts(self) -> list[str]:
        """Hosts the final stats count failures for (empty before ``playbook_on_stats``)."""
        return [h for h, s in self.stats.items() if s["failures"]]

    def fatal_failure(self) -> dict | None:
        """The first failed/unreachable result that decided the run.

        Ignored failures never count. A rescued failure is followed by more
        tasks on its host, while the failure that ends a host is its last one:
        so, once the stats are known, each failed host contributes its *last*
        failure, each unreachable host its first unreachable result, and the
        earliest of those is the error. Without stats (cancelled, crashed) the
        first failure is the best evidence.
        """
        if not self.failures:
            return None
        if not self.stats_seen:
            return min(self.failures, key=lambda f: f["counter"])
        decisive: list[dict] = []
        for host, s in self.stats.items():
            mine = [f for f in self.failures if f["host"] == host]
            unreachable = [f for f in mine if f["status"] == "unreachable"]
            failed = [f for f in mine if f["status"] == "failed"]
            if s["unreachable"] and unreachable:
                decisive.append(min(unreachable, key=lambda f: f["counter"]))
            elif s["failures"] and failed:
                decisive.append(max(failed, key=lambda f: f["counter"]))
        return min(decisive or self.failures, key=lambda f: f["counter"])

    def sorted_tasks(self) -> list[dict]:
        """Task rows ordered by event counter; failures a block rescued are flagged ``rescued``."""
        rows = sorted(self.tasks, key=lambda t: t["counter"])
        if self.stats_seen:
            for host, s in self.stats.items():
                failed = [r for r in rows if r["host"] == host and r["status"] == "failed" and not r["ignored"]]
                rescued = failed[:-1] if s["failures"] else failed
                for r in rescued:
                    r["rescued"] = True
        for r in rows:
            r.setdefault("rescued", False)
        return rows
