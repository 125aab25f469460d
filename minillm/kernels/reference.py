"""Chapter 5 — plain PyTorch attention with the flash_attn signatures: the references every Triton kernel is
tested against.

Each one builds the whole score matrix in float32, exactly the "naive" attention that FlashAttention avoids.
Conventions shared with flash-attn: GQA (query head h reads key/value head h // (nheads // nheads_k)); a
causal mask aligned to the bottom right (query i of seqlen_q sees keys j <= i + seqlen_k - seqlen_q), and a
query row that sees no key at all returns zeros. The quantized products (`int8_matmul_ref`, `int4_matmul_ref`)
dequantize the whole weight with `minillm.quant_formats` and multiply in float32.
"""

from __future__ import annotations

import torch

from ..quant_formats import dequantize_int4, dequantize_int8, unpack_int4


def _scale(q: torch.Tensor, softmax_scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """One sequence: q `[seqlen_q, nheads, d]`, k and v `[seqlen_k, nheads_k, d]` -> `[seqlen_q, nheads, d]`."""
    (sq, h, _), (sk, hk, _) = q.shape, k.shape
    if h % hk:
        raise ValueError(f"nheads={h} is not a multiple of nheads_k={hk}")
    kf = k.float().repeat_interleave(h // hk, dim=1).transpose(0, 1)  # [h, sk, d]
    vf = v.float().repeat_interleave(h // hk, dim=1).transpose(0, 1)
    scores = q.float().transpose(0, 1) @ kf.transpose(1, 2) * scale  # [h, sq, sk]: the N x N matrix
    if causal:
        visible = torch.arange(sk, device=q.device)[None, :] <= torch.arange(sq, device=q.device)[:, None] + (sk - sq)
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no visible key: all -inf -> NaN -> 0
    return (probs @ vf).transpose(0, 1).to(q.dtype)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` vectors of one sequence in a paged cache `[num_blocks, block_size, nheads_k, d]`."""
    blocks = -(-length // cache.shape[1])
    return cache[block_table[:blocks].long()].flatten(0, 1)[:length]


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    softmax_scale: float | None = None) -> torch.Tensor:
    """q `[batch, seqlen_q, nheads, d]`, k and v `[batch, seqlen_k, nheads_k, d]` -> `[batch, seqlen_q, nheads, d]`."""
    return torch.stack([_attend(q[b], k[b], v[b], causal, _scale(q, softmax_scale)) for b in range(q.shape[0])])


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                           softmax_scale: float | None = None, block_table: torch.Tensor | None = None) -> torch.Tensor:
    """Sequences packed one after another: q `[total_q, nheads, d]`; sequence b owns rows cu_seqlens_q[b]:[b+1].

    k and v are packed the same way (`[total_k, nheads_k, d]`), or, with `block_table`, paged caches
    `[num_blocks, block_size, nheads_k, d]` where sequence b's keys are the first cu_seqlens_k[b+1] -
    cu_seqlens_k[b] slots of the blocks listed in block_table[b].
    """
    out = torch.empty_like(q)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        if block_table is None:
            kb, vb = k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]
        else:
            kb, vb = _gather(k, block_table[b], ck[b + 1] - ck[b]), _gather(v, block_table[b], ck[b + 1] - ck[b])
        out[cq[b]:cq[b + 1]] = _attend(q[cq[b]:cq[b + 1]], kb, vb, causal, _scale(q, softmax_scale))
    return out


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
                            softmax_scale: float | None = None, causal: bool = True) -> torch.Tensor:
    """q `[batch, seqlen_q, nheads, d]` against the first cache_seqlens[b] cached keys of each sequence.

    Caches are paged `[num_blocks, block_size, nheads_k, d]` read through `block_table [batch, max_blocks]`,
    or, with block_table None, contiguous `[batch, max_seqlen, nheads_k, d]`.
    """
    out = torch.empty_like(q)
    for b, length in enumerate(cache_seqlens.tolist()):
        if block_table is None:
            kb, vb = k_cache[b, :length], v_cache[b, :length]
        else:
            kb, vb = _gather(k_cache, block_table[b], length), _gather(v_cache, block_table[b], length)
        out[b] = _attend(q[b], kb, vb, causal, _scale(q, softmax_scale))
    return out


def int8_matmul_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x `[M, K]` @ the int8 weight (q `[N, K]`, scale `[N]`) transposed -> `[M, N]` in x's dtype."""
    return (x.float() @ dequantize_int8(q, scale.float()).T).to(x.dtype)


def int4_matmul_ref(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """x `[M, K]` @ the int4 weight (`pack_int4` bytes `[N, K / 2]`, scale and zero `[N, K / group_size]`)
    transposed -> `[M, N]` in x's dtype."""
    if scale.shape[1] * group_size != 2 * packed.shape[1]:
        raise ValueError(f"{scale.shape[1]} groups of {group_size} do not cover the {2 * packed.shape[1]} inputs")
    w = dequantize_int4(unpack_int4(packed), scale.float(), zero.float())
    return (x.float() @ w.T).to(x.dtype)
