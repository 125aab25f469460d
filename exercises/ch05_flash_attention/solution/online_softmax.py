"""A solution to exercise 5 written from the stub's signatures and docstrings alone, never from minillm.

`python -m exercises.selfcheck` grades it: full marks prove that the stub says everything the grader checks,
the tiling tests included (one pass over the key blocks, in order, with the running state updated in place).
It lives in its own folder so that the stub finder sees one student file.
"""

from __future__ import annotations

import torch


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [n, d] over one block of keys k [m, d] and values v [m, d], in float32: (o, lse)."""
    s = scale * (q.float() @ k.float().T)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    probs = torch.exp(s - lse[:, None]).nan_to_num(0.0)  # a row seeing no key: -inf - -inf = NaN -> 0
    return probs @ v.float(), lse


def merge_partials(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
                   lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partials over disjoint key sets into the partial over their union: (o [n, d], lse [n])."""
    top = torch.maximum(lse1, lse2)
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)  # both empty: shift by 0
    w1, w2 = torch.exp(lse1 - top), torch.exp(lse2 - top)
    total = w1 + w2
    o = (w1[:, None] * o1 + w2[:, None] * o2) / total.clamp_min(torch.finfo(total.dtype).tiny)[:, None]
    return o, top + torch.log(total)


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_n: int = 16, causal: bool = False,
                    scale: float | None = None) -> torch.Tensor:
    """Single-head attention q [n, d], k, v [m, d] -> [n, d] in q's dtype, visiting the keys block_n at a time."""
    n, m_keys = q.shape[0], k.shape[0]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q_scaled = q.float() * scale  # then q_scaled @ k_block.T are the scaled scores
    run_max = torch.full((n,), float("-inf"))
    run_sum = torch.zeros(n)
    acc = torch.zeros(n, v.shape[-1])
    last_key = torch.arange(n) + (m_keys - n)  # the last key each query may see when causal
    for start in range(0, m_keys, block_n):
        stop = min(start + block_n, m_keys)
        s = q_scaled @ k[start:stop].float().T
        if causal:
            s.masked_fill_(torch.arange(start, stop)[None, :] > last_key[:, None], float("-inf"))
        new_max = torch.maximum(run_max, s.max(dim=-1).values)
        shift = torch.where(torch.isneginf(new_max), torch.zeros_like(new_max), new_max)
        alpha = torch.exp(run_max - shift)
        p = torch.exp(s - shift[:, None])
        run_sum.mul_(alpha).add_(p.sum(dim=-1))
        acc.mul_(alpha[:, None]).add_(p @ v[start:stop].float())
        run_max = new_max
    return (acc / run_sum.clamp_min(torch.finfo(run_sum.dtype).tiny)[:, None]).to(q.dtype)
