"""Model configuration and size presets of the reference engine."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

# Byte-level vocabulary: ids 0..255 are bytes; 256 BOS, 257 EOS; padded to a multiple of 16.
BOS_ID = 256
EOS_ID = 257
VOCAB_SIZE = 272

CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab_size: int = VOCAB_SIZE
    max_seq: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dtype: str = "float32"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def validate(self, world_size: int = 1) -> None:
        """Refuse shapes the model or a tensor-parallel split cannot run."""
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} is not divisible by kv_heads {self.kv_heads}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype {self.dtype!r} is not float32, bfloat16 or float16")
        for name, value in (("heads", self.heads), ("kv_heads", self.kv_heads), ("intermediate", self.intermediate)):
            if value % world_size:
                raise ValueError(f"{name}={value} cannot be split over {world_size} tensor-parallel ranks")

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint tensor names and full (unsharded) shapes."""
        hd = self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"embed.weight": (self.vocab_size, self.hidden)}
        for i in range(self.layers):
            p = f"layers.{i}."
            shapes[p + "attn_norm.weight"] = (self.hidden,)
            shapes[p + "wq.weight"] = (self.heads * hd, self.hidden)
            shapes[p + "wk.weight"] = (self.kv_heads * hd, self.hidden)
            shapes[p + "wv.weight"] = (self.kv_heads * hd, self.hidden)
            shapes[p + "wo.weight"] = (self.hidden, self.heads * hd)
            shapes[p + "ffn_norm.weight"] = (self.hidden,)
            shapes[p + "w1.weight"] = (self.intermediate, self.hidden)
            shapes[p + "w3.weight"] = (self.intermediate, self.hidden)
            shapes[p + "w2.weight"] = (self.hidden, self.intermediate)
        shapes["norm.weight"] = (self.hidden,)
        shapes["lm_head.weight"] = (self.vocab_size, self.hidden)
        return shapes

    def param_count(self) -> int:
        total = 0
        for shape in self.tensor_shapes().values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    def bytes_per_param(self) -> int:
        return 4 if self.dtype == "float32" else 2

    def to_json(self) -> dict:
        return {"architecture": "coldsnap-reference-llama", **asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> ModelConfig:
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**fields)

    @classmethod
    def load(cls, model_dir: Path) -> ModelConfig:
        return cls.from_json(json.loads((Path(model_dir) / CONFIG_FILE).read_text()))


# Sizes: "tiny" for tests (a few MB), "small" ~100 MB, "1g" … "8g-bf16" for benchmarks.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=384),
    "small": ModelConfig(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1536),
    "1g": ModelConfig(hidden=1024, layers=22, heads=8, kv_heads=4, intermediate=2816),
    "1g-bf16": ModelConfig(hidden=2048, layers=11, heads=16, kv_heads=8, intermediate=5632, dtype="bfloat16"),
    "2g-bf16": ModelConfig(hidden=2048, layers=22, heads=16, kv_heads=8, intermediate=5632, dtype="bfloat16"),
    "4g-bf16": ModelConfig(hidden=3072, layers=22, heads=24, kv_heads=8, intermediate=8192, dtype="bfloat16"),
    "8g-bf16": ModelConfig(hidden=4096, layers=20, heads=32, kv_heads=8, intermediate=14336, dtype="bfloat16"),
}
