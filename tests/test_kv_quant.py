"""A quantized KV cache (kv_cache_dtype="int8" | "fp8"): the per-vector format, the paged paths against the float
pool holding the same rounded values, capacity, and the engine end to end on a tiny model."""

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.attention import (_Part, decode_attention, dequantize_kv, gather_kv, prefill_attention, quantize_kv,
                               store_kv)
from minillm.config import ModelConfig
from minillm.kernels.cpu import cpu_kernel_available
from minillm.kv_cache import KVCache, blocks_for_budget, kv_block_bytes

TINY = ModelConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=256,
                   tie_word_embeddings=True)
FORMATS = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


@pytest.mark.parametrize("name", FORMATS)
def test_round_trip_per_vector(name):
    x = torch.randn(7, 2, 16) * torch.logspace(-3, 2, 7)[:, None, None]  # vectors of very different sizes
    q, scale = quantize_kv(x, FORMATS[name])
    assert q.dtype == FORMATS[name] and scale.shape == (7, 2)
    error = (dequantize_kv(q, scale, torch.float32) - x).abs()
    bound = scale[..., None] / 2 if name == "int8" else x.abs() / 16 + scale[..., None] * 2 ** -9
    assert (error <= bound + 1e-12).all()


@pytest.mark.parametrize("name", FORMATS)
def test_paths_equal_a_float_pool_holding_the_rounded_values(name):
    """Prefill (with a cached prefix) and decode over the quantized pool compute exactly what they compute over
    a float32 pool into which the same dequantized vectors were written."""
    gen = torch.Generator().manual_seed(0)
    pool = KVCache.allocate(TINY, num_blocks=9, block_size=4, dtype=torch.float32, device="cpu", kv_cache_dtype=name)
    plain = KVCache.allocate(TINY, num_blocks=9, block_size=4, dtype=torch.float32, device="cpu")
    k_cache, v_cache, k_scale, v_scale = pool.layer(0)
    table = torch.tensor([[5, 2, 7, 0]], dtype=torch.int32)
    k, v = torch.randn(13, 2, 16, generator=gen), torch.randn(13, 2, 16, generator=gen)
    slots = torch.tensor([int(table[0, p // 4]) * 4 + p % 4 for p in range(13)])
    store_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    store_kv(dequantize_kv(*quantize_kv(k, FORMATS[name]), torch.float32),
             dequantize_kv(*quantize_kv(v, FORMATS[name]), torch.float32), *plain.layer(0), slots)
    assert torch.equal(gather_kv(k_cache, table[0], 13, k_scale, torch.float32), gather_kv(plain.k[0], table[0], 13))
    q = torch.randn(1, 4, 16, generator=gen)
    part = _Part(table, torch.tensor([13], dtype=torch.int32), [1])
    ours = decode_attention(q, k_cache, v_cache, part, 0.25, k_scale, v_scale)
    torch.testing.assert_close(ours, decode_attention(q, *plain.layer(0), part, 0.25))
    qs = torch.randn(5, 4, 16, generator=gen)  # the last 5 tokens as a prefill chunk after 8 cached ones
    part = _Part(table, torch.tensor([13], dtype=torch.int32), [5])
    ours = prefill_attention(qs, k[8:], v[8:], k_cache, v_cache, part, 0.25, k_scale, v_scale)
    torch.testing.assert_close(ours, prefill_attention(qs, k[8:], v[8:], *plain.layer(0), part, 0.25))


def test_capacity_and_copy_on_write():
    fp32 = kv_block_bytes(TINY, 16, torch.float32)
    assert kv_block_bytes(TINY, 16, torch.float32, "int8") == fp32 // 4 + 2 * 2 * 16 * 2 * 4  # values + scales
    budget = 1 << 20  # a 4-byte scale per 16-value vector: 4 / (1 + 4/16) = 3.2 times the tokens
    fp32_blocks = blocks_for_budget(TINY, 16, torch.float32, budget)
    assert blocks_for_budget(TINY, 16, torch.float32, budget, "int8") == int(3.2 * fp32_blocks)
    pool = KVCache.allocate(TINY, 4, 4, torch.float32, "cpu", "fp8")
    assert pool.nbytes == 4 * kv_block_bytes(TINY, 4, torch.float32, "fp8") and pool.quantized
    pool.k_scale[:, 1] = 3.0
    pool.k[:, 1] = 1.0
    pool.copy_block(1, 3)
    assert (pool.k_scale[:, 3] == 3.0).all() and (pool.k[:, 3].float() == 1.0).all()
    with pytest.raises(ValueError, match="'int4'"):
        KVCache.allocate(TINY, 4, 4, torch.float32, "cpu", "int4")


@pytest.mark.parametrize("name", FORMATS)
def test_engine_with_a_quantized_cache(tiny_llama, name):
    """Greedy outputs: close to the float cache's, identical batched and alone, identical with a cached prefix;
    every block is free afterwards."""
    base = LLM(tiny_llama, device="cpu", dtype=torch.float32, num_kv_blocks=64, block_size=4)
    llm = LLM(tiny_llama, device="cpu", dtype=torch.float32, num_kv_blocks=64, block_size=4, kv_cache_dtype=name)
    assert llm.stats()["kv_cache_dtype"] == name and llm.engine.kv_cache.quantized
    prompts = [list(range(5, 30)), list(range(40, 47)), list(range(5, 30)) + [9, 9, 9]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    llm.reset_prefix_cache()
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert together == alone
    logits, want = llm.engine.next_token_logits(prompts[0]), base.engine.next_token_logits(prompts[0])
    assert (logits - want).abs().max() <= 0.05 * want.abs().max()
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
    with pytest.raises(ValueError, match="kv_cache_dtype 'float8'"):
        LLM(tiny_llama, device="cpu", kv_cache_dtype="float8")


def test_int8_cache_decodes_through_the_c_kernel(tiny_llama, monkeypatch):
    """The C kernel reads an int8 pool in place: the same greedy tokens as PyTorch's gather-then-dequantize."""
    if not cpu_kernel_available():
        pytest.skip("no C compiler to build the kernel with")
    monkeypatch.delenv("MINILLM_ATTENTION", raising=False)
    prompts = [list(range(5, 30)), list(range(40, 47))]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outputs = []
    for choice in ("auto", "torch"):
        monkeypatch.setenv("MINILLM_ATTENTION", choice)
        llm = LLM(tiny_llama, device="cpu", dtype=torch.float32, num_kv_blocks=64, block_size=4, kv_cache_dtype="int8")
        assert llm.engine.runner.use_cpu_kernel == (choice == "auto")
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outputs[0] == outputs[1]
