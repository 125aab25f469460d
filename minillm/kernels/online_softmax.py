"""Chapter 5 — the online softmax in plain PyTorch: attention over one block of keys, merging partial results,
tiled attention.

A partial result is a pair (o, lse): o the softmax-weighted average of the values it has seen, lse the
log-sum-exp of its scaled scores, `log(sum_j exp(s_j))`, with o `[..., d]` and lse `[...]`. Two partials over
disjoint sets of keys merge exactly into the partial over their union, so attention can visit the keys one
block at a time and never hold the whole row of scores: the idea behind FlashAttention, and behind the
split-K decode kernel, which merges its splits with `combine_partials`.
"""

from __future__ import annotations

import torch


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q `[n, d]` over one block of keys k, v `[m, d]`: (o `[n, d]`, lse `[n]`), in float32.

    `mask [n, m]` (True = visible) hides keys; a row that sees none gets o = 0 and lse = -inf.
    """
    s = (q.float() @ k.float().T) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[:, None]).nan_to_num(0.0)  # -inf - -inf = NaN on an empty row -> 0
    return p @ v.float(), lse


def combine_partials(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge S partials stacked on dim 0, o `[S, ..., d]` and lse `[S, ...]`, into one (o `[..., d]`, lse `[...]`).

    Each partial is weighted by its share of the total exponent mass, exp(lse_i - lse); subtracting the
    largest lse first keeps every exp() <= 1. Rows where every partial is empty stay o = 0, lse = -inf.
    """
    top = lse.amax(dim=0)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # all -inf: any finite shift will do
    weights = torch.exp(lse - top)  # [S, ...], exp(-inf) = 0 for empty partials
    total = weights.sum(dim=0)
    merged = (weights[..., None] * o).sum(dim=0) / total.clamp_min(torch.finfo(total.dtype).tiny)[..., None]
    return merged, top + torch.log(total)


def merge_partials(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
                   lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partials over disjoint key sets into the partial over both (the two-block case)."""
    return combine_partials(torch.stack([o1, o2]), torch.stack([lse1, lse2]))


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_n: int = 16, causal: bool = False,
                    scale: float | None = None) -> torch.Tensor:
    """Single-head attention q `[n, d]`, k, v `[m, d]` visiting the keys block_n at a time (the kernel's loop).

    Keeps per query row a running max `m`, a running sum `l` of exp(s - m) and an unnormalized output `acc`;
    each new block rescales them by exp(m_old - m_new), and one division at the end normalizes.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    n, m_keys = q.shape[0], k.shape[0]
    m = torch.full((n,), float("-inf"), device=q.device)
    l = torch.zeros(n, device=q.device)
    acc = torch.zeros(n, v.shape[-1], device=q.device)
    rows = torch.arange(n, device=q.device)[:, None] + (m_keys - n)  # bottom-right causal alignment, as flash-attn
    for start in range(0, m_keys, block_n):
        s = (q.float() @ k[start:start + block_n].float().T) * scale
        if causal:
            s = s.masked_fill(torch.arange(start, start + s.shape[1], device=q.device)[None, :] > rows, float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1))
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows that have seen no key yet
        alpha = torch.exp(m - safe)  # how much the old running sums shrink
        p = torch.exp(s - safe[:, None])
        l = l * alpha + p.sum(dim=-1)
        acc = acc * alpha[:, None] + p @ v[start:start + block_n].float()
        m = m_new
    return (acc / l.clamp_min(torch.finfo(l.dtype).tiny)[:, None]).to(q.dtype)
