"""Chapter 4 — attention over the paged KV cache, with prefill and decode as separate code paths.

Prefill attends from many new tokens of each sequence (packed one after another) to that sequence's
cached and new keys; decode attends from one new token per sequence. Both read the cache through each
sequence's block table, so the same code serves one request or a continuously batched many.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from .quant_formats import quantize_fp8, quantize_int8


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit: built once per step by the model runner, read by every layer.

    Tokens are packed with the prefill sequences (several new tokens each) first and the decode
    sequences (one new token each) after them; the first `num_prefill_tokens` tokens are the prefill part.
    """

    slot_mapping: torch.Tensor  # [num_new_tokens] cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks] physical blocks of each sequence (padded with 0)
    context_lens: torch.Tensor  # [num_seqs] tokens in the cache for each sequence after this step
    query_lens: list[int]       # new tokens of each sequence
    num_prefills: int           # the first num_prefills sequences are prefills, the rest decodes
    # (chapter 10: a sequence checking drafts is as many decode "sequences" as it has new tokens, one per token, each
    # with the context up to its own position; `ModelRunner.prepare`)
    use_triton: bool = False    # attend with minillm.kernels (Triton) instead of plain PyTorch
    use_cpu_kernel: bool = False  # decode through the C kernel of minillm.kernels.cpu (a float32 or int8 pool on a CPU)

    def __post_init__(self) -> None:
        p = self.num_prefills
        self.num_prefill_tokens = sum(self.query_lens[:p])
        self.prefill = _Part(self.block_tables[:p], self.context_lens[:p], self.query_lens[:p]) if p else None
        rest = len(self.query_lens) - p
        self.decode = _Part(self.block_tables[p:], self.context_lens[p:], self.query_lens[p:]) if rest else None


