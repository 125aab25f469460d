"""The KV cache: the size formula against bytes actually allocated, the contiguous cache, and concurrency."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from minillm import LLM, SamplingParams
from minillm.config import ModelConfig
from minillm.kv_cache import (LLAMA3_70B, ContiguousKVCache, KVCache, blocks_for_budget, kv_bytes_per_token,
                              kv_cache_bytes, max_concurrent_requests)
from minillm.roofline import LLAMA2_7B

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5, max_position_embeddings=8192,
                      tie_word_embeddings=True)
TINY = dataclasses.replace(SMOLLM2, vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", [TINY, SMOLLM2], ids=["tiny", "smollm2"])
def test_formula_matches_the_paged_pool(config, dtype):
    cache = KVCache.allocate(config, num_blocks=5, block_size=16, dtype=dtype, device="cpu")
    size = torch.empty((), dtype=dtype).element_size()
    assert cache.nbytes == kv_cache_bytes(5 * 16, config.num_layers, config.num_kv_heads, config.head_dim, size)
    assert cache.k.untyped_storage().nbytes() + cache.v.untyped_storage().nbytes() == cache.nbytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_formula_matches_the_contiguous_cache(dtype):
    layers = [ContiguousKVCache(3, 40, 2, 16, dtype=dtype) for _ in range(TINY.num_layers)]
    size = torch.empty((), dtype=dtype).element_size()
    assert layers[0].k.shape == (3, 40, 2, 16) and layers[0].k.dtype == dtype
    assert sum(c.nbytes for c in layers) == kv_cache_bytes(3 * 40, TINY.num_layers, 2, 16, size)


def test_engine_pool_is_what_the_formula_says(tiny_llama):
    llm = LLM(tiny_llama, device="cpu", dtype=torch.float32, num_kv_blocks=7, block_size=4)
    c, stats = llm.engine.config, llm.stats()
    assert stats["kv_cache_bytes"] == llm.engine.kv_cache.nbytes
    assert stats["kv_cache_bytes"] == kv_cache_bytes(7 * 4, c.num_layers, c.num_kv_heads, c.head_dim, 4)
    assert blocks_for_budget(c, 4, torch.float32, stats["kv_cache_bytes"]) == 7


def test_bytes_per_token_of_known_models():
    assert kv_bytes_per_token(SMOLLM2, 4) == 30 * 3 * 64 * 2 * 4 == 46080
    assert kv_bytes_per_token(LLAMA2_7B, 2) == 512 * 1024       # MHA: 32 layers x 32 heads x 128 x 2 x 2
    assert kv_bytes_per_token(LLAMA3_70B, 2) == 320 * 1024      # GQA-8: 80 layers x 8 heads x 128 x 2 x 2
    mha = dataclasses.replace(SMOLLM2, num_kv_heads=SMOLLM2.num_heads)
    assert 3 * kv_bytes_per_token(SMOLLM2, 2) == kv_bytes_per_token(mha, 2)


def test_llama3_70b_shape():
    assert LLAMA3_70B.num_params == 70_553_706_496  # the published count


def test_max_concurrent_requests_hand_computed():
    # Llama-2-7B in fp16 on 80 GB: (80e9 - 2 x 6,738,415,616) / (4096 x 524,288) = 30.98 -> 30
    assert max_concurrent_requests(LLAMA2_7B, 80e9, 4096) == 30
    # Llama-3-70B in bf16 needs 141.1 GB for its weights: nothing fits on 80 GB; on 160 GB,
    # (160e9 - 141,107,412,992) / (4096 x 327,680) = 14.08 -> 14
    assert max_concurrent_requests(LLAMA3_70B, 80e9, 4096) == 0
    assert max_concurrent_requests(LLAMA3_70B, 160e9, 4096) == 14
    # exact fit: weights 1000 bytes, 10 tokens x 46080 bytes per request, room for exactly 3
    per_request = 10 * kv_bytes_per_token(SMOLLM2, 4)
    assert max_concurrent_requests(SMOLLM2, 1000 + 3 * per_request, 10, 4, weight_bytes=1000) == 3
    assert max_concurrent_requests(SMOLLM2, 1000 + 3 * per_request - 1, 10, 4, weight_bytes=1000) == 2
    assert max_concurrent_requests(SMOLLM2, 999, 10, 4, weight_bytes=1000) == 0
    # int4 weights (0.5 byte per parameter) with a bf16 cache: (80e9 - 35,276,853,248) / 1,342,177,280 = 33.3 -> 33
    assert max_concurrent_requests(LLAMA3_70B, 80e9, 4096, 2, weight_bytes=LLAMA3_70B.num_params * 0.5) == 33
    with pytest.raises(ValueError, match="seq_len"):
        max_concurrent_requests(SMOLLM2, 80e9, 0)


def test_append_and_read():
    torch.manual_seed(0)
    cache = ContiguousKVCache(batch=2, max_len=10, num_kv_heads=2, head_dim=4)
    chunks = [(torch.randn(n, 2, 4), torch.randn(n, 2, 4)) for n in (3, 1, 1, 4)]
    for k, v in chunks:
        cache.append(0, k, v)
    cache.append(1, torch.ones(2, 2, 4), 2 * torch.ones(2, 2, 4))
    k0, v0 = cache.read(0)
    assert torch.equal(k0, torch.cat([k for k, _ in chunks])) and torch.equal(v0, torch.cat([v for _, v in chunks]))
    k1, v1 = cache.read(1)
    assert torch.equal(k1, torch.ones(2, 2, 4)) and torch.equal(v1, 2 * torch.ones(2, 2, 4))
    assert cache.lengths == [9, 2]
    assert k0.data_ptr() == cache.k.data_ptr()  # a view into the reserved slot, not a copy
    assert cache.read(1)[0].shape == (2, 2, 4) and ContiguousKVCache(1, 5, 2, 4).read(0)[0].shape == (0, 2, 4)


def test_bad_appends_change_nothing():
    cache = ContiguousKVCache(batch=2, max_len=4, num_kv_heads=1, head_dim=2)
    cache.append(0, torch.ones(3, 1, 2), torch.ones(3, 1, 2))
    before = cache.k.clone()
    with pytest.raises(ValueError, match="would hold 5 tokens"):
        cache.append(0, torch.zeros(2, 1, 2), torch.zeros(2, 1, 2))
    with pytest.raises(ValueError, match="must both be"):
        cache.append(1, torch.zeros(1, 2, 2), torch.zeros(1, 2, 2))
    with pytest.raises(ValueError, match="must both be"):
        cache.append(1, torch.zeros(1, 1, 2), torch.zeros(2, 1, 2))
    with pytest.raises(ValueError, match="not in this cache"):
        cache.append(2, torch.zeros(1, 1, 2), torch.zeros(1, 1, 2))
    with pytest.raises(ValueError, match="not in this cache"):
        cache.read(-1)
    with pytest.raises(ValueError, match="dimension"):
        ContiguousKVCache(0, 4, 1, 2)
    assert cache.lengths == [3, 0] and torch.equal(cache.k, before)


def test_cached_decode_equals_recompute_for_one_layer():
    """Attention of each new token over cached K/V equals attention over K/V recomputed from scratch (GQA)."""
    torch.manual_seed(1)
    hidden, heads, kv_heads, dim, steps = 32, 4, 2, 8, 12
    wq, wk, wv = (torch.randn(n * dim, hidden) / hidden ** 0.5 for n in (heads, kv_heads, kv_heads))
    x = torch.randn(steps, hidden)
    cache = ContiguousKVCache(1, steps, kv_heads, dim)
    for t in range(steps):
        q = F.linear(x[t:t + 1], wq).view(1, heads, dim).transpose(0, 1)
        k_new, v_new = (F.linear(x[t:t + 1], w).view(1, kv_heads, dim) for w in (wk, wv))
        cache.append(0, k_new, v_new)
        k, v = cache.read(0)
        cached = F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1), enable_gqa=True)
        k_all = F.linear(x[:t + 1], wk).view(t + 1, kv_heads, dim).transpose(0, 1)
        v_all = F.linear(x[:t + 1], wv).view(t + 1, kv_heads, dim).transpose(0, 1)
        recomputed = F.scaled_dot_product_attention(q, k_all, v_all, enable_gqa=True)
        torch.testing.assert_close(cached, recomputed, rtol=1e-4, atol=1e-5)


def test_engine_decode_equals_prefill_of_the_whole_sequence(tiny_llama):
    """Greedy decode through the cache gives the tokens that re-running the whole sequence each step gives."""
    llm = LLM(tiny_llama, device="cpu", dtype=torch.float32, enable_prefix_caching=False)  # recompute, no reuse
    prompt = llm.get_tokenizer()("Prefill builds the cache; decode").input_ids
    cached = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    seq = list(prompt)
    for _ in range(12):
        seq.append(int(llm.engine.next_token_logits(seq).argmax()))
    assert cached.outputs[0].token_ids == seq[len(prompt):]
