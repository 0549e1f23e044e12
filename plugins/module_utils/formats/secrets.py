"""Which names carry credentials: one rule for the controller's redaction, the secret channel for
extra variables, and the request's refusal of secrets in a unit's environment.

Deliberately broad: treating a harmless value (e.g. ANSIBLE_HOST_KEY_CHECKING) as secret costs
nothing, missing a credential costs a leak.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

SECRET_NAME_RE = re.compile(
    r"TOKEN|PASSWORD|PASSWD|PASSPHRASE|SECRET|KEY|CREDENTIAL|PRIVATE|COOKIE|(?:^|_)PASS(?:$|_)|(?:^|_)AUTH(?:$|_)",
    re.IGNORECASE,
)
# Why a unit's environment may not hold one: the engine's environment is part of its memory, so a
# capture would write it into the CRIU pages, the capsule layer and every copy of them.
UNIT_SECRET_FIX = ("keep credentials out of launch.units[].environment: a process's environment is part of its "
                   "memory and so of its snapshot and capsule. Pass what ColdSnap itself needs with "
                   "'coldsnap ... --secret-env KEY=ENVVAR' or an AWX credential type (docs/awx.md), and give the "
                   "engine local model files (model.source local-safetensors) instead of a Hub token")


def is_secret_name(name: str) -> bool:
    """True when a variable called ``name`` must be treated as a credential (redaction: broad; every name
    :func:`is_credential_name` refuses, such as ``MYSQL_PWD`` or ``GITHUB_PAT``, is one too)."""
    return bool(SECRET_NAME_RE.search(name)) or is_credential_name(name)


# Refusing is stricter than redacting: a word of the name (split at '_') must name a credential,
# so HF_TOKEN, API_PASSWORD or AWS_SECRET_ACCESS_KEY are refused and TOKENIZERS_PARALLELISM is not.
CREDENTIAL_WORDS = frozenset({"TOKEN", "TOKENS", "PASSWORD", "PASSWD", "PASSPHRASE", "PASS", "SECRET", "SECRETS",
                              "KEY", "APIKEY", "CREDENTIAL", "CREDENTIALS", "PRIVATE", "COOKIE", "AUTH", "PAT"})


# Words that end a credential's name when glued to a prefix (PGPASSWORD, GHTOKEN), and the short form
# some clients read (MYSQL_PWD; ``PWD`` alone is the shell's working directory, not a secret).
_CREDENTIAL_ENDINGS = ("PASSWORD", "PASSWD", "PASSPHRASE", "TOKEN", "SECRET", "APIKEY")
# A URL that carries a password (``scheme://user:password@host``): a credential whatever the name.
URL_PASSWORD_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/\s@:]*:(?P<password>[^/\s@]+)@")


def is_credential_name(name: str) -> bool:
    """True when an environment variable called ``name`` names a credential."""
    words = name.upper().split("_")
    return (any(word in CREDENTIAL_WORDS or word.endswith(_CREDENTIAL_ENDINGS) for word in words)
            or (len(words) > 1 and "PWD" in words))


def holds_url_password(value: str) -> bool:
    """True when ``value`` holds a URL with a password in it (``https://user:pw@proxy``, a database URL)."""
    return bool(URL_PASSWORD_RE.search(value))


def without_credentials(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` less every variable named like a credential: the environment of a helper ColdSnap starts
    (the coordinator, the activation runtime and its keepers), which needs none of the controller's."""
    return {k: v for k, v in env.items() if not is_credential_name(k)}
