"""The minillm code this exercise rebuilds (the grader's reference; not a copy).

minillm's tensor-parallel layers cut their shard from the full checkpoint tensor in their `weight_loader`.
`shard_column` and `shard_row` build a layer for the given rank (the group it takes needs only `rank` and
`world_size`), load the full weight into it and return the shard it kept; `parallel_mlp` puts the given shards
into a column-parallel gate|up and a row-parallel down layer and runs them with minillm's SwiGLU between them.
`sort_by_expert` and `combine` are minillm's own, the first and last steps of its expert-parallel MoE layer.
"""

from types import SimpleNamespace

import torch

from minillm.layers import silu_and_mul
from minillm.moe import combine, sort_by_expert
from minillm.parallel.comm import Comm
from minillm.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

__all__ = ["Comm", "shard_column", "shard_row", "parallel_mlp", "sort_by_expert", "combine"]
GRADED = [n for n in __all__ if n != "Comm"]  # given: the stub imports it


def shard_column(w: torch.Tensor, rank: int, world_size: int, out_sizes: list[int] | None = None) -> torch.Tensor:
    sizes = [w.shape[0]] if out_sizes is None else out_sizes
    layer = ColumnParallelLinear(w.shape[1], sizes, SimpleNamespace(rank=rank, world_size=world_size)).to(w.dtype)
    layer.weight_loader(layer.weight, w)
    return layer.weight.detach()


def shard_row(w: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    layer = RowParallelLinear(w.shape[1], w.shape[0], SimpleNamespace(rank=rank, world_size=world_size)).to(w.dtype)
    layer.weight_loader(layer.weight, w)
    return layer.weight.detach()


@torch.no_grad()
def parallel_mlp(comm: Comm, x: torch.Tensor, gate_up_shard: torch.Tensor, down_shard: torch.Tensor) -> torch.Tensor:
    hidden, inter = down_shard.shape[0], down_shard.shape[1] * comm.world_size
    gate_up = ColumnParallelLinear(hidden, [inter, inter], comm).to(x.dtype)
    down = RowParallelLinear(inter, hidden, comm).to(x.dtype)
    gate_up.weight.copy_(gate_up_shard)
    down.weight.copy_(down_shard)
    return down(silu_and_mul(gate_up(x)))
