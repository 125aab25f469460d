"""A solution to exercise 7 written from the stub's signatures and docstrings alone, never from minillm.

`python -m exercises.selfcheck` grades it: full marks prove that the stub says everything the grader checks.
It lives in its own folder so that the stub finder sees one student file.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minillm.parallel.comm import Comm


def _block(size: int, rank: int, world_size: int, what: str) -> slice:
    """Rank `rank`'s contiguous slice of `size` items split into `world_size` equal slices."""
    if size % world_size:
        raise ValueError(f"{what} of {size} cannot be split into {world_size} equal slices")
    n = size // world_size
    return slice(rank * n, (rank + 1) * n)


def shard_column(w: torch.Tensor, rank: int, world_size: int, out_sizes: list[int] | None = None) -> torch.Tensor:
    """The rank's rows of each part of w `[out, in]`, concatenated in order: `[out / world_size, in]`."""
    parts = w.split(out_sizes if out_sizes is not None else [w.shape[0]], dim=0)
    return torch.cat([part[_block(part.shape[0], rank, world_size, "a part")] for part in parts])


def shard_row(w: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """The rank's block of columns of w `[out, in]`: `[out, in / world_size]`."""
    return w[:, _block(w.shape[1], rank, world_size, "the input features")].clone()


def parallel_mlp(comm: Comm, x: torch.Tensor, gate_up_shard: torch.Tensor, down_shard: torch.Tensor) -> torch.Tensor:
    """SwiGLU on this rank's slice of the intermediate features, then one all-reduce of the partial products."""
    gate, up = F.linear(x, gate_up_shard).chunk(2, dim=-1)
    return comm.all_reduce(F.linear(F.silu(gate) * up, down_shard))


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pair numbers sorted (stably) by expert, and the number of pairs per expert."""
    experts = ids.reshape(-1)
    order = torch.sort(experts, stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.int64)
    counts.index_add_(0, experts, torch.ones_like(experts))
    return order, counts


def combine(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Put the rows back in pair order, weight each by its pair's routing weight and sum each token's pairs."""
    tokens, top_k = weights.shape
    by_pair = torch.zeros(tokens * top_k, rows.shape[-1], dtype=torch.float32)
    by_pair[order] = rows.float()
    return (by_pair.view(tokens, top_k, rows.shape[-1]) * weights[..., None]).sum(dim=1).to(dtype)
