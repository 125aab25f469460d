"""A float32 model's decode step in one C++ loop (`minillm/kernels/decode_layers.cpp`) against the model's modules,
layer by layer: the same logits to the last bit and the same cache, in every supported family, over a float32
and an int8 cache, on oneDNN's packed weights and on the plain ones; where it does not apply, layer by layer."""

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.kernels.decode_layers import DecodeLayers, decode_layers_available

from conftest import decode_outputs

pytestmark = pytest.mark.skipif(not decode_layers_available(), reason="no C++ compiler builds the loop here")
PROMPTS = [list(range(5, 30)), list(range(40, 47)), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]]


def engine(path, **kwargs):
    return LLM(path, **{**dict(device="cpu", dtype=torch.float32, num_kv_blocks=64, block_size=4,
                               enable_prefix_caching=False), **kwargs})


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_loop_equals_the_modules_in_every_family(tiny_any, kv):
    """Llama (tied and untied head), Qwen2 (a bias on q/k/v, made nonzero here) and Mistral: every decode step's
    last-layer output bit for bit what the modules give, so the same greedy tokens."""
    llm = engine(tiny_any, kv_cache_dtype=kv)
    model, gen = llm.engine.model, torch.Generator().manual_seed(0)
    for layer in model.layers:
        bias = layer.self_attn.qkv_proj.bias
        if bias is not None:  # the tiny checkpoint's biases are zeros, as a new model's are
            with torch.no_grad():
                bias.copy_(torch.randn(bias.shape, generator=gen))
            layer.self_attn.qkv_proj.pack()
    assert isinstance(model.fused_decode(llm.engine.kv_cache), DecodeLayers)
    ids, looped = decode_outputs(llm, PROMPTS, 6, True)
    ref_ids, modules = decode_outputs(llm, PROMPTS, 6, False)
    assert ids == ref_ids and len(looped) == len(modules) == 5
    assert all(torch.equal(a, b) for a, b in zip(looped, modules))
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


@pytest.mark.parametrize("min_rows", [1, 2, 10 ** 6])
def test_loop_takes_the_product_the_modules_take(tiny_llama, min_rows):
    """Products of fewer rows than `packed_min_rows` run through F.linear, the others on oneDNN's packed weights, in
    the loop as in `layers.Linear` (here with one sequence, then three, decoding): the same floats either way."""
    llm = engine(tiny_llama)
    for module in llm.engine.model.modules():
        if hasattr(module, "packed_min_rows") and hasattr(module, "pack"):
            module.packed_min_rows = min_rows
    ids, looped = decode_outputs(llm, [PROMPTS[1], PROMPTS[0], PROMPTS[2]], 8, True)
    ref_ids, modules = decode_outputs(llm, [PROMPTS[1], PROMPTS[0], PROMPTS[2]], 8, False)
    assert ids == ref_ids and all(torch.equal(a, b) for a, b in zip(looped, modules))


def test_loop_writes_the_cache_the_modules_write(tiny_llama):
    pools = []
    for fused in (True, False):
        llm = engine(tiny_llama)
        llm.engine.model.use_fused_step = fused
        llm.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
        pools.append([t.clone() for i in range(2) for t in llm.engine.kv_cache.layer(i)])
    assert all(torch.equal(a, b) for a, b in zip(*pools))


def test_loop_reads_weights_repacked_after_it_was_built(tiny_llama):
    """A layer whose weight changes and is packed again (as pruning does) is read anew at the next step."""
    llm = engine(tiny_llama)
    model = llm.engine.model
    step = model.fused_decode(llm.engine.kv_cache)
    down = model.layers[1].mlp.down_proj
    with torch.no_grad():
        down.weight.mul_(-2.0)
    down.pack()
    assert model.fused_decode(llm.engine.kv_cache) is step
    ids, looped = decode_outputs(llm, PROMPTS, 5, True)
    ref_ids, modules = decode_outputs(llm, PROMPTS, 5, False)
    assert ids == ref_ids and all(torch.equal(a, b) for a, b in zip(looped, modules))


def test_loop_follows_pruning(tiny_llama):
    """Structured pruning shrinks the layers in place (fewer query heads, fewer MLP channels, new weights): the loop
    built before reads them at the next step, as the modules do."""
    from minillm import pruning

    llm = engine(tiny_llama)
    model = llm.engine.model
    step = model.fused_decode(llm.engine.kv_cache)
    pruning.prune_attention_heads(llm, 1)
    pruning.prune_mlp_channels(llm, 0.25)
    assert model.fused_decode(llm.engine.kv_cache) is step
    ids, looped = decode_outputs(llm, PROMPTS, 5, True)
    ref_ids, modules = decode_outputs(llm, PROMPTS, 5, False)
    assert ids == ref_ids and all(torch.equal(a, b) for a, b in zip(looped, modules))


def test_where_the_loop_does_not_apply_the_engine_steps_another_way(tiny_llama):
    """Quantized products (the fused C step's, where it builds) and other types: never the float32 loop."""
    for kwargs in (dict(quantization="int8"), dict(quantization="fp8"), dict(kv_cache_dtype="fp8"),
                   dict(dtype=torch.bfloat16)):
        llm = engine(tiny_llama, **kwargs)
        assert not isinstance(llm.engine.model.fused_decode(llm.engine.kv_cache), DecodeLayers), kwargs
        assert len(llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids) == 3
