"""Wait for an Ansible async job, one look at a time, and shape what the waiting task returns.

A long step runs with ``async: <limit>`` and ``poll: 0``; the task registers
Ansible's launch result (``ansible_job_id``, ``results_file``). The follow-up
``coldsnap.fleet.job_wait`` task calls :func:`look` on every retry (``until:
<result>.finished``):

* while the job runs: ``finished: false`` and ``coldsnap_progress`` (what the
  step's :class:`~.progress.ProgressWriter` records say now); the job's lease
  is refreshed, so it keeps running;
* once it ended: the job's own result, unchanged (``failed``/``msg``/``changed``
  and every return value), plus ``finished: true``; the job file and the
  progress directory are removed;
* a launch result without a job id (the step ran in the foreground, or was
  skipped) is returned as it is, less its ``coldsnap_timing``: the step's own
  task reported those spans already, and a receipt would count them twice.

So a register, a failure message or a receipt reads the same as when the step
ran in the foreground.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.progress import (
    LEASE_FILE,
    PROGRESS_SUFFIX,
    RESULT_PROGRESS_KEY,
    read_progress,
    refresh_lease,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import STATE_ROOT_ARG

#: The job_wait module's options (its action plugin validates them too, before handing a result on).
ARGUMENT_SPEC = dict(
    state_root=dict(STATE_ROOT_ARG),
    job=dict(type="dict", required=True),
    progress_dir=dict(type="path"),
    cleanup=dict(type="bool", default=True),
)

#: A step's unit-clock spans in its result (the controller's receipt takes them from the step's task).
TIMING_KEY = "coldsnap_timing"

#: Keys of Ansible's launch result that are about the launch, not about the step.
LAUNCH_KEYS = ("ansible_job_id", "results_file", "started", "finished", "_ansible_suppress_tmpdir_delete")


def _job_file(job: dict) -> Path:
    jid, results = job.get("ansible_job_id"), job.get("results_file")
    if not isinstance(jid, str) or not jid or not isinstance(results, str) or not results:
        raise ColdSnapError("job is not the registered result of an async task (no ansible_job_id/results_file)",
                            fix="register the long task (async: N, poll: 0) and pass that register as job")
    path = Path(results)
    if path.name != jid or not path.is_absolute():
        raise ColdSnapError(f"job's results_file {results!r} does not name job {jid!r}",
                            fix="pass the async task's register unchanged as job")
    return path


def read_job(path: Path) -> dict | None:
    """The job file's content; None while it is not (yet) readable."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ColdSnapError(f"async job file {path} is gone: the job was cleaned up or never started",
                            fix="run the step again; do not wait twice for the same job") from None
    except (IsADirectoryError, PermissionError) as exc:
        # Not a state the job passes through: waiting would only run into the retries' end.
        raise ColdSnapError(f"async job file {path} cannot be read: {exc.strerror}",
                            fix="pass the async task's register unchanged as job, and wait as the user "
                                "that started it") from None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_running(data: dict | None) -> bool:
    """Ansible's async wrapper writes ``started`` + ``finished: false`` first, the module's result last."""
    return data is None or (bool(data.get("started")) and not data.get("finished"))


def _progress_file(name: str) -> bool:
    """What a step's progress session writes: its lease, its records and their temporaries."""
    record = name[1:].split(".tmp-", 1)[0] if name.startswith(".") and ".tmp-" in name else name
    return name == LEASE_FILE or record.endswith(PROGRESS_SUFFIX)


def cleanup(job_file: Path | None, progress_dir: Path | str | None) -> None:
    """Remove the job file and what the step wrote into its progress directory, then the directory once it
    is empty (missing ones are fine). Nothing else is removed: a ``progress_dir`` that names a directory
    with other files in it (a typo, a shared path) keeps them, and so the directory itself."""
    if job_file is not None:
        with contextlib.suppress(OSError):
            os.unlink(job_file)
    if progress_dir:
        directory = Path(progress_dir)
        with contextlib.suppress(OSError):
            for entry in os.scandir(directory):
                if entry.is_file(follow_symlinks=False) and _progress_file(entry.name):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
        for empty in (directory, directory.parent):  # and the run's progress/ directory after its last step
            try:
                os.rmdir(empty)
            except OSError:
                break


def finished_result(data: dict, jid: str) -> dict:
    """The job's own result as the waiting task returns it."""
    out = dict(data)
    out["finished"] = True
    out["ansible_job_id"] = jid
    if out.get("failed") and not out.get("msg"):
        out["msg"] = "the async step failed without a message"
    return out


def running_result(jid: str, progress_dir: Path | str | None) -> dict[str, Any]:
    """What the waiting task returns while the job runs (shown live by the controller)."""
    out: dict[str, Any] = {"changed": False, "finished": False, "started": True, "ansible_job_id": jid}
    records = read_progress(progress_dir)
    if records:
        out[RESULT_PROGRESS_KEY] = records
    return out


def look(job: dict, *, progress_dir: Path | str | None = None, remove: bool = True) -> dict:
    """One look at the job (see the module docstring)."""
    if not isinstance(job, dict):
        raise ColdSnapError("job must be the registered result of the async task (a dict)",
                            fix="pass the async task's register as job")
    if "ansible_job_id" not in job:
        # Ran in the foreground (async 0) or was skipped: nothing to wait for, and its spans are the step's.
        return {k: v for k, v in job.items() if k != TIMING_KEY}
    path = _job_file(job)
    if progress_dir:
        refresh_lease(progress_dir, create=False)
    data = read_job(path)
    if data is None or is_running(data):
        return running_result(job["ansible_job_id"], progress_dir)
    if remove:
        cleanup(path, progress_dir)
    return finished_result(data, job["ansible_job_id"])
