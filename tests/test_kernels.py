"""minillm.kernels: the Triton FlashAttention kernels and tiled matmul against plain PyTorch references.

On a CPU the kernels run in Triton's interpreter (minillm.kernels sets TRITON_INTERPRET=1 before triton is
imported), so shapes stay small; on a GPU the same tests run the compiled kernels.
"""

from __future__ import annotations

import random

import pytest
import torch

import minillm.kernels as K  # first: on a CPU it sets TRITON_INTERPRET=1 before anything imports triton
from minillm.kernels import reference as ref

pytest.importorskip("triton", reason="triton is not installed")
from minillm.kernels.matmul import matmul  # noqa: E402  (needs triton)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32 checks the kernel's logic exactly in the interpreter; on a GPU the broad sweeps use bfloat16, the
# engine's dtype there (and each float32 specialization costs a long compilation)
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.float16: dict(atol=3e-3, rtol=3e-3),
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def randn(*shape, dtype=torch.float32, gen=None):
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def close(out, want, dtype, what):
    torch.testing.assert_close(out.float(), want.float(), **TOL[dtype], msg=lambda m: f"{what}: {m}")


def paged_cache(lengths, nheads_k, head_dim, block_size, dtype, gen, spare=3):
    """Random K/V caches whose blocks are handed out in shuffled order; block tables padded with 0 like the engine's."""
    need = [-(-n // block_size) for n in lengths]
    num_blocks = sum(need) + spare
    k_cache = randn(num_blocks, block_size, nheads_k, head_dim, dtype=dtype, gen=gen)
    v_cache = randn(num_blocks, block_size, nheads_k, head_dim, dtype=dtype, gen=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(lengths), max(need), dtype=torch.int32)
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(order[:n])
        order = order[n:]
    return k_cache, v_cache, table.to(DEVICE)


def cu(lengths):
    return torch.tensor([0, *lengths], device=DEVICE).cumsum(0).to(torch.int32)


# (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim): edge cases first, then seeded random shapes
DENSE = [(1, 1, 1, 1, 1, 64), (2, 37, 37, 4, 4, 64), (1, 5, 40, 6, 2, 64), (1, 40, 7, 2, 2, 64),
         (2, 16, 16, 9, 3, 64), (1, 17, 33, 8, 1, 128), (1, 1, 50, 4, 2, 128)]
_rng = random.Random(0)
DENSE += [(_rng.randint(1, 2), _rng.randint(1, 48), _rng.randint(1, 48), *_rng.choice([(2, 2), (4, 2), (6, 3), (4, 1)]),
           _rng.choice([64, 128])) for _ in range(4)]


@pytest.mark.parametrize("shape", DENSE, ids=lambda s: "b{}_q{}_k{}_h{}/{}_d{}".format(*s))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attn_func_matches_reference(shape, causal):
    b, sq, sk, h, hk, d = shape
    gen = torch.Generator().manual_seed(sum(shape))
    q = randn(b, sq, h, d, dtype=DTYPE, gen=gen)
    k, v = randn(b, sk, hk, d, dtype=DTYPE, gen=gen), randn(b, sk, hk, d, dtype=DTYPE, gen=gen)
    close(K.flash_attn_func(q, k, v, causal=causal), ref.flash_attn_func(q, k, v, causal=causal), DTYPE,
          f"{shape} causal={causal}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_half_precision(dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    q, k, v = (randn(2, 21, 4, head_dim, dtype=dtype, gen=gen) for _ in range(3))
    out = K.flash_attn_func(q, k, v, causal=True)
    assert out.dtype == dtype and out.shape == q.shape
    close(out, ref.flash_attn_func(q, k, v, causal=True), dtype, f"{dtype} d={head_dim}")


def test_scale_large_logits_and_strided_inputs():
    gen = torch.Generator().manual_seed(1)
    q = randn(1, 4, 30, 64, gen=gen).transpose(1, 2) * 30  # [b, s, h, d] view of a [b, h, s, d] tensor; huge scores
    k, v = randn(1, 4, 30, 64, gen=gen).transpose(1, 2), randn(1, 4, 30, 64, gen=gen).transpose(1, 2)
    for scale in (None, 0.5):
        out = K.flash_attn_func(q, k, v, causal=True, softmax_scale=scale)
        assert torch.isfinite(out).all()
        close(out, ref.flash_attn_func(q, k, v, causal=True, softmax_scale=scale), torch.float32, f"scale {scale}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_packed(dtype, causal):
    gen = torch.Generator().manual_seed(2)
    q_lens, k_lens = [5, 1, 33, 16], [5, 20, 40, 16]  # one decode-like row, one chunk after a cached prefix
    q = randn(sum(q_lens), 6, 64, dtype=dtype, gen=gen)
    k, v = randn(sum(k_lens), 2, 64, dtype=dtype, gen=gen), randn(sum(k_lens), 2, 64, dtype=dtype, gen=gen)
    args = (q, k, v, cu(q_lens), cu(k_lens), max(q_lens), max(k_lens))
    close(K.flash_attn_varlen_func(*args, causal=causal), ref.flash_attn_varlen_func(*args, causal=causal), dtype,
          f"varlen causal={causal}")


@pytest.mark.parametrize("block_size", [8, 16])
def test_varlen_paged(block_size):
    gen = torch.Generator().manual_seed(block_size)
    q_lens, k_lens = [7, 1, 1, 24], [7, 30, 1, 40]
    k_cache, v_cache, table = paged_cache(k_lens, 3, 64, block_size, DTYPE, gen)
    q = randn(sum(q_lens), 9, 64, dtype=DTYPE, gen=gen)
    args = (q, k_cache, v_cache, cu(q_lens), cu(k_lens), max(q_lens), max(k_lens))
    close(K.flash_attn_varlen_func(*args, causal=True, block_table=table),
          ref.flash_attn_varlen_func(*args, causal=True, block_table=table), DTYPE, "paged varlen")


@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("num_splits", [1, 3, 0], ids=["splits1", "splits3", "auto"])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1)], ids=["mha", "gqa3", "mqa"])
def test_with_kvcache_paged(seqlen_q, num_splits, heads):
    h, hk = heads
    gen = torch.Generator().manual_seed(seqlen_q + 10 * num_splits + h)
    lengths = [seqlen_q, 19, 48]
    k_cache, v_cache, table = paged_cache(lengths, hk, 64, 16, DTYPE, gen)
    q = randn(len(lengths), seqlen_q, h, 64, dtype=DTYPE, gen=gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out = K.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                    num_splits=num_splits)
    close(out, ref.flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table), DTYPE,
          f"kvcache seqlen_q={seqlen_q} splits={num_splits} heads={heads}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_with_kvcache_contiguous_half(dtype):
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = randn(2, 50, 2, 128, dtype=dtype, gen=gen), randn(2, 50, 2, 128, dtype=dtype, gen=gen)
    q = randn(2, 1, 8, 128, dtype=dtype, gen=gen)
    seqlens = torch.tensor([50, 17], device=DEVICE)
    for splits in (1, 2):
        out = K.flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, None, num_splits=splits)
        want = ref.flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, None)
        close(out, want, dtype, f"contiguous, {splits} splits")


