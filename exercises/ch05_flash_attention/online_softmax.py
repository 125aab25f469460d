"""Exercise 5 — the online softmax behind FlashAttention.

Replace each `raise NotImplementedError(...)` with your code, then run `make grade CH=05`.
Use plain PyTorch (or numpy, converting back to torch tensors); do not import minillm.

A *partial* is a pair (o, lse) that summarizes attention over some set of keys:
  o   = softmax-weighted average of those keys' values, one row per query      [n, d]
  lse = log(sum_j exp(s_j)) over those keys' scaled scores s_j = scale * q.k_j  [n]
"""

from __future__ import annotations

import torch


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [n, d] over one block of keys k [m, d] and values v [m, d], in float32.

    Returns (o [n, d], lse [n]) with s = scale * q @ k.T, lse = logsumexp(s) per row and
    o = softmax(s) @ v. `mask` [n, m] (True = visible), if given, hides keys: a hidden score counts as -inf.
    A row that sees no key at all has lse = -inf and o = 0 (not NaN).
    """
    raise NotImplementedError("partial_attention: write this function")


def merge_partials(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
                   lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partials over disjoint key sets into the partial over their union: (o [n, d], lse [n]).

    lse = log(exp(lse1) + exp(lse2)); o = the two o's weighted by exp(lse1 - lse) and exp(lse2 - lse).
    Must not overflow when lse is large (e.g. 1000) and must handle an empty partial (lse = -inf, o = 0):
    merging with it changes nothing; merging two empty ones gives an empty one (o = 0, lse = -inf).
    """
    raise NotImplementedError("merge_partials: write this function")


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_n: int = 16, causal: bool = False,
                    scale: float | None = None) -> torch.Tensor:
    """Single-head attention q [n, d], k, v [m, d] -> [n, d] in q's dtype, visiting the keys block_n at a time.

    Keep, per query row, a running max m, a running sum l of exp(s - m) and an unnormalized output acc.
    Visit the key blocks once each, in order (keys [0, block_n), then [block_n, 2 * block_n), ...), score
    each block against all n queries at once ([n, block_n]) and fold it into the state before the next;
    never build the whole [n, m] score matrix (nor anything as large); divide by l once at the end.
    scale defaults to d ** -0.5. causal: query i sees keys j <= i + (m - n) (aligned to the bottom right,
    as flash-attn does when n != m); a row that sees no key returns zeros. Write it with PyTorch operations:
    the grader watches them to check the tiling.
    """
    raise NotImplementedError("tiled_attention: write this function")
