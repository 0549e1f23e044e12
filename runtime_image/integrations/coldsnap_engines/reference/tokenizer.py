"""Byte-level tokenizer: UTF-8 bytes are ids 0..255, so no tokenizer download exists."""

from __future__ import annotations

from coldsnap_engines.reference.config import BOS_ID, VOCAB_SIZE

# Greedy decoding emits only printable ASCII, so replies are valid text and stable.
PRINTABLE_IDS = tuple(range(32, 127))


def encode(text: str) -> list[int]:
    """BOS followed by the UTF-8 bytes of ``text``."""
    return [BOS_ID, *text.encode("utf-8")]


def decode(ids: list[int]) -> str:
    """Text of generated ids (specials dropped)."""
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def blocked_ids() -> list[int]:
    """Ids the sampler never emits (non-printable bytes and specials)."""
    allowed = set(PRINTABLE_IDS)
    return [i for i in range(VOCAB_SIZE) if i not in allowed]
