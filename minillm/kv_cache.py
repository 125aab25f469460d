"""Where keys and values live between steps, and how much memory they take.

The engine's cache, `KVCache`, is one preallocated pool of fixed-size blocks per layer: a sequence's tokens
occupy slots `block * block_size + offset` for the blocks in its block table, so sequences of any length
share one pool without reserving room for their maximum length. `ContiguousKVCache` is the simpler cache
that reserves `max_len` rows per sequence up front (chapter 3 builds it; chapter 4 replaces it by paging).
The size formula and the concurrency it allows after the weights are here too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig


# Llama-3-70B's shape (meta-llama/Meta-Llama-3-70B config.json): 64 query heads share 8 KV heads (GQA-8).
LLAMA3_70B = ModelConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                         num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                         max_position_embeddings=8192, tie_word_embeddings=False)


def kv_cache_bytes(num_tokens: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of K and V for `num_tokens` tokens: tokens x layers x kv heads x head dim x 2 (K and V) x bytes."""
    return num_tokens * num_layers * num_kv_heads * head_dim * 2 * dtype_bytes


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: float) -> float:
    """What one more token of context costs in cache memory, over all layers."""
    return kv_cache_bytes(1, config.num_layers, config.num_kv_heads, config.head_dim, dtype_bytes)


def max_concurrent_requests(config: ModelConfig, memory_bytes: float, seq_len: int, dtype_bytes: float = 2,
                            weight_bytes: float | None = None) -> int:
    """How many requests of `seq_len` tokens each fit their KV caches in `memory_bytes` once the weights are
    loaded (`weight_bytes`, default every parameter in `dtype_bytes`); 0 when the weights alone do not fit."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be at least 1 token, got {seq_len}")
    weights = config.num_params * dtype_bytes if weight_bytes is None else weight_bytes
    per_request = seq_len * kv_bytes_per_token(config, dtype_bytes)
    return max(0, int((memory_bytes - weights) // per_request))


class ContiguousKVCache:
    """One layer's keys and values, `[batch, max_len, num_kv_heads, head_dim]` each, reserved in full up front.

    Sequence b's cached tokens are rows `0 .. lengths[b] - 1` of slot b: reading them is a plain slice, but
    every slot holds room for `max_len` tokens however few it ends up using.
    """

    def __init__(self, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if min(batch, max_len, num_kv_heads, head_dim) < 1:
            raise ValueError(f"every dimension must be >= 1, got batch={batch}, max_len={max_len}, "
                             f"num_kv_heads={num_kv_heads}, head_dim={head_dim}")
        shape = (batch, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * batch  # tokens cached so far, per sequence

    @property
    def max_len(self) -> int:
        """Tokens reserved per sequence."""
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes reserved (all of them, used or not)."""
        return self.k.nbytes + self.v.nbytes

    def _check_seq(self, seq: int) -> None:
        """Raise ValueError unless `seq` indexes a sequence of this batch."""
        if not 0 <= seq < len(self.lengths):
            raise ValueError(f"sequence {seq} is not in this cache (batch of {len(self.lengths)})")

    def append(self, seq: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store sequence `seq`'s new keys and values, `[new_tokens, num_kv_heads, head_dim]`, after its cached ones."""
        self._check_seq(seq)
        if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != self.k.shape[2:]:
            raise ValueError(f"k and v must both be [new_tokens, {self.k.shape[2]}, {self.k.shape[3]}], "
                             f"got {tuple(k.shape)} and {tuple(v.shape)}")
        start, end = self.lengths[seq], self.lengths[seq] + k.shape[0]
        if end > self.max_len:
            raise ValueError(f"sequence {seq} would hold {end} tokens; this cache reserved {self.max_len} per sequence")
        self.k[seq, start:end] = k
        self.v[seq, start:end] = v
        self.lengths[seq] = end

    def read(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence `seq`'s cached keys and values, `[length, num_kv_heads, head_dim]` each: views, not copies."""
        self._check_seq(seq)
        n = self.lengths[seq]
        return self.k[seq, :n], self.v[seq, :n]


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
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def __post_init__(self) -> None:
        self._layers = list(zip(self.k.unbind(0), self.v.unbind(0)))  # views, made once rather than every step

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V pools of layer i, `[num_blocks, block_size, num_kv_heads, head_dim]` each."""
        return self._layers[i]


def blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """How many blocks of the pool fit in `budget_bytes`."""
    per_block = kv_cache_bytes(block_size, config.num_layers, config.num_kv_heads, config.head_dim,
                               torch.empty((), dtype=dtype).element_size())
    return max(1, budget_bytes // per_block)
