"""Chapter 3 — where keys and values live between steps, and how much memory they take.

The engine's cache, `KVCache`, is one preallocated pool of fixed-size blocks per layer: a sequence's tokens
occupy slots `block * block_size + offset` for the blocks in its block table, so sequences of any length
share one pool without reserving room for their maximum length. `ContiguousKVCache` is the simpler cache
that reserves `max_len` rows per sequence up front (chapter 3 builds it; chapter 4 replaces it by paging).
The size formula and the concurrency it allows after the weights are here too.
"""

from __future__ import annotations

import math
import mmap
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


KV_CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}  # besides "auto": the model's dtype


def kv_cache_storage_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """What the pool stores for `kv_cache_dtype` ("auto" = the model's `dtype`, "int8", "fp8")."""
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; use 'auto', 'int8' or 'fp8'")
    return KV_CACHE_DTYPES[kv_cache_dtype]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor; on a CPU, anonymous memory that the OS maps as zero pages and backs only when touched, so a
    large pool costs nothing until its blocks are used (`torch.zeros` writes every byte up front)."""
    count = math.prod(shape)
    if torch.device(device).type != "cpu" or count == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=count).view(shape)


@dataclass
class KVCache:
    """K and V pools, each `[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`.

    A quantized pool (int8 or fp8) also keeps one float32 scale per stored vector, `k_scale` and `v_scale`
    `[num_layers, num_blocks, block_size, num_kv_heads]`: each token's key (and value) in each head is scaled
    so its largest element lands on the format's largest value, and is stored with its scale.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @classmethod
    def allocate(cls, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, kv_cache_dtype: str = "auto") -> "KVCache":
        """Zero-filled pools (zeros, not empty: masked-out slots must never hold NaN)."""
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        store = kv_cache_storage_dtype(kv_cache_dtype, dtype)
        k, v = (zeros(shape, store, device) for _ in range(2))
        if kv_cache_dtype == "auto":
            return cls(k, v)
        k_scale, v_scale = (zeros(shape[:-1], torch.float32, device) for _ in range(2))
        return cls(k, v, k_scale, v_scale)

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        """The stored values' dtype (int8 or float8 for a quantized pool)."""
        return self.k.dtype

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._pools())

    def __post_init__(self) -> None:
        # views, made once rather than every step
        self._layers = list(zip(*(t.unbind(0) for t in self._pools())))

    def layer(self, i: int) -> tuple[torch.Tensor, ...]:
        """The K and V pools of layer i, `[num_blocks, block_size, num_kv_heads, head_dim]` each (then, for a
        quantized pool, their scales `[num_blocks, block_size, num_kv_heads]`)."""
        return self._layers[i]

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block `src` onto block `dst` in every layer (copy-on-write of a shared block)."""
        for pool in self._pools():
            pool[:, dst].copy_(pool[:, src])

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write before a step: each `(src, dst)` block pair, in order."""
        for src, dst in copies:
            self.copy_block(src, dst)

    def _pools(self) -> list[torch.Tensor]:
        return [p for p in (self.k, self.v, self.k_scale, self.v_scale) if p is not None]

    def _as_bytes(self, num_blocks: int) -> tuple[list[torch.Tensor], list[tuple[int, ...]], list[int]]:
        """Every pool viewed as bytes (one path for every dtype, scales included), the shape `num_blocks` of its
        blocks take in every layer, and their sizes: how `pack_blocks` lays blocks out, one pool after another."""
        pools = [p.view(torch.uint8) for p in self._pools()]
        shapes = [(p.shape[0], num_blocks, *p.shape[2:]) for p in pools]
        return pools, shapes, [math.prod(shape) for shape in shapes]

    def pack_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Chapter 9 — the given blocks of every layer as one flat byte tensor on the CPU, ready to send: K, then V,
        then (quantized pools) their scales, each `[num_layers, len(block_ids), block_size, ...]` in order."""
        pools, shapes, sizes = self._as_bytes(len(block_ids))
        index = torch.tensor(block_ids, dtype=torch.long, device=self.k.device)
        data = torch.empty(sum(sizes), dtype=torch.uint8, device=self.k.device)
        for pool, shape, part in zip(pools, shapes, data.split(sizes)):
            torch.index_select(pool, 1, index, out=part.view(shape))
        return data.cpu()

    def unpack_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Chapter 9 — write bytes made by `pack_blocks` (of a pool of the same layout) into the given blocks."""
        pools, shapes, sizes = self._as_bytes(len(block_ids))
        if data.numel() != sum(sizes):
            raise ValueError(f"got {data.numel()} bytes for {len(block_ids)} blocks; this pool needs {sum(sizes)}")
        index = torch.tensor(block_ids, dtype=torch.long, device=self.k.device)
        for pool, shape, part in zip(pools, shapes, data.to(self.k.device).split(sizes)):
            pool.index_copy_(1, index, part.view(shape))


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes one block of the pool takes over all layers, scales included."""
    store = kv_cache_storage_dtype(kv_cache_dtype, dtype)
    values = kv_cache_bytes(block_size, config.num_layers, config.num_kv_heads, config.head_dim, store.itemsize)
    scales = 0 if kv_cache_dtype == "auto" else kv_cache_bytes(block_size, config.num_layers, config.num_kv_heads, 1, 4)
    return values + scales


def blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int,
                      kv_cache_dtype: str = "auto") -> int:
    """How many blocks of the pool fit in `budget_bytes`."""
    return max(1, budget_bytes // kv_block_bytes(config, block_size, dtype, kv_cache_dtype))
