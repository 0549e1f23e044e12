"""Syntax of the identifiers that appear in every format: digests, image refs, revisions, ids.

Malformed values are refused here, before any path is built from them.
"""

from __future__ import annotations

import re

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError

SHA256_HEX = r"[0-9a-f]{64}"
DIGEST = r"sha256:" + SHA256_HEX
ID = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
HOSTNAME = r"[A-Za-z0-9_][A-Za-z0-9._:-]{0,252}"
# A docker reference name (registry/repo path, optional tag) followed by an immutable digest.
IMAGE_NAME = (r"(?:[a-z0-9]+(?:[._-][a-z0-9]+)*(?::[0-9]+)?/)?[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
              r"(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?")
IMAGE_REF = IMAGE_NAME + "@" + DIGEST
REPOSITORY = r"(?:[a-z0-9]+(?:[._-][a-z0-9]+)*(?::[0-9]+)?/)?[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
# An immutable revision: a git commit id (SHA-1, 40 hex) or a SHA-256 object id (64 hex).
COMMIT = r"[0-9a-f]{40}|[0-9a-f]{64}"
ABS_PATH = r"/(?:[^\x00]*)"
MODEL_ID = r"[A-Za-z0-9][A-Za-z0-9._-]*(?:/[A-Za-z0-9][A-Za-z0-9._-]*)?"

IMAGE_REF_FIX = "pin the image by digest, e.g. 'registry/name@sha256:<64 hex>' (tags like ':latest' are mutable)"
COMMIT_FIX = "use the immutable 40-hex commit id of the revision (branch and tag names are mutable)"


def check_id(value: object, *, what: str) -> str:
    """``value`` when it is an id (``ID``: a request id, a capture id, a unit id), else ColdSnapError naming
    ``what``: ids name directories of the state root, so ``../x`` never is one."""
    if not isinstance(value, str) or not re.fullmatch(ID, value):
        raise ColdSnapError(f"{what} {value!r} is not an id",
                            fix="use letters, digits, '.', '_' and '-' (start with a letter or digit, at most 128)")
    return value


def parse_digest(value: object, *, what: str = "digest") -> str:
    """Return the 64-hex part of ``sha256:<hex>``; refuse anything else before it reaches a path."""
    if not isinstance(value, str):
        raise ColdSnapError(f"{what} must be a string 'sha256:<64 lower-case hex>', got {type(value).__name__}")
    algo, sep, hexpart = value.partition(":")
    if not sep:
        raise ColdSnapError(f"{what} {value!r} has no algorithm prefix", fix="write it as 'sha256:<64 lower-case hex>'")
    if algo != "sha256":
        raise ColdSnapError(f"{what} {value!r} uses unknown algorithm {algo!r}", fix="ColdSnap accepts only sha256 digests")
    if not re.fullmatch(SHA256_HEX, hexpart):
        if re.fullmatch(r"[0-9a-fA-F]{64}", hexpart):
            raise ColdSnapError(f"{what} {value!r} is not lower-case", fix="write the hex digits in lower case")
        raise ColdSnapError(f"{what} {value!r} is not 64 hex digits", fix="give the full SHA-256 as 'sha256:<64 lower-case hex>'")
    return hexpart


def is_digest(value: object) -> bool:
    """True when ``value`` is a well-formed ``sha256:<hex>`` digest."""
    return isinstance(value, str) and re.fullmatch(DIGEST, value) is not None


def split_image_ref(ref: str) -> tuple[str, str]:
    """``name[:tag]@sha256:hex`` -> (name without tag, digest)."""
    if not re.fullmatch(IMAGE_REF, ref):
        raise ColdSnapError(f"image reference {ref!r} is not digest-pinned", fix=IMAGE_REF_FIX)
    name, _sep, digest = ref.partition("@")
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name = name[: len(name) - len(last)] + last.split(":", 1)[0]
    return name, digest
