"""Helpers shared by the collection's modules (thin wrappers stay thin)."""

from __future__ import annotations

import traceback
from collections.abc import Callable

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError


def run_guarded(module, fn: Callable[[], dict], *, what: str) -> None:
    """Call ``fn`` and exit the module with its result; user errors become one clear message."""
    try:
        result = fn()
    except ColdSnapError as exc:
        module.fail_json(msg=str(exc), **({"details": exc.details} if exc.details else {}))
    except Exception as exc:  # unexpected: keep the traceback for -vvv
        module.fail_json(msg=f"{what} failed unexpectedly: {type(exc).__name__}: {exc}",
                         exception=traceback.format_exc())
    else:
        module.exit_json(**result)
