"""Grader for exercise 3: your KV-cache size formula, concurrency count and contiguous cache against minillm's."""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from minillm.config import ModelConfig
from minillm.kv_cache import KVCache


def config(vocab, hidden, inter, layers, heads, kv_heads, head_dim, tie=True):
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                       rope_theta=1e4, max_position_embeddings=4096, tie_word_embeddings=tie)


TINY = config(320, 64, 128, 2, 4, 2, 16)
SMOLLM2 = config(49152, 576, 1536, 30, 9, 3, 64)
LLAMA2_7B = config(32000, 4096, 11008, 32, 32, 32, 128, tie=False)
LLAMA3_70B = config(128256, 8192, 28672, 80, 64, 8, 128, tie=False)
MQA = config(1000, 256, 512, 6, 8, 1, 32)
CONFIGS = {"tiny": TINY, "smollm2": SMOLLM2, "llama2-7b": LLAMA2_7B, "llama3-70b": LLAMA3_70B, "mqa": MQA}
DTYPE_BYTES = (4, 2, 1, 0.5)  # float32, bf16, int8/fp8, int4


def randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.points(2)
def test_kv_cache_bytes_matches_reference(impl, ref):
    for tokens in (1, 7, 4096, 64 * 8192):
        for layers, kv_heads, head_dim in [(2, 2, 16), (30, 3, 64), (32, 32, 128), (80, 8, 128), (6, 1, 32)]:
            for b in DTYPE_BYTES:
                got = impl.kv_cache_bytes(tokens, layers, kv_heads, head_dim, b)
                want = ref.kv_cache_bytes(tokens, layers, kv_heads, head_dim, b)
                assert got == want, f"{tokens} tokens, {layers} layers, {kv_heads} KV heads, dim {head_dim}, " \
                                    f"{b} bytes: got {got}, expected {want}"


@pytest.mark.points(1)
def test_kv_cache_bytes_is_what_gets_allocated(impl):
    for dtype in (torch.float32, torch.bfloat16):
        pool = KVCache.allocate(SMOLLM2, num_blocks=3, block_size=16, dtype=dtype, device="cpu")
        b = torch.empty((), dtype=dtype).element_size()
        got = impl.kv_cache_bytes(48, SMOLLM2.num_layers, SMOLLM2.num_kv_heads, SMOLLM2.head_dim, b)
        assert got == pool.nbytes, f"{dtype}: minillm's pool for 48 tokens holds {pool.nbytes} bytes, you said {got}"


@pytest.mark.points(1)
def test_kv_bytes_per_token(impl, ref):
    for name, cfg in CONFIGS.items():
        for b in DTYPE_BYTES:
            got, want = impl.kv_bytes_per_token(cfg, b), ref.kv_bytes_per_token(cfg, b)
            assert got == want, f"{name}, {b} bytes per number: got {got}, expected {want}"
    assert impl.kv_bytes_per_token(LLAMA2_7B, 2) == 512 * 1024, "Llama-2-7B in fp16 keeps 0.5 MiB per token"


@pytest.mark.points(2)
def test_max_concurrent_requests_matches_reference(impl, ref):
    for name, cfg in CONFIGS.items():
        for memory in (24e9, 80e9, 160e9, 640e9):
            for seq_len in (1, 512, 4096, 32768):
                for b, weights in [(2, None), (4, None), (2, cfg.num_params * 0.5)]:
                    got = impl.max_concurrent_requests(cfg, memory, seq_len, b, weights)
                    want = ref.max_concurrent_requests(cfg, memory, seq_len, b, weights)
                    assert got == want, f"{name}, {memory / 1e9:g} GB, {seq_len} tokens, dtype_bytes={b}, " \
                                        f"weight_bytes={weights}: got {got}, expected {want}"


@pytest.mark.points(1)
def test_max_concurrent_requests_edges(impl):
    assert impl.max_concurrent_requests(LLAMA2_7B, 80e9, 4096) == 30, "Llama-2-7B fp16, 80 GB, 4096 tokens: 30.98 -> 30"
    assert impl.max_concurrent_requests(LLAMA3_70B, 80e9, 4096) == 0, "70B bf16 weights (141 GB) do not fit in 80 GB"
    per_request = 10 * 2 * 16 * 2 * 2 * 4  # TINY, 10 tokens, float32
    assert impl.max_concurrent_requests(TINY, 100 + 3 * per_request, 10, 4, 100) == 3, "exactly three fit"
    assert impl.max_concurrent_requests(TINY, 100 + 3 * per_request - 1, 10, 4, 100) == 2, "one byte short of three"
    with pytest.raises(ValueError):
        impl.max_concurrent_requests(TINY, 1e9, 0)


@pytest.mark.points(1)
def test_cache_allocation(impl, ref):
    for batch, max_len, heads, dim, dtype in [(1, 1, 1, 1, torch.float32), (3, 17, 2, 16, torch.float32),
                                              (2, 64, 3, 64, torch.bfloat16)]:
        cache = impl.ContiguousKVCache(batch, max_len, heads, dim, dtype=dtype)
        where = f"batch {batch}, max_len {max_len}, {heads} KV heads, dim {dim}, {dtype}"
        for name in ("k", "v"):
            t = getattr(cache, name)
            assert t.shape == (batch, max_len, heads, dim), f"{where}: {name} has shape {tuple(t.shape)}"
            assert t.dtype == dtype, f"{where}: {name} has dtype {t.dtype}"
            assert not t.any(), f"{where}: {name} must start zero-filled"
        assert cache.lengths == [0] * batch, f"{where}: lengths must start at 0, got {cache.lengths}"
        assert cache.max_len == max_len
        b = torch.empty((), dtype=dtype).element_size()
        assert cache.nbytes == ref.kv_cache_bytes(batch * max_len, 1, heads, dim, b) == cache.k.nbytes * 2, \
            f"{where}: nbytes {cache.nbytes}"
    for bad in [(0, 4, 1, 2), (1, 0, 1, 2), (1, 4, 0, 2), (1, 4, 1, 0)]:
        with pytest.raises(ValueError):
            impl.ContiguousKVCache(*bad)


