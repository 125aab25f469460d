"""Where keys and values live between steps: one preallocated pool of fixed-size blocks per layer.

A sequence's tokens occupy slots `block * block_size + offset` for the blocks in its block table, so
sequences of any length share one pool without reserving room for their maximum length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig


def kv_cache_bytes(num_tokens: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of K and V for `num_tokens` tokens: tokens x layers x kv heads x head dim x 2 (K and V) x bytes."""
    return num_tokens * num_layers * num_kv_heads * head_dim * 2 * dtype_bytes


@dataclass
class KVCache:
    """K and V pools, each `[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str) -> "KVCache":
        """Zero-filled pools (zeros, not empty: masked-out slots must never hold NaN)."""
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V pools of layer i, `[num_blocks, block_size, num_kv_heads, head_dim]` each."""
        return self.k[i], self.v[i]


def blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """How many blocks of the pool fit in `budget_bytes`."""
    per_block = kv_cache_bytes(block_size, config.num_layers, config.num_kv_heads, config.head_dim,
                               torch.empty((), dtype=dtype).element_size())
    return max(1, budget_bytes // per_block)
