"""Exercise 7 — parallelism: Megatron's split of an MLP over ranks, and the merge step of ring attention.

Replace each `raise NotImplementedError(...)` with your code, then run `make grade CH=07`.
Use plain PyTorch; do not import minillm.parallel.tensor_parallel, minillm.kernels.online_softmax or
minillm.layers (that is what you are rebuilding). `Comm` is given: the grader runs your `parallel_mlp` on
2 and 3 processes, each with its own `comm`, whose
  comm.rank, comm.world_size   are this process's rank (0 .. P - 1) and the number of ranks P,
  comm.all_reduce(t)           sums t over the ranks, in place, and returns it (the same shape on every rank),
and which counts each collective it runs in `comm.stats`.

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


def merge_partials(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
                   lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key sets into the one over their union: (o, lse).

    A partial (o `[..., d]`, lse `[...]`) over some keys holds, per query, the softmax-weighted average o of
    those keys' values and the log-sum-exp lse = log(sum_j exp(s_j)) of their scaled scores s_j; the leading
    dimensions (heads, queries) are any, the same for both. Then lse = log(exp(lse1) + exp(lse2)) and o is
    o1 and o2 weighted by exp(lse1 - lse) and exp(lse2 - lse). Must not overflow when lse is large (e.g. 1000).
    A query that sees none of a partial's keys (a fully masked block) has lse = -inf and o = 0 there: merging
    it changes nothing, and two such merge into lse = -inf, o = 0, never NaN.
    """
    raise NotImplementedError("merge_partials: write this function")
