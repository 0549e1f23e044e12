"""Weight provider selection, as the seeds define the four modes.

* ``auto``: a verified native pack if one can be had, else the pinned safetensors (recovery);
* ``native``: the pack or fail;
* ``recovery``: always the safetensors;
* ``cache-only-auto``: like auto, but the pack is looked for in the node cache
  (and local sources) only; the Hugging Face Hub is never contacted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import PackRef
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.streams import Progress
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import (
    PayloadVerifier,
    VerifiedPayload,
)

WEIGHT_MODES = ("auto", "native", "recovery", "cache-only-auto")
NATIVE = "native"
RECOVERY = "recovery"


def may_contact_hub(mode: str) -> bool:
    """Whether a mode may download the optional pack from the Hugging Face Hub."""
    _check_mode(mode)
    return mode in ("auto", "native")


def _check_mode(mode: str) -> None:
    if mode not in WEIGHT_MODES:
        raise ColdSnapError(f"weights mode {mode!r} is not one of {', '.join(WEIGHT_MODES)}",
                            fix="set policy.weights.mode to auto, native, recovery or cache-only-auto")


def select_provider(mode: str, *, pack_available: bool, recovery_enabled: bool, pack_defined: bool = True,
                    reasons: Sequence[str] = ()) -> str:
    """``"native"`` or ``"recovery"`` for ``mode``; raise with a clear message when neither is possible.

    ``pack_defined``: the artifact references a native payload for this worker.
    ``pack_available``: that payload is staged and verified on the owning host.
    ``reasons``: why it is not available (joined into the error).
    """
    _check_mode(mode)
    why = f" ({'; '.join(reasons)})" if reasons else ""
    if mode == "recovery":
        if not recovery_enabled:
            raise ColdSnapError("weights mode 'recovery' was requested but the recovery provider is disabled",
                                fix="enable policy.weights.recovery.enabled or use mode 'native'")
        return RECOVERY
    if mode == "native":
        if not pack_defined:
            raise ColdSnapError("weights mode 'native' needs a native model payload, but this capture has none "
                                "(export was off)", fix="recapture with policy.weights.native.export or use 'auto'")
        if not pack_available:
            raise ColdSnapError(f"weights mode 'native': the model payload is not available and verified{why}",
                                fix="stage it (coldsnap.fleet.payload_stage) or use mode 'auto' to fall back to "
                                    "the pinned safetensors")
        return NATIVE
    if pack_defined and pack_available:
        return NATIVE
    if recovery_enabled:
        return RECOVERY
    raise ColdSnapError(f"weights mode {mode!r}: no native payload is available{why} and recovery is disabled",
                        fix="stage the payload, or enable policy.weights.recovery.enabled")


def source_failure(where: str, exc: ColdSnapError) -> str:
    """One source's failure among several: what went wrong there and its own fix (a peer's token, a
    path, a revision: the way out differs by source, and one generic fix would hide it)."""
    problem = exc.problem if exc.problem.startswith(where) else f"{where}: {exc.problem}"
    return f"{problem} (fix: {exc.fix})" if exc.fix else problem


@dataclass
class ProviderResolution:
    """The chosen provider and, for native, the verified payload (held open)."""

    provider: str
    payload: VerifiedPayload | None
    reasons: tuple[str, ...]

    def close(self) -> None:
        if self.payload is not None:
            self.payload.close()


def resolve_provider(mode: str, *, state_root: Path | str, pack: PackRef | None, recovery_enabled: bool,
                     sources: Sequence = (), progress: Progress | None = None,
                     write_record: bool = True) -> ProviderResolution:
    """Look for the pack as the mode allows (cache, then ``sources`` in order) and select the provider.

    ``sources`` are :class:`~.stage.StageSource`; Hugging Face sources are
    skipped in ``cache-only-auto``, and nothing is looked up in ``recovery``.
    ``write_record=False`` (check mode) verifies the cached pack read-only: no lock
    file, no validation record, no quarantine.
    """
    _check_mode(mode)
    reasons: list[str] = []
    payload: VerifiedPayload | None = None
    if mode != "recovery" and pack is not None:
        cache = NodeCache(state_root)
        if cache.contains(pack.sha256):
            try:
                payload = PayloadVerifier().verify(cache, pack.sha256, pack.size, progress=progress,
                                                   write_record=write_record)
            except ColdSnapError as exc:
                reasons.append(f"cached copy refused: {exc.problem}")
        else:
            reasons.append(cache.absence_reason(pack.sha256))
        for src in sources if payload is None else ():
            if src.kind == "huggingface" and not may_contact_hub(mode):
                reasons.append(f"{src.describe()} skipped: {mode} never contacts the Hub")
                continue
            try:
                src.stage(state_root, pack.sha256, pack.size, progress=progress)
                payload = PayloadVerifier().verify(cache, pack.sha256, pack.size)
                break
            except ColdSnapError as exc:
                reasons.append(source_failure(src.describe(), exc))
    elif pack is None and mode != "recovery":
        reasons.append("the capture has no native payload")
    try:
        provider = select_provider(mode, pack_available=payload is not None, recovery_enabled=recovery_enabled,
                                   pack_defined=pack is not None, reasons=reasons)
    except ColdSnapError:
        if payload is not None:
            payload.close()
        raise
    if provider == RECOVERY and payload is not None:
        payload.close()
        payload = None
    return ProviderResolution(provider, payload, tuple(reasons))
