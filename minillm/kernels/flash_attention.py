"""Chapter 5 — the FlashAttention forward kernel in Triton: one kernel for dense, packed (varlen) and paged
key/value layouts.

Each program owns a tile of BLOCK_M query rows of one sequence and one key/value head. It loads its queries
into on-chip memory once, then streams the sequence's keys and values past them BLOCK_N at a time, keeping
an online softmax (running max `m`, running sum `l`, unnormalized output `acc`) in registers. The N x N
score matrix exists only one BLOCK_M x BLOCK_N tile at a time and never touches HBM: Q is read once, K and
V once per query tile, and O is written once.

Rows are (query position, query head) pairs: with GQA the GROUP query heads that share a key/value head
sit in the same tile, so each key/value tile fetched from HBM serves all of them (a decode step's GROUP
heads fill the rows that a single query position would leave empty).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .backend import dot_precision, interpreting
from .online_softmax import combine_partials

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)): the scale is folded into one multiply
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): converts the log2-domain LSE back to natural log


@triton.jit
def _attn_tile(acc, l_i, m_i, q, K, V, k_base, v_base, bt_row, pos, start, end, seqlen_k, shift, qk_scale,
               page_size, stride_kb, stride_kt, stride_vb, stride_vt,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
               PAGED: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Visit keys [start, end) BLOCK_N at a time, folding each block into the running (acc, l, m)."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = start + tl.arange(0, BLOCK_N)
    if not PAGED:  # contiguous keys: pointers to the first block, advanced by BLOCK_N rows per step
        k_ptrs = K + k_base + offs_n[:, None] * stride_kt + offs_d[None, :]
        v_ptrs = V + v_base + offs_n[:, None] * stride_vt + offs_d[None, :]
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_seq = offs_n < seqlen_k
        if PAGED:  # logical key position -> (physical block, slot) through the block table
            block = tl.load(bt_row + offs_n // page_size, mask=in_seq, other=0).to(tl.int64)
            slot = (offs_n % page_size)[:, None]
            k_ptrs = K + k_base + block[:, None] * stride_kb + slot * stride_kt + offs_d[None, :]
            v_ptrs = V + v_base + block[:, None] * stride_vb + slot * stride_vt + offs_d[None, :]
        if MASKED:  # the last, partial block, or one crossing the causal diagonal
            k = tl.load(k_ptrs, mask=in_seq[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=in_seq[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if UPCAST:  # the interpreter multiplies in numpy, which has no bfloat16
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if MASKED:
            visible = in_seq[None, :]
            if IS_CAUSAL:  # bottom-right aligned: query position i sees keys j <= i + seqlen_k - seqlen_q
                visible = visible & (offs_n[None, :] <= pos[:, None] + shift)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)  # rescales what was accumulated under the old max
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
        if not PAGED:
            k_ptrs += BLOCK_N * stride_kt
            v_ptrs += BLOCK_N * stride_vt
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "page_size", "split_len", "tune_key"])  # sizes vary
def _attn_fwd(Q, K, V, O, LSE, cu_seqlens_q, cu_seqlens_k, seqlens_k, block_table, qk_scale,
              seqlen_q, seqlen_k, page_size, split_len, tune_key,
              stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
              stride_os, stride_ob, stride_ot, stride_oh, stride_ls, stride_lb, stride_lt, stride_lh, stride_bt,
              GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              NUM_SPLITS: tl.constexpr, IS_CAUSAL: tl.constexpr, VARLEN: tl.constexpr, PAGED: tl.constexpr,
              UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Grid (query tiles x splits, sequences, key/value heads); `tune_key` only buckets shapes for autotuning."""
    pid_m, split = tl.program_id(0) // NUM_SPLITS, tl.program_id(0) % NUM_SPLITS
    b, hk = tl.program_id(1), tl.program_id(2)
    if VARLEN:  # this sequence's rows in the packed q
        q_start = tl.load(cu_seqlens_q + b)
        seqlen_q = tl.load(cu_seqlens_q + b + 1) - q_start
    else:
        q_start = 0
    if PAGED:  # keys are found through the block table, one by one
        seqlen_k = tl.load(seqlens_k + b)
        k_base = hk * stride_kh
        v_base = hk * stride_vh
    else:
        k_base = b.to(tl.int64) * stride_kb + hk * stride_kh
        v_base = b.to(tl.int64) * stride_vb + hk * stride_vh
        if VARLEN:
            k_start = tl.load(cu_seqlens_k + b).to(tl.int64)
            seqlen_k = (tl.load(cu_seqlens_k + b + 1) - k_start).to(tl.int32)
            k_base += k_start * stride_kt
            v_base += k_start * stride_vt
    if pid_m * BLOCK_M >= seqlen_q * GROUP:  # a tile past this sequence's end (max_seqlen_q sized the grid)
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pos = offs_m // GROUP  # query position of each row
    head = hk * GROUP + offs_m % GROUP  # query head of each row
    row_ok = pos < seqlen_q
    offs_d = tl.arange(0, HEAD_DIM)
    rows = (q_start + pos).to(tl.int64)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + rows[:, None] * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # Which keys this tile needs: all of them, or (causal) up to its last row's diagonal; keys below
    # `full` are visible to every row of the tile, so only the blocks from `full` on need a mask.
    shift = seqlen_k - seqlen_q
    hi = seqlen_k
    full = seqlen_k // BLOCK_N * BLOCK_N
    if IS_CAUSAL:
        last = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // GROUP, seqlen_q - 1)
        hi = tl.maximum(tl.minimum(seqlen_k, last + shift + 1), 0)
        full = tl.maximum(tl.minimum(seqlen_k, (pid_m * BLOCK_M) // GROUP + shift + 1), 0) // BLOCK_N * BLOCK_N
    lo = 0
    if NUM_SPLITS > 1:  # split-K: this program sees only keys [lo, lo + split_len)
        lo = split * split_len
        hi = tl.minimum(hi, lo + split_len)
    full = tl.maximum(tl.minimum(full, hi), lo)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a row that sees no key stays NaN-free
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    bt_row = block_table + b.to(tl.int64) * stride_bt
    acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, K, V, k_base, v_base, bt_row, pos, lo, full, seqlen_k, shift,
                               qk_scale, page_size, stride_kb, stride_kt, stride_vb, stride_vt,
                               HEAD_DIM, BLOCK_N, False, IS_CAUSAL, PAGED, UPCAST, DOT_PRECISION)
    acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, K, V, k_base, v_base, bt_row, pos, full, hi, seqlen_k, shift,
                               qk_scale, page_size, stride_kb, stride_kt, stride_vb, stride_vt,
                               HEAD_DIM, BLOCK_N, True, IS_CAUSAL, PAGED, UPCAST, DOT_PRECISION)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a row with no visible key outputs zeros, as flash-attn does
    o_rows = split * stride_os + b.to(tl.int64) * stride_ob + rows * stride_ot + head * stride_oh
    tl.store(O + o_rows[:, None] + offs_d[None, :], (acc / l_safe[:, None]).to(O.dtype.element_ty),
             mask=row_ok[:, None])
    if NUM_SPLITS > 1:  # natural-log LSE of this split, for combine_partials
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
        tl.store(LSE + split * stride_ls + b.to(tl.int64) * stride_lb + rows * stride_lt + head * stride_lh, lse,
                 mask=row_ok)


