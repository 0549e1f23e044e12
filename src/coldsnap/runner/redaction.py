"""Keep credentials out of everything the controller stores or prints.

Two complementary rules:

* **by name**: in an environment mapping (the ``starting`` status payload, the
  runner's ``command`` artifact) every variable whose name looks secret
  (``*TOKEN*``, ``*PASSWORD*``, ``*SECRET*``, ``*KEY*`` ...) is replaced;
* **by value**: the values of those variables, of secret extra vars and of
  secret-named inventory variables are replaced wherever they appear in event
  data, stdout, task messages and custom stats, so a task that echoes a
  credential by mistake still stores only the placeholder.

Values shorter than :data:`MIN_SCRUB_LENGTH` are redacted by name only: scrubbing
"1" or "true" out of every event would destroy the record and protect nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.secrets import (
    URL_PASSWORD_RE,
    holds_url_password,
    is_secret_name,
)

REDACTED = "<redacted>"
MIN_SCRUB_LENGTH = 6

# Names of variables that carry credentials: one rule (module_utils/formats/secrets.py).


def redact_env(env: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of an environment mapping with secret-named values, and URLs that carry a password
    (``HTTPS_PROXY=http://user:pw@proxy``), replaced."""
    return {k: (REDACTED if is_secret_name(str(k)) or (isinstance(v, str) and holds_url_password(v)) else v)
            for k, v in env.items()}


def written_forms(text: str) -> set[str]:
    """``text`` as it may appear in what Ansible prints and stores: as is, escaped inside a JSON string
    (a result dumped as JSON, ASCII or not), that escaped again (JSON quoted inside JSON) and as Python's
    ``repr`` shows it. A password with a quote, a backslash or a tab leaks in the escaped forms only."""
    forms = {text}
    for ascii_only in (True, False):
        once = json.dumps(text, ensure_ascii=ascii_only)[1:-1]
        forms.update((once, json.dumps(once, ensure_ascii=ascii_only)[1:-1]))
    forms.add(repr(text)[1:-1])
    forms.add(text.encode("unicode_escape").decode("ascii"))
    return forms


class Redactor:
    """Replaces known secret values in strings and nested JSON-like data."""

    def __init__(self, values: Iterable[str] = ()) -> None:
        self._values: set[str] = set()
        self._pattern: re.Pattern[str] | None = None
        for v in values:
            self.add(v)

    def add(self, value: Any) -> None:
        """Register a secret value (strings; nested lists/dicts register every string leaf)."""
        if isinstance(value, Mapping):
            for v in value.values():
                self.add(v)
        elif isinstance(value, list | tuple):
            for v in value:
                self.add(v)
        elif isinstance(value, str | int | float) and not isinstance(value, bool):
            text = str(value)
            if len(text) >= MIN_SCRUB_LENGTH and text not in self._values:
                self._values.update(written_forms(text))
                # Longest first so a secret containing another is replaced whole.
                alternatives = sorted(self._values, key=len, reverse=True)
                self._pattern = re.compile("|".join(re.escape(a) for a in alternatives))

    def add_secret_named(self, mapping: Mapping[str, Any]) -> None:
        """Register the values of every secret-named key of ``mapping`` (recursively)."""
        for key, value in mapping.items():
            if is_secret_name(str(key)):
                self.add(value)
            elif isinstance(value, str) and holds_url_password(value):
                self.add(value)  # the whole URL, and its password wherever it appears alone
                for match in URL_PASSWORD_RE.finditer(value):
                    self.add(match.group("password"))
            elif isinstance(value, Mapping):
                self.add_secret_named(value)
            elif isinstance(value, list):
                for item in value:
                    if isinstance(item, Mapping):
                        self.add_secret_named(item)

    def __bool__(self) -> bool:
        return bool(self._values)

    def text(self, value: str) -> str:
        """``value`` with every known secret replaced."""
        if self._pattern is None or not value:
            return value
        return self._pattern.sub(REDACTED, value)

    def scrub(self, value: Any) -> Any:
        """A copy of JSON-like data with every known secret replaced (keys too)."""
        if self._pattern is None:
            return value
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {self.text(k) if isinstance(k, str) else k: self.scrub(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.scrub(v) for v in value]
        return value

    def scrub_in_place(self, data: dict) -> None:
        """Scrub a dict in place (the runner writes the very dict its event handler received)."""
        if self._pattern is None:
            return
        cleaned = self.scrub(data)
        data.clear()
        data.update(cleaned)
