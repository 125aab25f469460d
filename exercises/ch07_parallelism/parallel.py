"""Exercise 7 — parallelism: Megatron's split of an MLP over ranks, and the dispatch and combine of expert
parallelism.

Replace each `raise NotImplementedError(...)` with your code, then run `make grade CH=07`.
Use plain PyTorch; do not import minillm.parallel.tensor_parallel, minillm.moe or minillm.layers (that is what
you are rebuilding). `Comm` is given: the grader runs your `parallel_mlp` on 2 and 3 processes, each with its
own `comm`, whose
  comm.rank, comm.world_size   are this process's rank (0 .. P - 1) and the number of ranks P,
  comm.all_reduce(t)           sums t over the ranks, in place, and returns it (the same shape on every rank),
and which counts each collective it runs in `comm.stats`. It runs your `sort_by_expert` and `combine` inside
minillm's expert-parallel Mixture-of-Experts layer, on 2 and 3 processes, as the first and the last step of
its all-to-all exchange.

Weights are stored as torch.nn.functional.linear wants them: `[out, in]`, so that y = x @ w.T.
"""

from __future__ import annotations

import torch

from minillm.parallel.comm import Comm


def shard_column(w: torch.Tensor, rank: int, world_size: int, out_sizes: list[int] | None = None) -> torch.Tensor:
    """Rank `rank`'s rows of a full weight w `[out, in]`, for a column-parallel layer (output features split).

    Without out_sizes: the rank's contiguous block of out / world_size rows, rank 0 holding the first.
    A fused weight stacks several parts along its rows (gate|up, q|k|v) whose sizes out_sizes lists, in order;
    each part is split on its own and the rank's slices of the parts are concatenated in the same order. For
    gate|up with out_sizes = [inter, inter] that is the rank's rows of gate, then the same rows of up.
    out_sizes adds up to out. Returns a tensor of w's dtype, `[out / world_size, in]`. Raise ValueError when
    a part (or out, without out_sizes) does not split into world_size equal slices.
    """
    raise NotImplementedError("shard_column: write this function")


def shard_row(w: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s columns of a full weight w `[out, in]`, for a row-parallel layer (input features split):
    the contiguous block of in / world_size columns, rank 0 holding the first; `[out, in / world_size]` of
    w's dtype. Raise ValueError when world_size does not divide in."""
    raise NotImplementedError("shard_row: write this function")


def parallel_mlp(comm: Comm, x: torch.Tensor, gate_up_shard: torch.Tensor, down_shard: torch.Tensor) -> torch.Tensor:
    """A SwiGLU MLP, down(silu(gate(x)) * up(x)), computed by the P ranks of comm together.

    With the full weights gate, up `[inter, hidden]` and down `[hidden, inter]`, this rank holds
      gate_up_shard = shard_column(torch.cat([gate, up]), comm.rank, P, [inter, inter])  `[2 * inter / P, hidden]`
      down_shard    = shard_row(down, comm.rank, P)                                      `[hidden, inter / P]`
    and x `[..., hidden]` is the whole input, the same on every rank. Return the whole output `[..., hidden]`
    on every rank, equal to the one-process MLP. Communicate exactly once: one comm.all_reduce, of the
    row-parallel product; no other collective, and none through torch.distributed directly.
    """
    raise NotImplementedError("parallel_mlp: write this function")


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group a batch's (token, expert) pairs by expert: the first step of dispatching them to the experts' ranks.

    ids `[tokens, top_k]` (int64) holds each token's chosen experts, numbers in 0 .. num_experts - 1. Number the
    pairs row by row: pair p = t * top_k + j is token t's j-th choice (the order of ids.flatten()). Return
      order   `[tokens * top_k]` int64, the pair numbers sorted by their expert, lowest expert first, and pairs
              of the same expert kept in increasing pair number (a stable sort);
      counts  `[num_experts]` int64, how many pairs each expert got (0 for an expert nobody chose).
    The token of pair p is p // top_k, so x[order // top_k] are the tokens' rows grouped by expert. With the
    experts spread over P ranks in contiguous blocks (rank r holds experts r E/P .. (r + 1) E/P - 1), those rows
    are also grouped by rank, rank 0's first: counts.view(P, -1).sum(1) of them go to each rank, which is what
    an all-to-all needs. tokens may be 0 (a rank with no tokens this step): then order is empty and counts zero.
    """
    raise NotImplementedError("sort_by_expert: write this function")


def combine(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each token's routing-weighted sum of its experts' outputs: the last step, once the results are back.

    rows `[tokens * top_k, hidden]` are the experts' outputs in the order of `order` (rows[i] is the output for
    pair order[i], order as sort_by_expert returns it); weights `[tokens, top_k]` float32 are the routing weights,
    weights[t, j] for pair t * top_k + j. Return out `[tokens, hidden]` of `dtype` with
      out[t] = sum over j of weights[t, j] * (the row of pair t * top_k + j),
    the products taken in float32 (rows may be bfloat16) and the sum cast to dtype at the end. tokens may be 0:
    then out is `[0, hidden]`.
    """
    raise NotImplementedError("combine: write this function")
