"""Tensor parallelism (Megatron-LM's split): each rank holds a slice of every weight matrix.

A column-parallel layer splits the output features: rank r computes its slice of `x W^T` from the whole input,
and nothing is communicated. A row-parallel layer splits the input features: rank r multiplies its slice of
the input by its slice of W, and one all-reduce sums the partial products. Put a column-parallel layer before a
row-parallel one (q/k/v then o; gate/up then down) and the element-wise work between them (attention per head,
SwiGLU per channel) needs no communication either: one all-reduce per block. Each layer's `weight_loader`
takes the full checkpoint tensor and keeps only this rank's shard, so no rank ever holds the whole model.
"""

from __future__ import annotations

import torch
from torch import nn

from .comm import Comm


def _check_divisible(what: str, sizes: list[int], world_size: int, unit: int = 1) -> None:
    """Each size must split into `world_size` equal shards of whole units (e.g. whole heads of `unit` features)."""
    if any(size % unit or (size // unit) % world_size for size in sizes):
        units = f" ({[size / unit for size in sizes]} units of {unit})" if unit > 1 else ""
        raise ValueError(f"{what} {sizes}{units} cannot be split evenly over {world_size} ranks")


class ColumnParallelLinear(nn.Module):
    """`y = x W^T` with W's output features split over the ranks. A fused layer (q|k|v, gate|up) names its parts
    in `out_sizes`: each part is split on its own, so every rank gets a slice of each (its heads' q, k and v).
    `unit` keeps groups of that many features together (a head's `head_dim`), so no head is cut in two."""

    def __init__(self, in_features: int, out_sizes: list[int], comm: Comm, bias: bool = False, unit: int = 1):
        super().__init__()
        _check_divisible("output sizes", out_sizes, comm.world_size, unit)
        self.comm, self.out_sizes, self.in_features = comm, list(out_sizes), in_features
        self.local_sizes = [size // comm.world_size for size in out_sizes]
        self.weight = nn.Parameter(torch.empty(sum(self.local_sizes), in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(sum(self.local_sizes)), requires_grad=False) if bias else None

    def _shard(self, full: torch.Tensor) -> torch.Tensor:
        parts = full.split(self.out_sizes, dim=0)
        r = self.comm.rank
        return torch.cat([part[r * n:(r + 1) * n] for part, n in zip(parts, self.local_sizes)])

    @torch.no_grad()
    def weight_loader(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Keep this rank's rows of the full (fused) checkpoint weight `[sum(out_sizes), in]` (and bias)."""
        if weight.shape != (sum(self.out_sizes), self.in_features):
            raise ValueError(f"expected a full weight of shape {(sum(self.out_sizes), self.in_features)}, "
                             f"got {tuple(weight.shape)}")
        self.weight.copy_(self._shard(weight))
        if self.bias is not None:
            self.bias.copy_(self._shard(bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """`y = x W^T` with W's input features split over the ranks: each rank takes its slice of x (what the
    column-parallel layer before it produced) and one all-reduce sums the ranks' partial products."""

    def __init__(self, in_features: int, out_features: int, comm: Comm, bias: bool = False):
        super().__init__()
        _check_divisible("input size", [in_features], comm.world_size)
        self.comm, self.in_features, self.out_features = comm, in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features // comm.world_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    @torch.no_grad()
    def weight_loader(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Keep this rank's columns of the full checkpoint weight `[out, in]`; the bias is added once, after the sum."""
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(f"expected a full weight of shape {(self.out_features, self.in_features)}, "
                             f"got {tuple(weight.shape)}")
        n = self.weight.shape[1]
        self.weight.copy_(weight[:, self.comm.rank * n:(self.comm.rank + 1) * n])
        if self.bias is not None:
            self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(nn.functional.linear(x, self.weight))
        return y if self.bias is None else y + self.bias
