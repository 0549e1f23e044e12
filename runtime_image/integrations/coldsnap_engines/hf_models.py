"""Hugging Face-format Llama checkpoints made offline, for vLLM and SGLang tests and benchmarks.

``python -m coldsnap_engines.hf_models --out DIR [--preset tiny|1g] [--seed N]`` writes what
``from_pretrained`` and the engines read: ``config.json``, ``generation_config.json``, a
byte-level BPE tokenizer trained on the spot (``tokenizer.json``, its config, a chat template)
and random but deterministic weights as safetensors (sharded with an index above 2 GiB).
The same preset and seed always give the same bytes; the revision (a 40-hex id derived from
the recipe, like a Hub commit) is recorded in ``coldsnap-model.json`` with the model id, so a
request can pin it.

Needs ``torch``, ``safetensors``, ``tokenizers`` and ``transformers`` (an engine environment
has them all).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

IDENTITY_FILE = "coldsnap-model.json"
GENERATOR = 1
SHARD_BYTES = 2 << 30
PRESETS = {
    # ~10 MB of bf16 weights, 4 layers: fast to start and serve on two cores (CI).
    "tiny": {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 4096},
    # ~1.1 GB of bf16 weights (556 M parameters): the benchmarks' model.
    "1g": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 9, "num_attention_heads": 16,
           "num_key_value_heads": 8, "vocab_size": 32000},
}
TOKENIZER_VOCAB = 4096
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
SPECIAL = [BOS, EOS, PAD, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
WORDS = ("the of and to in is that for it as was with be by on not this are or from at which but have an they "
         "you were one all we can their has there if more when will would who so no model server snapshot restore "
         "memory process thread socket engine token cache weight layer attention python import def return class "
         "self value list dict true false none hello world question answer time year people way day").split()


def revision(preset: str, seed: int) -> str:
    """The immutable 40-hex revision of a generated checkpoint."""
    recipe = json.dumps({"preset": PRESETS[preset], "seed": seed, "generator": GENERATOR,
                         "tokenizer_vocab": TOKENIZER_VOCAB}, sort_keys=True)
    return hashlib.sha1(recipe.encode()).hexdigest()


def _corpus(lines: int = 4000):
    """A deterministic synthetic corpus (words, numbers, punctuation, a little code)."""
    state = 12345
    for i in range(lines):
        words = []
        for _j in range(8 + i % 13):
            state = (1103515245 * state + 12345) & 0x7FFFFFFF
            w = WORDS[state % len(WORDS)]
            words.append(w.capitalize() if state % 7 == 0 else w)
        yield " ".join(words) + [". ", ", ", "; ", "? ", "! ", " = ", "(", ")"][i % 8] + str(i) + "\n"


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(_corpus()), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, tok.token_to_id(BOS))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=2048)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _tensors(c: dict):
    """(name, shape, init) of every weight of a Llama with config ``c``, in a fixed order."""
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    kv = c["num_key_value_heads"] * (h // c["num_attention_heads"])
    yield "model.embed_tokens.weight", (c["vocab_size"], h), "normal"
    for n in range(layers):
        p = f"model.layers.{n}."
        yield p + "input_layernorm.weight", (h,), "ones"
        yield p + "self_attn.q_proj.weight", (h, h), "normal"
        yield p + "self_attn.k_proj.weight", (kv, h), "normal"
        yield p + "self_attn.v_proj.weight", (kv, h), "normal"
        yield p + "self_attn.o_proj.weight", (h, h), "normal"
        yield p + "post_attention_layernorm.weight", (h,), "ones"
        yield p + "mlp.gate_proj.weight", (inter, h), "normal"
        yield p + "mlp.up_proj.weight", (inter, h), "normal"
        yield p + "mlp.down_proj.weight", (h, inter), "normal"
    yield "model.norm.weight", (h,), "ones"
    yield "lm_head.weight", (c["vocab_size"], h), "normal"


def make_checkpoint(out: Path | str, *, preset: str = "tiny", seed: int = 0, model_id: str | None = None) -> dict:
    """Write the checkpoint (idempotent: a complete one of the same revision is kept); its identity."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig

    out = Path(out)
    rev = revision(preset, seed)
    ident_path = out / IDENTITY_FILE
    if ident_path.exists():
        ident = json.loads(ident_path.read_text())
        if ident.get("revision") == rev and all((out / f).exists() for f in ident.get("files", [])):
            return ident
    out.mkdir(parents=True, exist_ok=True)
    c = PRESETS[preset]
    tok = _tokenizer()
    tok.save_pretrained(out)
    cfg = LlamaConfig(**c, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, dtype="bfloat16")
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(out)
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id).save_pretrained(out)
    gen = torch.Generator().manual_seed(seed)
    shards: list[dict] = [{}]
    size = total = 0
    for name, shape, init in _tensors(c):
        t = (torch.ones(shape, dtype=torch.bfloat16) if init == "ones"
             else (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16))
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
        total += nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)])
    for fname, shard in zip(names, shards, strict=True):
        tmp = out / f".{fname}.tmp"
        save_file(shard, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out / fname)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {n: f for f, sh in zip(names, shards, strict=True)
                                                                   for n in sh}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    ident = {"id": model_id or f"coldsnap/llama-{preset}", "revision": rev, "preset": preset, "seed": seed,
             "files": names, "bytes": total, "architecture": "LlamaForCausalLM"}
    tmp = out / f".{IDENTITY_FILE}.tmp"
    tmp.write_text(json.dumps(ident, indent=2) + "\n")
    os.replace(tmp, ident_path)
    return ident


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coldsnap_engines.hf_models", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-id", default=None)
    a = p.parse_args(argv)
    print(json.dumps(make_checkpoint(a.out, preset=a.preset, seed=a.seed, model_id=a.model_id), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
