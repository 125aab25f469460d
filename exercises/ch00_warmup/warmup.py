"""Exercise 0 — warm-up: RMSNorm and rotary position embeddings (RoPE).

Chapter 0, section 0.5 "Inside the model", shows both pieces at work in SmolLM2's forward pass.
Replace each `raise NotImplementedError(...)` with your code, then run `make grade CH=00`.
Use plain PyTorch; do not import minillm (that is what you are rebuilding).
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize x over its last dimension to unit root-mean-square, then scale by weight.

    y = x / sqrt(mean(x**2, last dim) + eps) * weight, for x of any shape [..., hidden] and weight [hidden].
    Compute the normalization in float32 whatever x's dtype (bf16/fp16 lose too much precision, and fp16
    overflows when squaring), cast the normalized x back to x's dtype, then multiply by weight.
    """
    raise NotImplementedError("rms_norm: write this function")


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """The rotation frequency of each of the head_dim // 2 dimension pairs: theta ** (-2i / head_dim).

    Returns a float32 tensor of shape [head_dim // 2], for i = 0, 1, ..., head_dim // 2 - 1
    (the first pair turns fastest, at 1 radian per position).
    """
    raise NotImplementedError("rope_inv_freq: write this function")


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each float32 of shape [max_positions, head_dim], head_dim = 2 * len(inv_freq).

    The angle of position p in column j is p * inv_freq[j % (head_dim // 2)]: the frequencies are used
    twice, once for the first half of the columns and again for the second half (the "half-split" layout
    of Hugging Face Llama, not interleaved pairs).
    """
    raise NotImplementedError("rope_cos_sin: write this function")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] by each token's angles; cos and sin are [tokens, head_dim].

    Dimension j of the first half pairs with dimension j + head_dim // 2 of the second half:
    with x1, x2 the two halves, the result is x * cos + cat(-x2, x1) * sin (cos and sin shared by all heads).
    Keep x's dtype and shape.
    """
    raise NotImplementedError("apply_rope: write this function")
