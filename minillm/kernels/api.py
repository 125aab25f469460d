"""Chapter 5 — the flash_attn package's three entry points, on minillm's Triton kernel: same names, arguments
and shapes.

A reader with a GPU and flash-attn installed can swap `from flash_attn import ...` in for these (pass the
arguments after v by keyword: that works with both). Inputs are checked here, at the boundary, with
errors that name the offending argument; `flash_attention.attention_forward` launches the kernel.
"""

from __future__ import annotations

import torch

from .flash_attention import attention_forward

HEAD_DIMS = (16, 32, 64, 128)  # powers of two (tl.arange needs one) whose tiles fit in shared memory


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_dims: int, k_dims: int) -> None:
    if q.dim() != q_dims or k.dim() != k_dims or k.shape != v.shape:
        raise ValueError(f"expected q with {q_dims} dims, k and v of one shape with {k_dims}; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k, v must share one dtype of float16, bfloat16, float32; "
                         f"got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if q.shape[-1] not in HEAD_DIMS or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"head dim must be one of {HEAD_DIMS} and equal for q and k; got {q.shape[-1]}, {k.shape[-1]}")
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(f"nheads={q.shape[-2]} must be a multiple of nheads_k={k.shape[-2]}")


def _last_dim_contiguous(*xs: torch.Tensor) -> list[torch.Tensor]:
    """The kernel steps through head_dim with stride 1; any other stride is free to choose."""
    return [x if x.stride(-1) == 1 else x.contiguous() for x in xs]


def _scale(q: torch.Tensor, softmax_scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    softmax_scale: float | None = None) -> torch.Tensor:
    """q `[batch, seqlen_q, nheads, d]`, k and v `[batch, seqlen_k, nheads_k, d]` -> `[batch, seqlen_q, nheads, d]`."""
    _check(q, k, v, 4, 4)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q has batch {q.shape[0]} but k has {k.shape[0]}")
    q, k, v = _last_dim_contiguous(q, k, v)
    return attention_forward(q, k, v, causal=causal, scale=_scale(q, softmax_scale),
                             max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1])


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                           softmax_scale: float | None = None, block_table: torch.Tensor | None = None) -> torch.Tensor:
    """Sequences packed one after another: q `[total_q, nheads, d]`, sequence b's rows cu_seqlens_q[b]:[b+1].

    k and v are packed the same way, `[total_k, nheads_k, d]` with cu_seqlens_k; or, given `block_table
    [batch, max_blocks]`, paged caches `[num_blocks, block_size, nheads_k, d]` holding cu_seqlens_k[b+1] -
    cu_seqlens_k[b] keys of sequence b (flash-attn's paged varlen mode). max_seqlen_* bound the lengths.
    """
    _check(q, k, v, 3, 3 if block_table is None else 4)
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.dim() != 1:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both be [batch + 1]; got "
                         f"{tuple(cu_seqlens_q.shape)}, {tuple(cu_seqlens_k.shape)}")
    q, k, v = _last_dim_contiguous(q, k, v)
    seqlens_k = None
    if block_table is not None:
        if block_table.shape[0] != cu_seqlens_q.numel() - 1:
            raise ValueError(f"block_table has {block_table.shape[0]} rows for {cu_seqlens_q.numel() - 1} sequences")
        seqlens_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
    return attention_forward(q, k, v, causal=causal, scale=_scale(q, softmax_scale), max_seqlen_q=int(max_seqlen_q),
                             max_seqlen_k=int(max_seqlen_k), cu_seqlens_q=cu_seqlens_q.to(torch.int32),
                             cu_seqlens_k=cu_seqlens_k.to(torch.int32), seqlens_k=seqlens_k, block_table=block_table)


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cache_seqlens: torch.Tensor | int, block_table: torch.Tensor | None,
                            softmax_scale: float | None = None, causal: bool = True,
                            num_splits: int = 0) -> torch.Tensor:
    """q `[batch, seqlen_q, nheads, d]` against the first cache_seqlens[b] cached keys of each sequence.

    Caches are paged `[num_blocks, block_size, nheads_k, d]` read through `block_table [batch, max_blocks]`,
    or, with block_table None, contiguous `[batch, max_seqlen, nheads_k, d]`. The keys of the new tokens
    must already be in the cache (write them first, e.g. with `store_kv`). num_splits > 1 divides each
    sequence's keys among that many programs (split-K, "flash decoding"); 0 picks a number from the
    device's size, 1 turns it off.
    """
    _check(q, k_cache, v_cache, 4, 4)
    batch = q.shape[0]
    if isinstance(cache_seqlens, int):  # one length for every sequence, as flash-attn allows
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    if cache_seqlens.shape != (batch,):
        raise ValueError(f"cache_seqlens must be [batch={batch}]; got {tuple(cache_seqlens.shape)}")
    if block_table is None:  # a contiguous cache is a paged one with one block per sequence
        if k_cache.shape[0] != batch:
            raise ValueError(f"a contiguous cache needs one row per sequence; got {k_cache.shape[0]} for batch {batch}")
        block_table = torch.arange(batch, dtype=torch.int32, device=q.device)[:, None]
    elif block_table.shape[0] != batch:
        raise ValueError(f"block_table has {block_table.shape[0]} rows for batch {batch}")
    q, k_cache, v_cache = _last_dim_contiguous(q, k_cache, v_cache)
    max_seqlen_k = block_table.shape[1] * k_cache.shape[1]  # an upper bound, without reading cache_seqlens
    splits = num_splits or _num_splits(batch * k_cache.shape[2], q.shape[1] * q.shape[2] // k_cache.shape[2],
                                       max_seqlen_k, q.device)
    return attention_forward(q, k_cache, v_cache, causal=causal, scale=_scale(q, softmax_scale),
                             max_seqlen_q=q.shape[1], max_seqlen_k=max_seqlen_k,
                             seqlens_k=cache_seqlens.to(torch.int32), block_table=block_table, num_splits=splits)


def _num_splits(programs: int, rows: int, max_seqlen_k: int, device: torch.device) -> int:
    """Enough splits to give every streaming multiprocessor about two programs, each with >= 256 keys."""
    if device.type != "cuda" or rows > 64:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(2 * sms // programs, max_seqlen_k // 256, 32))
