"""Chapter 7 — tensor parallelism (Megatron-LM's split): each rank holds a slice of every weight matrix.

A column-parallel layer splits the output features: rank r computes its slice of `x W^T` from the whole input,
and nothing is communicated. A row-parallel layer splits the input features: rank r multiplies its slice of
the input by its slice of W, and one all-reduce sums the partial products. Put a column-parallel layer before a
row-parallel one (q/k/v then o; gate/up then down) and the element-wise work between them (attention per head,
SwiGLU per channel) needs no communication either: one all-reduce per block. The embedding and the head split
the vocabulary. Each layer's `weight_loader` takes a full checkpoint tensor and keeps only this rank's shard,
so no rank ever holds the whole model. With no group (`tp=None`) every layer is the plain one-process layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import Linear
from .comm import Comm


def check_divisible(what: str, sizes: list[int], world_size: int, unit: int = 1) -> None:
    """Each size must split into `world_size` equal shards of whole units (e.g. whole heads of `unit` features)."""
    if any(size % unit or (size // unit) % world_size for size in sizes):
        units = f" ({[size / unit for size in sizes]} units of {unit})" if unit > 1 else ""
        raise ValueError(f"{what} {sizes}{units} cannot be split evenly over {world_size} ranks")


def _rank_size(tp: Comm | None) -> tuple[int, int]:
    return (0, 1) if tp is None else (tp.rank, tp.world_size)


def pad_vocab(vocab_size: int, tp: Comm | None) -> int:
    """The vocabulary rounded up to split evenly over the tensor-parallel ranks (the extra rows score nothing)."""
    world = _rank_size(tp)[1]
    return -(-vocab_size // world) * world


def _copy(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    param.copy_(loaded)


class ColumnParallelLinear(Linear):
    """`y = x W^T` with W's output features split over the ranks. A fused layer (q|k|v, gate|up) names its parts
    in `out_sizes`: each part is split on its own, so every rank gets a slice of each (its heads' q, k and v).
    `unit` keeps groups of that many features together (a head's `head_dim`), so no head is cut in two."""

    def __init__(self, in_features: int, out_sizes: list[int], tp: Comm | None = None, bias: bool = False,
                 unit: int = 1):
        rank, world = _rank_size(tp)
        check_divisible("output sizes", out_sizes, world, unit)
        self.out_sizes, self.local_sizes = list(out_sizes), [size // world for size in out_sizes]
        super().__init__(in_features, sum(self.local_sizes), bias=bias)
        self.tp, self.tp_rank = tp, rank

    @property
    def shard_ids(self) -> tuple:
        """The checkpoint tensors this layer is filled from: one per fused part (None: a single tensor)."""
        return tuple(range(len(self.out_sizes))) if len(self.out_sizes) > 1 else (None,)

    @torch.no_grad()
    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        """Fill this rank's rows of `param` (weight or bias) from the full checkpoint tensor of part `shard_id`,
        or of every part at once (`None`). A part shorter than its size (a vocabulary padded so that it splits
        evenly) gets zero rows after it."""
        parts = range(len(self.out_sizes)) if shard_id is None else [shard_id]
        full = loaded.split([self.out_sizes[i] for i in parts]) if shard_id is None else [loaded]
        for i, tensor in zip(parts, full):
            if tensor.shape[0] < self.out_sizes[i]:
                tensor = F.pad(tensor, (0, 0) * (tensor.dim() - 1) + (0, self.out_sizes[i] - tensor.shape[0]))
            n, offset = self.local_sizes[i], sum(self.local_sizes[:i])
            _copy(param[offset:offset + n], tensor[self.tp_rank * n:(self.tp_rank + 1) * n])


class RowParallelLinear(Linear):
    """`y = x W^T` with W's input features split over the ranks: each rank takes its slice of x (what the
    column-parallel layer before it produced) and one all-reduce sums the ranks' partial products. The bias and
    the block's residual are added once, by rank 0, inside its product."""

    def __init__(self, in_features: int, out_features: int, tp: Comm | None = None, bias: bool = False):
        rank, world = _rank_size(tp)
        check_divisible("input size", [in_features], world)
        super().__init__(in_features // world, out_features, bias=bias)
        self.tp, self.tp_rank = tp, rank

    shard_ids = (None,)

    @torch.no_grad()
    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: None = None) -> None:
        """This rank's columns of the full checkpoint weight `[out, in]`; the bias whole."""
        if param.dim() == 2:
            n = self.in_features
            loaded = loaded[:, self.tp_rank * n:(self.tp_rank + 1) * n]
        _copy(param, loaded)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.tp is None:
            return self.product(x, self.bias, residual)
        first = self.tp_rank == 0
        return self.tp.all_reduce(self.product(x, self.bias if first else None, residual if first else None))


class VocabParallelEmbedding(nn.Embedding):
    """Token embeddings with the vocabulary split over the ranks: each rank looks up the tokens in its range
    (zeros for the rest) and an all-reduce assembles every row. The vocabulary is padded to split evenly.
    As the tied head, each rank scores its slice of the vocabulary (`gather_logits` assembles them)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: Comm | None = None):
        rank, world = _rank_size(tp)
        self.vocab_size, self.tp, self.tp_rank = vocab_size, tp, rank
        self.shard_rows = pad_vocab(vocab_size, tp) // world
        super().__init__(self.shard_rows, hidden_size)
        self.vocab_start = rank * self.shard_rows

    shard_ids = (None,)

    @torch.no_grad()
    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: None = None) -> None:
        """This rank's rows of the full `[vocab, hidden]` matrix (zeros past the vocabulary's end)."""
        rows = loaded[self.vocab_start:self.vocab_start + self.shard_rows]
        param.zero_()
        _copy(param[:rows.shape[0]], rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(x)


def gather_logits(tp: Comm | None, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """The whole vocabulary's scores on tensor-parallel rank 0 from every rank's slice of them (the head is split
    like the embedding); None on the other ranks."""
    if tp is None:
        return local
    slices = tp.gather(local.contiguous())
    return None if slices is None else torch.cat(slices, dim=-1)[:, :vocab_size]
