"""What a killed operation leaves on a host, removed by the next one.

A run killed at the wrong instant (``kill -9`` of the controller, a host reboot) can leave
temporary names behind: a capsule extraction in progress (``capsules/extracted/.<hex>.tmp-<pid>``,
``captures/<id>/units/.<unit>.tmp-<pid>`` and its ``.caches-<pid>``),
a staged runtime copy (``activation-runtime/sha256/.<hex>.tmp-<pid>``) or a payload copied from
another host but never staged (``model-payloads/incoming/<hex>.pack``). Nothing ever reads them
under those names; the next operation on the host removes the ones whose writer is gone.

A payload pulled from another host keeps its bytes in ``model-payloads/downloads/<hex>.peer-partial``
until they are verified, so that the next run resumes it; staging removes it once the payload is in
the node cache, and one untouched for a week is removed here.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import is_temp_name
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import StateLayout

_PID_TEMP = re.compile(r"^\..+\.(?:tmp|old|caches)-(\d+)$")
# A payload being copied in by a live operation is written continuously; one untouched this long
# belongs to an operation that is gone.
INCOMING_MAX_AGE_S = 3600.0
PEER_PARTIAL_MAX_AGE_S = 7 * 86400.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale(entry: Path) -> bool:
    m = _PID_TEMP.match(entry.name)
    if m:
        return not _pid_alive(int(m.group(1)))
    return is_temp_name(entry.name) and time.time() - entry.lstat().st_mtime > INCOMING_MAX_AGE_S


def clean_stale_temps(state_root: Path | str, *, check_mode: bool = False) -> list[str]:
    """Remove leftovers of killed operations below ``state_root``; return what was (or would be) removed."""
    layout = StateLayout(state_root)
    removed: list[str] = []
    # A unit's state extracted from its capsule in prepare (``captures/<id>/units/.<unit>.tmp-<pid>``) and
    # the derived-cache files extracted with it (``.<unit>.caches-<pid>``) sit one level further down.
    unit_dirs = sorted(layout.captures.glob("*/units")) if layout.captures.is_dir() else []
    for parent in (layout.capsules_extracted, layout.activation_runtimes, layout.captures, *unit_dirs):
        if not parent.is_dir():
            continue
        for entry in parent.iterdir():
            if entry.name.startswith(".") and _stale(entry):
                removed.append(str(entry))
                if not check_mode:
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        entry.unlink(missing_ok=True)
    now = time.time()
    for parent, suffix, max_age in ((layout.payload_incoming, ".pack", INCOMING_MAX_AGE_S),
                                    (layout.payloads / "downloads", ".peer-partial", PEER_PARTIAL_MAX_AGE_S)):
        if not parent.is_dir():
            continue
        for entry in parent.iterdir():
            if entry.name.endswith(suffix) and now - entry.lstat().st_mtime > max_age:
                removed.append(str(entry))
                if not check_mode:
                    entry.unlink(missing_ok=True)
    return removed
