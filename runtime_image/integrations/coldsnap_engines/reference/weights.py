"""Deterministic reference-model weights, saved as safetensors under a pinned id/revision.

The same preset and seed always give the same bytes, so the revision (a 40-hex
id derived from the bytes' recipe) is immutable, like a Hugging Face commit.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from coldsnap_engines.reference.config import CONFIG_FILE, ModelConfig

IDENTITY_FILE = "coldsnap-model.json"
SHARD_BYTES = 1 << 30


def model_revision(config: ModelConfig, seed: int) -> str:
    """40-hex immutable revision id of a generated model."""
    recipe = json.dumps({"config": config.to_json(), "seed": seed, "generator": 1}, sort_keys=True)
    return hashlib.sha1(recipe.encode()).hexdigest()


def make_model(out_dir: Path, config: ModelConfig, *, model_id: str, seed: int = 0) -> dict:
    """Write config.json, safetensors shards and the identity file; return the identity.

    Existing complete output with the same revision is kept (idempotent).
    """
    import torch
    from safetensors.torch import save_file

    config.validate()
    out_dir = Path(out_dir)
    revision = model_revision(config, seed)
    ident_path = out_dir / IDENTITY_FILE
    if ident_path.exists():
        ident = json.loads(ident_path.read_text())
        if ident.get("revision") == revision and all((out_dir / f).exists() for f in ident.get("files", [])):
            return ident
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, config.dtype)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, shape in config.tensor_shapes().items():
        gen = torch.Generator().manual_seed(seed * 1_000_003 + int(hashlib.sha256(name.encode()).hexdigest()[:12], 16))
        if name.endswith("norm.weight"):
            t = 1.0 + 0.05 * torch.randn(shape, generator=gen)
        else:
            fan_in = shape[-1]
            t = torch.randn(shape, generator=gen) * (1.0 / fan_in ** 0.5)
            if name == "embed.weight":
                t = t * fan_in ** 0.5 * 0.5
        t = t.to(dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if shard_bytes and shard_bytes + nbytes > SHARD_BYTES:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = t
        shard_bytes += nbytes
    files = []
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tmp = out_dir / f".{fname}.tmp"
        save_file(shard, str(tmp), metadata={"format": "pt"})
        os.chmod(tmp, 0o644)
        os.replace(tmp, out_dir / fname)
        files.append(fname)
    (out_dir / CONFIG_FILE).write_text(json.dumps(config.to_json(), indent=2) + "\n")
    ident = {"id": model_id, "revision": revision, "seed": seed, "files": files,
             "parameters": config.param_count(), "bytes": config.param_count() * config.bytes_per_param()}
    tmp = out_dir / f".{IDENTITY_FILE}.tmp"
    tmp.write_text(json.dumps(ident, indent=2) + "\n")
    os.replace(tmp, ident_path)
    return ident


def load_identity(model_dir: Path) -> dict:
    """The model's pinned identity {id, revision, files, ...}."""
    return json.loads((Path(model_dir) / IDENTITY_FILE).read_text())


def main(argv: list[str] | None = None) -> int:
    """``python -m coldsnap_engines.reference.weights --out DIR [--preset tiny]``: write a model and
    print its pinned identity (``id``, ``revision``) as JSON."""
    import argparse

    from coldsnap_engines.reference.config import PRESETS

    p = argparse.ArgumentParser(prog="python -m coldsnap_engines.reference.weights",
                                description="write a reference-engine model (random weights, pinned revision)")
    p.add_argument("--out", required=True)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-id", default=None, help="default coldsnap/reference-<preset>")
    a = p.parse_args(argv)
    ident = make_model(Path(a.out), PRESETS[a.preset], model_id=a.model_id or f"coldsnap/reference-{a.preset}",
                       seed=a.seed)
    print(json.dumps(ident, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
