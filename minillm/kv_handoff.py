"""Chapter 9 — what a prefill instance hands a decode instance (vLLM's `kv_transfer_params`): a request's handle.

The handle is small: it names the request, its prompt and first token, and the prefill side's blocks that hold
the prompt's keys and values, with the layout the decode side must share to read them. It lives in the core
because requests (`sequence.py`) and outputs (`outputs.py`) carry it; `disagg/` moves the blocks it names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import KVCache
from .sampling import TokenLogprobs


@dataclass(frozen=True)
class KVLayout:
    """How one block of a KV pool is laid out; two instances can exchange blocks only if theirs are equal."""

    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # what the pool stores: the model's dtype, or int8 / float8 for a quantized cache
    quantized: bool  # then each token's key and value in each head also has a float32 scale

    @classmethod
    def of(cls, kv_cache: KVCache) -> KVLayout:
        num_layers, _, block_size, num_kv_heads, head_dim = kv_cache.k.shape
        return cls(block_size, num_layers, num_kv_heads, head_dim, str(kv_cache.dtype).removeprefix("torch."),
                   kv_cache.quantized)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers: layers x 2 (K and V) x block_size x KV heads x (head dim x bytes,
        plus a 4-byte scale when quantized)."""
        itemsize = torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()
        per_vector = self.head_dim * itemsize + (4 if self.quantized else 0)
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * per_vector

    def check(self, other: KVLayout) -> None:
        """Raise ValueError naming every field in which `other` (a remote instance's layout) differs from this one."""
        diffs = [f"{name} {getattr(other, name)} vs {getattr(self, name)} here" for name in self.__dataclass_fields__
                 if getattr(other, name) != getattr(self, name)]
        if diffs:
            raise ValueError("the prefill instance's KV layout differs from this one's: " + ", ".join(diffs))


@dataclass
class KVTransferParams:
    """A prefilled request, handed over: the prefill instance (rank `prefill_rank` of the pool's group) holds
    `block_ids` until a decode instance pulls them by `transfer_id` (or until it gives up waiting). The decode
    instance continues from `first_token`."""

    request_id: str  # the prefill instance's id for it
    prompt_token_ids: list[int]
    first_token: int
    first_token_time: float  # time.perf_counter on the prefill side (the same clock on one machine)
    block_ids: list[int]  # the prefill instance's blocks holding the prompt's K/V, in order
    layout: KVLayout
    transfer_id: int  # names the held blocks in a pull; also the tag of the reply
    first_logprobs: TokenLogprobs | None = None  # when the request asked for logprobs
    generator_state: torch.Tensor | None = None  # a seeded sampler's state after drawing the first token
    prefill_rank: int = 0  # which prefill instance holds the blocks

    @property
    def nbytes(self) -> int:
        """Bytes of every block of the prompt (a pull may ask for fewer: those the decode side lacks)."""
        return len(self.block_ids) * self.layout.block_bytes