@dataclass
class MicroBatch:
    """The tensors of one forward pass over some of the step's sequences (`ModelRunner.prepare`'s output)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor | None  # None: each sequence's last new token

    @property
    def num_logits(self) -> int:
        if self.logits_indices is not None:
            return len(self.logits_indices)
        return len(self.meta.query_lens)


def _decode_gather(part: "_Part", block_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Cache slots of every context token of each decoding sequence, `[seqs, longest]`, and the padding mask."""
    longest = max(part.context_lens_list)
    positions = torch.arange(longest, device=part.block_tables.device)
    slots = part.block_tables[:, positions // block_size] * block_size + positions % block_size
    if len(part.query_lens) == 1:
        return slots, None  # a lone sequence needs no padding mask
    return slots, (positions[None, :] < part.context_lens[:, None])[:, None, None, :]


@dataclass
class _Part:
    """The prefill or the decode sequences of a step."""

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_lens: list[int]

    def __post_init__(self) -> None:
        self.context_lens_list = self.context_lens.tolist()  # as Python ints, once per step rather than per layer
        self.max_seqlen_k = max(self.context_lens_list)
        self.gather_slots: torch.Tensor | None = None  # filled by decode_attention
        self.mask: torch.Tensor | None = None

    @cached_property
    def cu_seqlens_q(self) -> torch.Tensor:
        """Packed query offsets for the Triton kernels (int32), built by the first layer that needs them."""
        return F.pad(torch.tensor(self.query_lens, device=self.context_lens.device).cumsum(0), (1, 0)).int()

    @cached_property
    def cu_seqlens_k(self) -> torch.Tensor:
        """Packed key offsets for the Triton kernels (int32), built by the first layer that needs them."""
        return F.pad(self.context_lens.cumsum(0), (1, 0)).int()


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Write the new tokens' keys and values `[tokens, kv_heads, head_dim]` into their cache slots; into a
    quantized pool (int8 or fp8, with `k_scale`/`v_scale`), each vector quantized with a scale of its own."""
    if k_scale is None:
        k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)
        return
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        q, s = quantize_kv(x, cache.dtype)
        _bytes(cache).view(-1, *x.shape[1:]).index_copy_(0, slot_mapping, _bytes(q))
        scales.view(-1, x.shape[1]).index_copy_(0, slot_mapping, s)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys or values `[tokens, kv_heads, head_dim]` as `dtype` (int8 or fp8) with one float32 scale per vector
    `[tokens, kv_heads]`: symmetric, the vector's largest magnitude on the format's largest value."""
    q, scale = (quantize_int8 if dtype == torch.int8 else quantize_fp8)(x.reshape(-1, x.shape[-1]))
    return q.view(x.shape), scale.view(x.shape[:-1])


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_kv`, in `dtype`."""
    return (q.float() * scale[..., None]).to(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A one-byte pool seen as bytes: PyTorch copies rows of bytes but has no index_copy_ for float8."""
    return t.view(torch.uint8)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int, scales: torch.Tensor | None = None,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """The first `length` cached vectors of one sequence, `[length, kv_heads, head_dim]` (dequantized into
    `dtype` when the pool is quantized and `scales` are its scales)."""
    block_size = cache.shape[1]
    table = block_table[:-(-length // block_size)]
    if scales is None:
        return gather_blocks(cache, table).flatten(0, 1)[:length]
    q = gather_blocks(_bytes(cache), table).flatten(0, 1)[:length].view(cache.dtype)
    return dequantize_kv(q, gather_blocks(scales, table).flatten(0, 1)[:length], dtype)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Copy the listed blocks out of the pool: `block_tables [..., n]` -> `[..., n, block_size, kv_heads, head_dim]`.

    `index_select` over the pool seen as one row per block is a plain row copy, faster than general indexing.
    """
    rows = cache.view(cache.shape[0], -1).index_select(0, block_tables.reshape(-1))
    return rows.view(*block_tables.shape, *cache.shape[1:])


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, meta: _Part, scale: float, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention for packed new tokens `[tokens, heads, head_dim]`, each sequence on its own.

    A sequence whose earlier tokens are already cached attends to them too: the causal mask is aligned
    to the bottom right, so new token i sees every cached token and new tokens 0..i. With a quantized pool
    every key and value is read back from the pool, so prefill sees the same rounded values decode will.
    """
    out = torch.empty_like(q)
    start = 0
    for i, (qlen, ctx) in enumerate(zip(meta.query_lens, meta.context_lens_list)):
        qi = q[start:start + qlen].transpose(0, 1)
        if ctx == qlen and k_scale is None:  # nothing cached before: the fresh k, v are the whole context
            ki, vi = k[start:start + qlen], v[start:start + qlen]
            mask, causal = None, True
        else:
            ki = gather_kv(k_cache, meta.block_tables[i], ctx, k_scale, q.dtype)
            vi = gather_kv(v_cache, meta.block_tables[i], ctx, v_scale, q.dtype)
            rows = torch.arange(qlen, device=q.device)[:, None] + (ctx - qlen)
            mask, causal = torch.arange(ctx, device=q.device)[None, :] <= rows, False
        o = F.scaled_dot_product_attention(qi, ki.transpose(0, 1), vi.transpose(0, 1), attn_mask=mask,
                                           is_causal=causal, scale=scale, enable_gqa=True)
        out[start:start + qlen] = o.transpose(0, 1)
        start += qlen
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: _Part, scale: float,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One new token per sequence, `q: [num_seqs, heads, head_dim]`, attending to its whole cached context.

    The slots to read are worked out at the first layer and kept on the step's metadata for the others, so
    each layer's gather is one `index_select` of exactly the context rows. The query heads that share a KV
    head go in as that head's rows of queries (`[seqs, kv_heads, group, head_dim]`): one attention per KV
    head over its keys, with no grouped-query expansion.
    """
    if meta.gather_slots is None:
        meta.gather_slots, meta.mask = _decode_gather(meta, k_cache.shape[1])
    seqs, longest = meta.gather_slots.shape
    kv_heads, head_dim = k_cache.shape[2:]
    index = meta.gather_slots.view(-1)
    if k_scale is None:
        k = k_cache.view(-1, kv_heads, head_dim).index_select(0, index).view(seqs, longest, kv_heads, head_dim)
        v = v_cache.view(-1, kv_heads, head_dim).index_select(0, index).view(seqs, longest, kv_heads, head_dim)
    else:
        k, v = (dequantize_kv(_bytes(c).view(-1, kv_heads, head_dim).index_select(0, index).view(c.dtype),
                              s.view(-1, kv_heads).index_select(0, index), q.dtype)
                .view(seqs, longest, kv_heads, head_dim) for c, s in ((k_cache, k_scale), (v_cache, v_scale)))
    o = F.scaled_dot_product_attention(q.view(seqs, kv_heads, -1, head_dim), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=meta.mask, scale=scale)
    return o.reshape(q.shape)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Store this step's K/V, then attend: the prefill part and the decode part each through its own path.

    A quantized pool (`k_scale`, `v_scale` given) is read by the PyTorch paths, which dequantize what they gather,
    except that the C kernel reads an int8 pool in place for float32 decode queries.
    """
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    p = meta.num_prefill_tokens
    if k_scale is not None:
        prefill = functools.partial(prefill_attention, k_scale=k_scale, v_scale=v_scale)
        kernel = meta.use_cpu_kernel and k_cache.dtype == torch.int8 and q.dtype == torch.float32
        decode = functools.partial(cpu_decode_attention if kernel else decode_attention, k_scale=k_scale,
                                   v_scale=v_scale)
    elif meta.use_triton:
        prefill, decode = triton_prefill_attention, triton_decode_attention
    else:
        prefill, decode = prefill_attention, cpu_decode_attention if meta.use_cpu_kernel else decode_attention
    if meta.prefill is None:  # a decode-only step, the common case
        return decode(q, k_cache, v_cache, meta.decode, scale)
    parts = [prefill(q[:p], k[:p], v[:p], k_cache, v_cache, meta.prefill, scale)]
    if meta.decode is not None:
        parts.append(decode(q[p:], k_cache, v_cache, meta.decode, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def cpu_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: _Part,
                         scale: float, k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`decode_attention` through the C kernel, which reads the keys and values in place instead of copying
    them out of the pool first (int32 block tables and lengths, as the model runner builds them); a float32
    pool, or an int8 one with its scales."""
    from .kernels.cpu import paged_decode_unchecked

    return paged_decode_unchecked(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, k_scale, v_scale)


def cpu_decode_layer(qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor,
                     v_cache: torch.Tensor, meta: AttentionMetadata, num_heads: int, scale: float,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """What `Attention.forward` does between its two products in a decode-only step on a CPU, in one C call
    (`kernels.cpu.rope_store_decode_unchecked`): rotate q and k of the q/k/v product's output `qkv` (in place),
    store k and v, attend. Bit for bit what `rotate`, `store_kv` and `cpu_decode_attention` compute one by one;
    each of those calls would run after a weight product has pushed the previous one's data out of the caches."""
    from .kernels.cpu import rope_store_decode_unchecked

    cos, sin_signed = rope
    return rope_store_decode_unchecked(qkv, cos, sin_signed, meta.slot_mapping, k_cache, v_cache,
                                       meta.decode.block_tables, meta.decode.context_lens, num_heads, scale,
                                       k_scale, v_scale)


def triton_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, meta: _Part, scale: float) -> torch.Tensor:
    """`prefill_attention` through the FlashAttention kernel, reading every key (cached or new) from the pages."""
    from .kernels import flash_attn_varlen_func

    return flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
                                  max_seqlen_q=max(meta.query_lens), max_seqlen_k=meta.max_seqlen_k, causal=True,
                                  softmax_scale=scale, block_table=meta.block_tables)


def triton_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: _Part,
                            scale: float) -> torch.Tensor:
    """`decode_attention` through the paged FlashAttention decode kernel (split along the keys when that helps)."""
    from .kernels import flash_attn_with_kvcache

    return flash_attn_with_kvcache(q[:, None], k_cache, v_cache, cache_seqlens=meta.context_lens,
                                   block_table=meta.block_tables, softmax_scale=scale)[:, 0]
