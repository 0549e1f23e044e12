"""The one exception family ColdSnap's library raises for problems a user can fix.

Every error names the object, what is wrong and what to do: modules turn it into
``fail_json(msg=...)``, the controller prints it, the in-unit runtime reports it.
"""

from __future__ import annotations

import errno
from pathlib import Path


class ColdSnapError(Exception):
    """A failure with a message fit for the user: object, problem, fix."""

    def __init__(self, message: str, *, fix: str | None = None, details: dict | None = None) -> None:
        self.problem = message
        self.fix = fix
        self.details = details or {}
        super().__init__(message if not fix else f"{message}; {fix}")


class FormatError(ColdSnapError):
    """A document (request, artifact, manifest...) failed strict validation."""

    #: The message lists this many problems; a document wrong everywhere (thousands of bad entries) would
    #: otherwise make a message as large as itself. ``issues`` keeps them all.
    SHOWN = 50

    def __init__(self, issues: list[FormatIssue], *, document: str) -> None:
        self.issues = issues
        self.document = document
        lines = [f"{document} is invalid ({len(issues)} problem{'s' if len(issues) != 1 else ''}):"]
        lines.extend(f"  - {issue}" for issue in issues[:self.SHOWN])
        if len(issues) > self.SHOWN:
            lines.append(f"  - ... and {len(issues) - self.SHOWN} more: fix these first, then validate again")
        super().__init__("\n".join(lines))


class FormatIssue:
    """One problem at one JSON path, with the fix."""

    __slots__ = ("fix", "message", "path")

    def __init__(self, path: str, message: str, fix: str) -> None:
        self.path = path
        self.message = message
        self.fix = fix

    def as_dict(self) -> dict:
        return {"path": self.path, "message": self.message, "fix": self.fix}

    def __str__(self) -> str:
        return f"{self.path}: {self.message} (fix: {self.fix})"

    def __repr__(self) -> str:
        return f"FormatIssue({self.path!r}, {self.message!r})"


class IntegrityError(ColdSnapError):
    """Bytes do not match the identity they claim (digest, size, map)."""


class AdmissionError(ColdSnapError):
    """A destination cannot run a captured artifact; nothing was changed."""


class UnitError(ColdSnapError):
    """A launch unit (engine process or container) failed; carries its last log lines."""


def space_error(exc: OSError, *, what: str, path: Path | str, needed: int | None = None) -> Exception:
    """Turn a no-space error into a ColdSnapError that names the file system and the fix."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        need = f" ({needed} bytes needed)" if needed is not None else ""
        return ColdSnapError(
            f"no space left on the file system of {path} while writing {what}{need}",
            fix="free space there (or point coldsnap_state_root at a larger file system) and run again; "
                "the partial file was removed")
    return exc
