"""The decoder: RMSNorm, rotary attention with grouped KV heads, SwiGLU MLP.

Weights are plain tensors that alias stable arenas (see arena.py), so the model
never owns weight memory. Tensor parallelism splits attention heads and the MLP's
intermediate dimension (column-parallel in, row-parallel out + all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from coldsnap_engines.reference.config import ModelConfig

COLUMN = ("wq", "wk", "wv", "w1", "w3")  # split the output dim (checkpoint dim 0)
ROW = ("wo", "w2")  # split the input dim (checkpoint dim 1)


def shard_slice(name: str, full_shape: tuple[int, ...], rank: int, world: int) -> tuple[int, int, int] | None:
    """(dim, start, stop) of the checkpoint tensor this rank holds; None when replicated."""
    if world == 1:
        return None
    leaf = name.split(".")[-2] if name.endswith(".weight") else name
    if leaf in COLUMN:
        dim = 0
    elif leaf in ROW:
        dim = 1
    else:
        return None
    size = full_shape[dim] // world
    return (dim, rank * size, (rank + 1) * size)


def local_shape(full_shape: tuple[int, ...], sl: tuple[int, int, int] | None) -> tuple[int, ...]:
    if sl is None:
        return tuple(full_shape)
    dim, start, stop = sl
    shape = list(full_shape)
    shape[dim] = stop - start
    return tuple(shape)


@dataclass
class KVCache:
    k: torch.Tensor  # [layers, max_seq, kv_heads_local, head_dim]
    v: torch.Tensor


class Decoder:
    """Forward pass over weights held elsewhere; all_reduce is injected for TP."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
                 *, world: int = 1, all_reduce=None) -> None:
        self.c = config
        self.w = weights
        self.cos, self.sin = rope
        self.world = world
        self.all_reduce = all_reduce
        self.heads = config.heads // world
        self.kv_heads = config.kv_heads // world
        self.hd = config.head_dim
        self.dtype = getattr(torch, config.dtype)
        self.qkv, self.mlp = self._qkv, self._mlp  # replaced by compiled graphs in compile()
        self.compiled = False

    def new_kv(self, device: str) -> KVCache:
        shape = (self.c.layers, self.c.max_seq, self.kv_heads, self.hd)
        return KVCache(torch.zeros(shape, dtype=self.dtype, device=device),
                       torch.zeros(shape, dtype=self.dtype, device=device))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.c.norm_eps)
        return (xf * weight.float()).to(self.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, H, hd]; rotate pairs (even, odd); cos/sin: [T, 1, hd/2]
        xf = x.float().view(*x.shape[:-1], self.hd // 2, 2)
        a, b = xf[..., 0], xf[..., 1]
        out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
        return out.view_as(x.float()).to(self.dtype)

    # The two dense pieces of a layer, pure functions of tensors, so that one compiled graph
    # serves every layer (weights are arguments) and attention + all-reduce stay outside
    # (the split vLLM's piecewise compilation makes too).
    def _qkv(self, h, norm_w, proj, rope):
        (wq, wk, wv), (cos, sin) = proj, rope
        t = h.shape[0]
        x = self._norm(h, norm_w)
        q = (x @ wq.T).view(t, self.heads, self.hd)
        k = (x @ wk.T).view(t, self.kv_heads, self.hd)
        v = (x @ wv.T).view(t, self.kv_heads, self.hd)
        return self._rope(q, cos, sin), self._rope(k, cos, sin), v

    def _mlp(self, h, norm_w, w1, w3, w2):
        x = self._norm(h, norm_w)
        return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T

    def compile(self) -> None:
        """Compile the dense pieces with TorchInductor (shape-dynamic in the token count).

        The graphs are built on the first forward passes (the engine's warm-up): that is
        the start-up cost a production engine pays and a restored process does not.
        """
        self.qkv = torch.compile(self._qkv, dynamic=True)
        self.mlp = torch.compile(self._mlp, dynamic=True)
        self.compiled = True

    def decompile(self) -> int:
        """Drop the compiled graphs (back to eager; TorchDynamo's caches reset): the number of compiled
        functions dropped. :meth:`compile` builds them again on the next forward passes."""
        if not self.compiled:
            return 0
        self.qkv, self.mlp = self._qkv, self._mlp
        self.compiled = False
        torch._dynamo.reset()
        return 2

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            self.all_reduce(x)
        return x

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: int, kv: KVCache) -> torch.Tensor:
        """Logits of the last position for ``tokens`` placed at positions start.."""
        w = self.w
        t = tokens.shape[0]
        pos = slice(start, start + t)
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)
        if self.compiled:  # copies, not views: a graph would guard on the views' storage offsets
            cos, sin = cos.clone(), sin.clone()
        h = w["embed.weight"][tokens]
        rep = self.heads // self.kv_heads
        # causal within the new block, full over the prefix
        mask = torch.ones(t, start + t, dtype=torch.bool, device=h.device).tril(diagonal=start)
        for i in range(self.c.layers):
            p = f"layers.{i}."
            proj = (w[p + "wq.weight"], w[p + "wk.weight"], w[p + "wv.weight"])
            q, k, v = self.qkv(h, w[p + "attn_norm.weight"], proj, (cos, sin))
            kv.k[i, pos] = k
            kv.v[i, pos] = v
            keys = kv.k[i, : start + t]
            vals = kv.v[i, : start + t]
            if rep > 1:
                keys = keys.repeat_interleave(rep, dim=1)
                vals = vals.repeat_interleave(rep, dim=1)
            # [H, T, hd] x [H, S, hd]
            attn = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1),
                                                  attn_mask=mask)
            o = attn.transpose(0, 1).reshape(t, self.heads * self.hd) @ w[p + "wo.weight"].T
            h = h + self._reduce(o)
            h = h + self._reduce(self.mlp(h, w[p + "ffn_norm.weight"], w[p + "w1.weight"], w[p + "w3.weight"],
                                          w[p + "w2.weight"]))
        h = self._norm(h[-1:], w["norm.weight"])
        return (h @ w["lm_head.weight"].T).float()[0]


def rope_tables(config: ModelConfig, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_seq, head_dim/2] (derived bytes: part of the residual, not the model)."""
    half = config.head_dim // 2
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, half, dtype=torch.float64) / half))
    ang = torch.outer(torch.arange(config.max_seq, dtype=torch.float64), inv)
    return ang.cos().float().to(device), ang.sin().float().to(device)
