"""Where the recovery provider reads the pinned safetensors on a restore host.

``launch.model.source.kind``:

* ``local-safetensors``: the directory ``source.path``, as it is;
* ``huggingface``: the pinned commit (``launch.model.revision``) of ``source.repository``,
  safetensors and JSON (config, tokenizer) only, through ``huggingface_hub.snapshot_download``
  into ``source.cache_dir`` (the library's default cache when unset). Prepare downloads it
  (unless the weights mode never contacts the Hub: ``cache-only-auto`` uses the cache alone);
  activation only looks it up in the cache, so nothing is downloaded after eviction.

The files, their sizes and safetensors headers are then checked against the capture's pins
(:func:`check_recovery_source`) before anything is evicted.
"""

from __future__ import annotations

from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.manifest import load_replay_plan
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.safetensors import SafetensorsFile

HUB_PATTERNS = ("*.safetensors", "*.json")


def mount_root(request: dict) -> str | None:
    """The directory a container needs mounted for recovery (the model directory, or the Hub cache)."""
    src = request["launch"]["model"]["source"]
    if src["kind"] == "local-safetensors":
        return src["path"]
    if src.get("cache_dir"):
        return src["cache_dir"]
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    return str(constants.HF_HUB_CACHE)


def recovery_dir(request: dict, *, contact_hub: bool, token: str | None = None) -> Path:
    """The directory holding the pinned safetensors on this host (downloading them when allowed)."""
    model = request["launch"]["model"]
    src = model["source"]
    if src["kind"] == "local-safetensors":
        return Path(src["path"])
    repo, revision, cache_dir = src["repository"], model["revision"], src.get("cache_dir")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import disable_progress_bars
    except ImportError:
        raise ColdSnapError("recovery from Hugging Face needs the huggingface_hub library on this host",
                            fix="pip install huggingface_hub, or use a local-safetensors model source") from None
    disable_progress_bars()  # module stdout must stay JSON
    where = f"{repo}@{revision}" + (f" (cache {cache_dir})" if cache_dir else "")
    try:
        path = snapshot_download(repo_id=repo, revision=revision, cache_dir=cache_dir,
                                 allow_patterns=list(HUB_PATTERNS), token=token or None,
                                 local_files_only=not contact_hub)
    except Exception as exc:  # the library raises many types; all mean "not available"
        msg = f"{type(exc).__name__}: {exc}"
        if token:
            msg = msg.replace(token, "********")
        if not contact_hub:
            raise ColdSnapError(f"the pinned safetensors {where} are not in the Hugging Face cache, and this weights "
                                f"mode never contacts the Hub: {msg.splitlines()[0]}",
                                fix="download the pinned revision into source.cache_dir first "
                                    "(huggingface-cli download --revision), or restore with weights mode auto") from None
        raise ColdSnapError(f"could not download the pinned safetensors {where}: {msg.splitlines()[0]}",
                            fix="check the repository, the token (coldsnap_hf_token) and HF_ENDPOINT, or stage "
                                "the native payload") from None
    return Path(path)


def check_pin(st, pin: dict) -> None:
    """A checkpoint file against what the capture pinned (size, safetensors header digest)."""
    if pin.get("size") is not None and st.size != pin["size"]:
        raise IntegrityError(f"checkpoint file {st.path} has {st.size} bytes, the capture pinned {pin['size']}",
                             fix="download the pinned model revision")
    if pin.get("header_sha256") is not None and st.header_sha256 != pin["header_sha256"]:
        raise IntegrityError(f"checkpoint file {st.path} has a different safetensors header than the capture",
                             fix="download the pinned model revision")


def check_recovery_source(replay_plan_path: Path, safetensors_dir: Path) -> None:
    """Every checkpoint file the replay plan reads is present and matches its pins (prepare runs this
    before anything is evicted; hydration checks the same again on the files it opens)."""
    plan = load_replay_plan(replay_plan_path)
    for name, pin in sorted(plan.files.items()):
        st = SafetensorsFile(Path(safetensors_dir) / name)
        try:
            check_pin(st, pin)
        finally:
            st.close()