# Tile shapes on a GPU. Large prefills are autotuned: the first call for each shape class (head dim, GQA
# group, causal, paged, splits, dtypes and the power of two above the query rows) times every candidate
# and keeps the fastest. Small problems (tests, short prompts, decode) take a fixed, safe configuration,
# which costs one compilation and no tuning.
TUNED = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
         for m, n, w, s in [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 4), (64, 64, 4, 3)]]
_tuned = triton.autotune(TUNED, key=["HEAD_DIM", "GROUP", "IS_CAUSAL", "PAGED", "NUM_SPLITS", "tune_key"])(_attn_fwd)
SMALL = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
FLOAT32 = dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)  # 4-byte tiles: half the keys per step
DECODE = dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=2)
AUTOTUNE_WORK = 1 << 20  # query rows x keys above which a launch is autotuned
INTERPRETER_BLOCK = 16  # small tiles, so that small test shapes still span several tiles


@functools.cache
def _placeholder(device: torch.device) -> torch.Tensor:
    """Stands in for the index tensors a layout does not use (the kernel never reads it)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def _strides(x: torch.Tensor, batched: bool) -> tuple[int, int, int]:
    """(sequence, token, head) element strides of a batched `[b, s, h, ...]` or packed `[tokens, h, ...]` tensor."""
    return (x.stride(0), x.stride(1), x.stride(2)) if batched else (0, x.stride(0), x.stride(1))


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                      max_seqlen_q: int, max_seqlen_k: int, cu_seqlens_q: torch.Tensor | None = None,
                      cu_seqlens_k: torch.Tensor | None = None, seqlens_k: torch.Tensor | None = None,
                      block_table: torch.Tensor | None = None, num_splits: int = 1) -> torch.Tensor:
    """Launch the kernel on inputs already checked by `api.py`.

    q is batched `[b, s, h, d]`, or packed `[tokens, h, d]` with cu_seqlens_q; k and v are batched, packed
    (with cu_seqlens_k) or paged `[blocks, block_size, h_k, d]` (with block_table and seqlens_k).
    With num_splits > 1 each program sees 1/num_splits of the keys and `combine_partials` merges the splits.
    """
    varlen, paged = cu_seqlens_q is not None, block_table is not None
    batch = cu_seqlens_q.numel() - 1 if varlen else q.shape[0]
    nheads, head_dim, nheads_k = q.shape[-2], q.shape[-1], k.shape[-2]
    group, rows = nheads // nheads_k, max_seqlen_q * (nheads // nheads_k)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    o_buf, lse_buf, so, sl = out, out, (0, *_strides(out, not varlen)), (0, 0, 0, 0)
    if num_splits > 1:  # each split writes a float32 partial output and its LSE
        o_buf = torch.empty((num_splits, *q.shape), dtype=torch.float32, device=q.device)
        lse_buf = torch.empty((num_splits, *q.shape[:-1], 1), dtype=torch.float32, device=q.device)
        so = (o_buf.stride(0), *_strides(o_buf[0], not varlen))
        sl = (lse_buf.stride(0), *_strides(lse_buf[0], not varlen))
    block_n = INTERPRETER_BLOCK if interpreting() else 128  # split_len: a multiple of every BLOCK_N
    split_len = triton.cdiv(triton.cdiv(max_seqlen_k, num_splits), block_n) * block_n
    dummy = _placeholder(q.device)
    args = (q, k, v, o_buf, lse_buf, dummy if cu_seqlens_q is None else cu_seqlens_q,
            dummy if cu_seqlens_k is None else cu_seqlens_k, dummy if seqlens_k is None else seqlens_k,
            dummy if block_table is None else block_table, scale * LOG2E,
            max_seqlen_q, max_seqlen_k, k.shape[1] if paged else 1, split_len, triton.next_power_of_2(rows),
            *_strides(q, not varlen), *_strides(k, k.dim() == 4), *_strides(v, v.dim() == 4), *so, *sl,
            block_table.stride(0) if paged else 0)
    consts = dict(GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, IS_CAUSAL=causal, VARLEN=varlen,
                  PAGED=paged, UPCAST=interpreting(), DOT_PRECISION=dot_precision(q.dtype))

    def grid(meta):
        return (triton.cdiv(rows, meta["BLOCK_M"]) * num_splits, batch, nheads_k)

    if interpreting():
        _attn_fwd[grid](*args, **consts, BLOCK_M=INTERPRETER_BLOCK, BLOCK_N=INTERPRETER_BLOCK)
    elif rows <= 64:
        _attn_fwd[grid](*args, **consts, **DECODE)
    elif q.dtype == torch.float32:  # float32 is for checking, not speed: no tuning
        _attn_fwd[grid](*args, **consts, **FLOAT32)
    elif rows * max_seqlen_k < AUTOTUNE_WORK:
        _attn_fwd[grid](*args, **consts, **SMALL)
    else:
        _tuned[grid](*args, **consts)
    if num_splits > 1:
        out.copy_(combine_partials(o_buf, lse_buf[..., 0])[0])
    return out