def test_engine_step_mapping():
    """A continuous-batching step as minillm.attention lays it out: two prefills (one after a cached prefix) and
    two decodes, K/V written through slot_mapping first; one paged varlen call covers the whole step."""
    gen = torch.Generator().manual_seed(4)
    block_size, h, hk, d = 4, 6, 2, 64
    query_lens, context_lens = [6, 3, 1, 1], [6, 9, 5, 13]
    k_cache, v_cache, tables = paged_cache(context_lens, hk, d, block_size, DTYPE, gen)
    slots = [int(tables[i, p // block_size]) * block_size + p % block_size
             for i, (ql, cl) in enumerate(zip(query_lens, context_lens)) for p in range(cl - ql, cl)]
    q = randn(sum(query_lens), h, d, dtype=DTYPE, gen=gen)
    k_new, v_new = (randn(sum(query_lens), hk, d, dtype=DTYPE, gen=gen) for _ in range(2))
    slot_mapping = torch.tensor(slots, device=DEVICE)
    k_cache.view(-1, hk, d).index_copy_(0, slot_mapping, k_new)  # what attention.store_kv does
    v_cache.view(-1, hk, d).index_copy_(0, slot_mapping, v_new)
    ctx = torch.tensor(context_lens, device=DEVICE)
    args = (q, k_cache, v_cache, cu(query_lens), cu(context_lens), max(query_lens), max(context_lens))
    out = K.flash_attn_varlen_func(*args, causal=True, softmax_scale=d ** -0.5, block_table=tables)
    close(out, ref.flash_attn_varlen_func(*args, causal=True, block_table=tables), DTYPE, "whole step")
    decode = K.flash_attn_with_kvcache(q[-2:, None], k_cache, v_cache, cache_seqlens=ctx[2:], block_table=tables[2:])
    close(decode[:, 0], out[-2:], DTYPE, "decode part through flash_attn_with_kvcache")
    # the prefill without a cached prefix equals plain causal attention over its own new k, v
    fresh = K.flash_attn_func(q[None, :6], k_new[None, :6], v_new[None, :6], causal=True)
    close(fresh[0], out[:6], DTYPE, "fresh prefill")


def test_errors_at_the_boundary():
    q, k = torch.zeros(1, 4, 4, 64, device=DEVICE), torch.zeros(1, 4, 3, 64, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of nheads_k"):
        K.flash_attn_func(q, k, k)
    with pytest.raises(ValueError, match="head dim"):
        K.flash_attn_func(torch.zeros(1, 4, 2, 48, device=DEVICE), torch.zeros(1, 4, 2, 48, device=DEVICE),
                          torch.zeros(1, 4, 2, 48, device=DEVICE))
    with pytest.raises(ValueError, match="dtype"):
        K.flash_attn_func(q, q.half(), q.half())
    with pytest.raises(ValueError, match="block_table"):
        K.flash_attn_with_kvcache(q[:, :1], q, q, torch.tensor([4], device=DEVICE),
                                  torch.zeros(2, 1, dtype=torch.int32, device=DEVICE))


def test_use_triton(monkeypatch):
    monkeypatch.setenv("MINILLM_ATTENTION", "torch")
    assert not K.use_triton("cuda")
    monkeypatch.setenv("MINILLM_ATTENTION", "auto")
    assert K.use_triton("cuda") and not K.use_triton("cpu")
    monkeypatch.setenv("MINILLM_ATTENTION", "triton")
    if K.interpreting():
        assert K.use_triton("cpu")
    else:  # a GPU machine compiles kernels for CUDA; CPU tensors would need the interpreter
        with pytest.raises(RuntimeError):
            K.use_triton("cpu")
    monkeypatch.setenv("MINILLM_ATTENTION", "fast")
    with pytest.raises(ValueError):
        K.use_triton()


def test_online_softmax_pieces():
    gen = torch.Generator().manual_seed(5)
    q0, k0, v0 = (torch.randn(n, 32, generator=gen) for n in (9, 33, 33))
    want = ref.flash_attn_func(q0[None, :, None], k0[None, :, None], v0[None, :, None])[0, :, 0]  # one head
    o1, lse1 = K.partial_attention(q0, k0[:13], v0[:13], 32 ** -0.5)
    o2, lse2 = K.partial_attention(q0, k0[13:], v0[13:], 32 ** -0.5)
    merged, lse = K.merge_partials(o1, lse1, o2, lse2)
    torch.testing.assert_close(merged, want)
    torch.testing.assert_close(lse, torch.logsumexp(q0 @ k0.T * 32 ** -0.5, dim=-1))
    torch.testing.assert_close(K.tiled_attention(q0, k0, v0, block_n=8), want)
    causal = ref.flash_attn_func(q0[None, :, None], k0[None, :, None], v0[None, :, None], causal=True)[0, :, 0]
    torch.testing.assert_close(K.tiled_attention(q0, k0, v0, block_n=5, causal=True), causal)
    empty = K.partial_attention(q0, k0[:4], v0[:4], 1.0, mask=torch.zeros(9, 4, dtype=torch.bool))
    assert torch.isneginf(empty[1]).all() and (empty[0] == 0).all()
    torch.testing.assert_close(K.merge_partials(o1, lse1, *empty)[0], o1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mkn", [(1, 1, 1), (37, 50, 23), (64, 16, 48), (100, 17, 3)], ids=str)
def test_matmul_matches_torch(dtype, mkn):
    m, k, n = mkn
    gen = torch.Generator().manual_seed(m + k + n)
    a, b = randn(m, k, dtype=dtype, gen=gen), randn(k, n, dtype=dtype, gen=gen)
    out = matmul(a, b)
    assert out.dtype == dtype and out.shape == (m, n)
    tol = dict(atol=2e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=2e-2)
    torch.testing.assert_close(out.float(), torch.matmul(a.float(), b.float()), **tol)


def test_matmul_strided_and_tile_sizes():
    gen = torch.Generator().manual_seed(6)
    a, b = randn(40, 30, gen=gen), randn(20, 30, gen=gen).T  # b is a transposed view
    torch.testing.assert_close(matmul(a, b), torch.matmul(a, b), atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(matmul(a, b, block_m=32, block_n=16, block_k=32, group_m=2), torch.matmul(a, b),
                               atol=2e-4, rtol=1e-4)
    with pytest.raises(ValueError):
        matmul(a, a)


@pytest.mark.slow
@pytest.mark.parametrize("seqlen", [127, 200])
def test_longer_sequences(seqlen):
    gen = torch.Generator().manual_seed(seqlen)
    q, k, v = (randn(1, seqlen, 2, 64, dtype=DTYPE, gen=gen) for _ in range(3))
    close(K.flash_attn_func(q, k, v, causal=True), ref.flash_attn_func(q, k, v, causal=True), DTYPE,
          f"seqlen {seqlen}")
