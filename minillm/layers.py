"""The small building blocks of a Llama-family block: RMSNorm, rotary embeddings, SwiGLU, linear layers.

Every linear layer of the model is made by `make_linear`, so later chapters (quantization, tensor
parallelism) change one function rather than the model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 like the reference implementation."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:  # one fused op, same arithmetic
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm: rescales each vector to unit RMS, then by a learned gain."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Per-pair rotation frequencies theta^(-2i/d), optionally rescaled ("linear" or Llama 3's "llama3")."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"rope scaling {kind!r} is not supported; supported: default, linear, llama3")


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape [max_positions, head_dim] (each frequency used for both halves)."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] by its positions' angles (half-split layout, as in HF Llama).

    cos and sin are `[tokens, head_dim]`, or already `[tokens, 1, head_dim]` to broadcast over heads.
    """
    if cos.dim() == x.dim() - 1:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k from precomputed cos/sin tables indexed by token position."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.theta, self.max_positions, self.scaling = head_dim, theta, max_positions, scaling
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        self.build_tables()

    def build_tables(self) -> None:
        """(Re)compute the cos/sin tables in float32 on the buffers' device (also after `to_empty`)."""
        if self.cos.is_meta:
            return
        cos, sin = rope_cos_sin(rope_inv_freq(self.head_dim, self.theta, self.scaling), self.max_positions)
        self.cos, self.sin = cos.to(self.cos.device), sin.to(self.sin.device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The angles of the given positions, `[tokens, 1, head_dim]`, looked up once per step for every layer."""
        return self.cos[positions, None].to(dtype), self.sin[positions, None].to(dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions, q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: silu(gate) * up, with gate and up stacked in the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def make_linear(in_features: int, out_features: int, bias: bool = False) -> nn.Module:
    """The one place the model gets its linear layers from."""
    return nn.Linear(in_features, out_features, bias=bias)
