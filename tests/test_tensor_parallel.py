"""Megatron-style tensor parallelism on 2 and 4 gloo ranks: a SwiGLU MLP (column-parallel gate|up, row-parallel
down) and a fused q|k|v projection equal their single-process results, with one all-reduce per MLP."""

import pytest
import torch
import torch.nn.functional as F

from minillm.layers import silu_and_mul
from minillm.parallel.comm import run_group
from minillm.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

HIDDEN, INTER = 64, 96


def _weights(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(5, HIDDEN, generator=gen), torch.randn(2 * INTER, HIDDEN, generator=gen) * 0.1,
            torch.randn(HIDDEN, INTER, generator=gen) * 0.1, torch.randn(HIDDEN, generator=gen))


def _mlp_rank(comm):
    x, gate_up, down, down_bias = _weights()
    col = ColumnParallelLinear(HIDDEN, [INTER, INTER], comm)
    row = RowParallelLinear(INTER, HIDDEN, comm, bias=True)
    col.weight_loader(col.weight, gate_up)
    row.weight_loader(row.weight, down)
    row.weight_loader(row.bias, down_bias)
    return row(silu_and_mul(col(x))), dict(comm.stats)


@pytest.mark.parametrize("world_size", [2, 4])
def test_parallel_mlp_equals_one_process(world_size):
    x, gate_up, down, down_bias = _weights()
    want = F.linear(silu_and_mul(F.linear(x, gate_up)), down, down_bias)
    for out, stats in run_group(_mlp_rank, world_size):
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        assert stats["all_reduce"].calls == 1  # one all-reduce per MLP block, none in the column-parallel layer


def _qkv_rank(comm, sizes):
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, HIDDEN, generator=gen), torch.randn(sum(sizes), HIDDEN, generator=gen)
    layer = ColumnParallelLinear(HIDDEN, sizes, comm, unit=16)
    layer.weight_loader(layer.weight, w)
    return layer(x), x, w


def test_fused_qkv_gives_each_rank_its_heads():
    sizes = [64, 32, 32]  # 4 query heads and 2 key/value heads of 16
    for rank, (out, x, w) in enumerate(run_group(_qkv_rank, 2, sizes)):
        q, k, v = F.linear(x, w).split(sizes, dim=-1)
        want = torch.cat([q[:, rank * 32:(rank + 1) * 32], k[:, rank * 16:(rank + 1) * 16],
                          v[:, rank * 16:(rank + 1) * 16]], dim=-1)
        torch.testing.assert_close(out, want)


def _bad_split(comm):
    ColumnParallelLinear(HIDDEN, [9 * 64, 3 * 64, 3 * 64], comm, unit=64)  # SmolLM2's 9 and 3 heads over 2 ranks


def test_impossible_split_is_named():
    with pytest.raises(RuntimeError, match="cannot be split evenly over 2 ranks"):
        run_group(_bad_split, 2)


def test_all_reduce_timing_reports_each_size():
    from minillm.parallel.comm import time_all_reduce

    rows = run_group(time_all_reduce, 2, [4, 4096], 3)[0]
    assert [r["bytes"] for r in rows] == [4, 4096] and all(r["seconds"] > 0 for r in rows)
