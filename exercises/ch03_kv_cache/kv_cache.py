"""Exercise 3 — the KV cache: its size, the concurrency it allows, and a contiguous cache for one layer.

Replace each `raise NotImplementedError(...)` with your code, then run `make grade CH=03`.
Use plain Python and PyTorch; do not import minillm.kv_cache (that is what you are rebuilding).
`config` is a `minillm.config.ModelConfig`; read its fields num_layers, num_kv_heads, head_dim and its
property num_params (the parameter count).
"""

from __future__ import annotations

import torch


def kv_cache_bytes(num_tokens: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: float) -> float:
    """Bytes of keys and values for `num_tokens` cached tokens (summed over sequences: batch x sequence length).

    Each token keeps, in every layer, one key and one value vector per KV head, each `head_dim` numbers of
    `dtype_bytes` bytes (4 for float32, 2 for bf16/fp16, 1 for int8/fp8, 0.5 for int4).
    """
    raise NotImplementedError("kv_cache_bytes: write this function")


def kv_bytes_per_token(config, dtype_bytes: float) -> float:
    """What one more token of context costs in cache memory, over all of `config`'s layers."""
    raise NotImplementedError("kv_bytes_per_token: write this function")


def max_concurrent_requests(config, memory_bytes: float, seq_len: int, dtype_bytes: float = 2,
                            weight_bytes: float | None = None) -> int:
    """How many requests of `seq_len` tokens each fit their KV caches in `memory_bytes` once the weights are loaded.

    The weights take `weight_bytes` (None means every parameter in `dtype_bytes`); the cache stores
    `dtype_bytes` per number. Only whole requests count; return 0 when the weights alone do not fit.
    Raise ValueError when seq_len < 1.
    """
    raise NotImplementedError("max_concurrent_requests: write this function")


class ContiguousKVCache:
    """One layer's keys and values for a batch of sequences, reserved in full up front.

    Attributes after construction:
      k, v     zero-filled tensors `[batch, max_len, num_kv_heads, head_dim]` of `dtype` on `device`;
      lengths  a list of `batch` ints, the tokens cached so far per sequence (all 0 at first).
    Sequence b's cached tokens are rows 0 .. lengths[b] - 1 of k[b] and v[b].
    """

    def __init__(self, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        """Allocate k, v and lengths; raise ValueError if any of the four sizes is < 1."""
        raise NotImplementedError("ContiguousKVCache.__init__: write this method")

    @property
    def max_len(self) -> int:
        """Tokens reserved per sequence. (Given: nothing to write here.)"""
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes the cache reserves: k and v in full, used or not."""
        raise NotImplementedError("ContiguousKVCache.nbytes: write this property")

    def append(self, seq: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store sequence `seq`'s new keys and values, `[new_tokens, num_kv_heads, head_dim]` each, after its
        cached ones, and advance its length.

        Raise ValueError, changing nothing, when `seq` is not in 0 .. batch - 1, when k and v are not both of
        that shape, or when the sequence would then hold more than max_len tokens.
        """
        raise NotImplementedError("ContiguousKVCache.append: write this method")

    def read(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence `seq`'s cached keys and values, `[length, num_kv_heads, head_dim]` each, as views into k
        and v (slices, not copies). Raise ValueError when `seq` is not in 0 .. batch - 1."""
        raise NotImplementedError("ContiguousKVCache.read: write this method")