@pytest.mark.points(2)
def test_append_then_read(impl):
    cache = impl.ContiguousKVCache(1, 12, 2, 8)
    chunks = [(randn(n, 2, 8, seed=2 * i), randn(n, 2, 8, seed=2 * i + 1)) for i, n in enumerate((5, 1, 1, 3))]
    seen = 0
    for k, v in chunks:
        cache.append(0, k, v)
        seen += k.shape[0]
        got_k, got_v = cache.read(0)
        assert got_k.shape == (seen, 2, 8), f"after appending {seen} tokens read gives {tuple(got_k.shape)}"
    assert_close(got_k, torch.cat([k for k, _ in chunks]), msg=lambda m: f"keys read back: {m}")
    assert_close(got_v, torch.cat([v for _, v in chunks]), msg=lambda m: f"values read back: {m}")
    assert cache.lengths == [10]
    empty = impl.ContiguousKVCache(2, 4, 2, 8)
    assert empty.read(1)[0].shape == (0, 2, 8), "an empty sequence reads as 0 rows"


@pytest.mark.points(1)
def test_sequences_are_independent(impl):
    cache = impl.ContiguousKVCache(3, 6, 1, 4, dtype=torch.bfloat16)
    data = {s: randn(s + 1, 1, 4, seed=10 + s, dtype=torch.bfloat16) for s in range(3)}
    for s in (2, 0, 1):
        cache.append(s, data[s], -data[s])
    cache.append(0, data[0][:1], -data[0][:1])
    assert cache.lengths == [2, 2, 3], f"lengths {cache.lengths}"
    assert torch.equal(cache.read(0)[0], torch.cat([data[0], data[0][:1]]))
    for s in (1, 2):
        k, v = cache.read(s)
        assert torch.equal(k, data[s]) and torch.equal(v, -data[s]), f"sequence {s} changed by another's append"
        assert k.dtype == torch.bfloat16


@pytest.mark.points(1)
def test_read_returns_views(impl):
    cache = impl.ContiguousKVCache(2, 5, 1, 2)
    cache.append(1, torch.ones(2, 1, 2), torch.ones(2, 1, 2))
    k, v = cache.read(1)
    assert k.data_ptr() == cache.k[1].data_ptr() and v.data_ptr() == cache.v[1].data_ptr(), \
        "read must slice k and v (a view), not copy them"


@pytest.mark.points(2)
def test_bad_append_raises_and_changes_nothing(impl):
    cache = impl.ContiguousKVCache(2, 4, 1, 2)
    cache.append(0, torch.ones(3, 1, 2), torch.ones(3, 1, 2))
    k_before, v_before = cache.k.clone(), cache.v.clone()
    bad = {"overflow (3 cached + 2 new > max_len 4)": (0, torch.zeros(2, 1, 2), torch.zeros(2, 1, 2)),
           "wrong KV-head count": (1, torch.zeros(1, 2, 2), torch.zeros(1, 2, 2)),
           "k and v of different lengths": (1, torch.zeros(1, 1, 2), torch.zeros(2, 1, 2)),
           "a 2-D k and v": (1, torch.zeros(1, 2), torch.zeros(1, 2)),
           "sequence index 2 in a batch of 2": (2, torch.zeros(1, 1, 2), torch.zeros(1, 1, 2)),
           "negative sequence index": (-1, torch.zeros(1, 1, 2), torch.zeros(1, 1, 2))}
    for what, args in bad.items():
        with pytest.raises(ValueError):
            cache.append(*args)
            pytest.fail(f"{what}: no ValueError")
        assert cache.lengths == [3, 0], f"{what}: lengths changed to {cache.lengths}"
        assert torch.equal(cache.k, k_before) and torch.equal(cache.v, v_before), f"{what}: the cache changed"
    with pytest.raises(ValueError):
        cache.read(5)


@pytest.mark.points(2)
def test_cached_attention_equals_recompute(impl):
    """Decode with your cache: attending over cached K/V must equal attending over K/V recomputed from scratch."""
    hidden, heads, kv_heads, dim, steps = 48, 6, 2, 8, 10
    wq, wk, wv = (randn(n * dim, hidden, seed=20 + i) / hidden ** 0.5
                  for i, n in enumerate((heads, kv_heads, kv_heads)))
    x = randn(steps, hidden, seed=30)
    cache = impl.ContiguousKVCache(1, steps, kv_heads, dim)
    for t in range(steps):
        q = F.linear(x[t:t + 1], wq).view(1, heads, dim).transpose(0, 1)
        k_new, v_new = (F.linear(x[t:t + 1], w).view(1, kv_heads, dim) for w in (wk, wv))
        cache.append(0, k_new, v_new)
        k, v = cache.read(0)
        cached = F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1), enable_gqa=True)
        k_all = F.linear(x[:t + 1], wk).view(t + 1, kv_heads, dim).transpose(0, 1)
        v_all = F.linear(x[:t + 1], wv).view(t + 1, kv_heads, dim).transpose(0, 1)
        full = F.scaled_dot_product_attention(q, k_all, v_all, enable_gqa=True)
        assert_close(cached, full, rtol=1e-4, atol=1e-5, msg=lambda m: f"decode step {t}: {m}")
