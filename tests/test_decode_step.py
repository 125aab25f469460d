"""The fused decode step (`minillm/kernels/decode_step.c`) against the model's modules, layer by layer: the same
logits to the last bit, so the same greedy tokens, on a tiny model and on the default one, with the cache
left as the modules leave it; where it does not apply, the engine steps layer by layer."""

from dataclasses import replace

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.kernels.decode_step import FusedDecodeStep, decode_step_available
from minillm.kernels.int4_cpu import int4_cpu_amx
from minillm.perplexity import eval_text
from minillm.quant import use_c_kernel

from conftest import decode_outputs, requires_default_model

pytestmark = pytest.mark.skipif(not (decode_step_available() and use_c_kernel()),
                                reason="the C kernels do not build with a vector path here")
PROMPTS = [list(range(5, 30)), list(range(40, 47)), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]]


@pytest.mark.parametrize("method,group_size,kv", [("int4", 32, "auto"), ("int4", 64, "auto"), ("int8", None, "auto"),
                                                  ("int8", 32, "auto"), ("int4", 32, "int8"), ("int8", None, "int8")])
def test_fused_step_equals_the_modules_on_a_tiny_model(tiny_llama, method, group_size, kv):
    """Step by step, the same tokens and bit for bit the same logits: both ways run the same compiled code
    for every operation (`small_ops.c` and the two kernels), only the calls between them differ; over an int8
    cache too, whose vectors the fused step rounds as PyTorch's `quantize_kv` does."""
    llm = LLM(tiny_llama, device="cpu", dtype=torch.float32, num_kv_blocks=64, block_size=4,
              enable_prefix_caching=False, quantization=method, quantization_group_size=group_size,
              kv_cache_dtype=kv)
    assert llm.engine.model.fused_decode(llm.engine.kv_cache) is not None
    ids, fused = decode_outputs(llm, PROMPTS, 6, True)
    ref_ids, modules = decode_outputs(llm, PROMPTS, 6, False)
    assert ids == ref_ids and len(fused) == len(modules) == 5
    assert all(torch.equal(a, b) for a, b in zip(fused, modules))
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    from tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2",
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6})


@pytest.mark.parametrize("method,kv", [("int4", "auto"), ("int8", "int8")])
def test_fused_step_adds_the_qkv_bias_as_the_modules_do(tiny_qwen2, method, kv):
    """Qwen2's q/k/v product has a bias: the fused step adds it after the product, as the module does, so the
    logits stay bit for bit the same."""
    llm = LLM(tiny_qwen2, device="cpu", dtype=torch.float32, num_kv_blocks=64, block_size=4,
              enable_prefix_caching=False, quantization=method, quantization_group_size=32, kv_cache_dtype=kv)
    model, gen = llm.engine.model, torch.Generator().manual_seed(0)
    for layer in model.layers:  # the tiny checkpoint's biases are zeros, as a new model's are
        bias = layer.self_attn.qkv_proj.bias
        with torch.no_grad():
            bias.copy_(torch.randn(bias.shape, generator=gen))
    assert model.fused_decode(llm.engine.kv_cache) is not None
    ids, fused = decode_outputs(llm, PROMPTS, 6, True)
    ref_ids, modules = decode_outputs(llm, PROMPTS, 6, False)
    assert ids == ref_ids and len(fused) == len(modules) == 5
    assert all(torch.equal(a, b) for a, b in zip(fused, modules))


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_fused_step_writes_the_cache_the_modules_write(tiny_llama, kv):
    """After the same requests, every layer's cache holds the same keys (rotated) and values either way, bit for
    bit (the blocks are handed out in the same order); in an int8 cache, the same codes and the same scales."""
    pools = []
    for fused in (True, False):
        llm = LLM(tiny_llama, device="cpu", dtype=torch.float32, num_kv_blocks=64, block_size=4,
                  enable_prefix_caching=False, quantization="int4", quantization_group_size=32, kv_cache_dtype=kv)
        llm.engine.model.use_fused_step = fused
        llm.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
        pools.append([t.clone() for t in llm.engine.kv_cache.layer(0) + llm.engine.kv_cache.layer(1)])
    assert len(pools[0]) == (4 if kv == "auto" else 8)
    assert all(torch.equal(a, b) for a, b in zip(*pools))


@pytest.mark.parametrize("threads,kv", [(2, "auto"), (3, "int8"), (5, "auto")])
def test_one_sequence_s_heads_split_over_threads_change_no_bit(tiny_llama, threads, kv):
    """With fewer sequences than threads the fused step splits each sequence's attention by KV heads (the tiny
    model has 2: two parts at 2 threads or more, a thread left idle at 3 and 5); the tokens and every decode step's
    output stay those of the modules, which attend to all heads in one call."""
    before = torch.get_num_threads()
    llm = LLM(tiny_llama, device="cpu", dtype=torch.float32, num_kv_blocks=64, block_size=4,
              enable_prefix_caching=False, quantization="int4", quantization_group_size=32, kv_cache_dtype=kv)
    torch.set_num_threads(threads)
    try:
        ids, fused = decode_outputs(llm, PROMPTS[:1], 6, True)
        ref_ids, modules = decode_outputs(llm, PROMPTS[:1], 6, False)
    finally:
        torch.set_num_threads(before)
    assert ids == ref_ids and len(fused) == len(modules) == 5
    assert all(torch.equal(a, b) for a, b in zip(fused, modules))


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_amx_changes_no_bit_of_a_batched_step(tiny_llama, method):
    """18 sequences decoding together: with AMX (where there is one) the fused step's products take the first 16
    rows to tiles; turned off, the same tokens and every decode step's output to the bit."""
    if not int4_cpu_amx():
        pytest.skip("no AMX here (the CPU, the build or Linux)")
    llm = LLM(tiny_llama, device="cpu", dtype=torch.float32, num_kv_blocks=128, block_size=4, max_num_seqs=18,
              enable_prefix_caching=False, quantization=method)
    prompts = [list(range(5 + i, 12 + 2 * i)) for i in range(18)]
    try:
        on = decode_outputs(llm, prompts, 4, True)
        int4_cpu_amx(False)
        off = decode_outputs(llm, prompts, 4, True)
    finally:
        int4_cpu_amx(True)
    assert on[0] == off[0] and len(on[1]) == 3 and all(torch.equal(a, b) for a, b in zip(on[1], off[1]))


@requires_default_model
@pytest.mark.slow
@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_fused_step_gives_the_default_model_s_tokens(kv):
    """16 prompts decoded together, 8 tokens each: the same tokens fused as layer by layer, and every decode
    step's output bit for bit the same, over a float32 cache and over an int8 one."""
    llm = LLM(device="cpu", dtype=torch.float32, enable_prefix_caching=False, quantization="int4",
              kv_cache_dtype=kv)
    ids = llm.get_tokenizer()(eval_text()).input_ids
    prompts = [ids[i * 37:i * 37 + 20 + i] for i in range(16)]
    (fused, fused_x), (modules, modules_x) = (decode_outputs(llm, prompts, 8, f) for f in (True, False))
    assert fused == modules
    assert len(fused_x) == 7 and all(torch.equal(a, b) for a, b in zip(fused_x, modules_x))


def test_where_the_fused_step_does_not_apply_the_engine_steps_layer_by_layer(tiny_llama, monkeypatch):
    args = dict(device="cpu", dtype=torch.float32, num_kv_blocks=32, block_size=4)
    for kwargs in (dict(quantization="fp8"), dict(quantization="int4", kv_cache_dtype="fp8")):
        llm = LLM(tiny_llama, **args, **kwargs)
        assert llm.engine.model.fused_decode(llm.engine.kv_cache) is None, kwargs
        assert len(llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids) == 3
    monkeypatch.setenv("MINILLM_FUSED_STEP", "0")
    assert not LLM(tiny_llama, **args, quantization="int4", quantization_group_size=32).engine.model.use_fused_step


def test_fused_step_checks_what_it_is_built_from(tiny_llama):
    llm = LLM(tiny_llama, device="cpu", dtype=torch.float32, num_kv_blocks=32, block_size=4,
              quantization="int4", quantization_group_size=32)
    model, cache = llm.engine.model, llm.engine.kv_cache
    step = model.fused_decode(cache)
    layers, caches, cos, sin, ends = step._keep
    heads = model.layers[0].self_attn.num_heads, model.layers[0].self_attn.num_kv_heads
    with pytest.raises(ValueError, match="one cache per layer"):
        FusedDecodeStep(layers, caches[:1], cos, sin, 1e-5, *heads)
    with pytest.raises(ValueError, match="float32 \\(k, v\\) or int8"):
        FusedDecodeStep(layers, [(k.half(), v) for k, v in caches], cos, sin, 1e-5, *heads)
    with pytest.raises(ValueError, match="int8 \\(k, v, k_scale, v_scale\\)"):
        FusedDecodeStep(layers, [(k.to(torch.int8), v.to(torch.int8)) for k, v in caches], cos, sin, 1e-5, *heads)
    with pytest.raises(ValueError, match="v scales must be contiguous torch.float32"):
        FusedDecodeStep(layers, [(k.to(torch.int8), v.to(torch.int8), k[..., 0].contiguous(), k[..., :2])
                                 for k, v in caches], cos, sin, 1e-5, *heads)
    with pytest.raises(ValueError, match="expected"):
        FusedDecodeStep([replace(layers[0], qkv=layers[0].gate_up)] + layers[1:], caches, cos, sin, 1e-5, *heads)
    with pytest.raises(ValueError, match="ends.embed_scale must be contiguous torch.float32"):
        FusedDecodeStep(layers, caches, cos, sin, 1e-5, *heads, replace(ends, embed_scale=ends.embed_scale.double()))
    with pytest.raises(ValueError, match="the head takes"):
        FusedDecodeStep(layers, caches, cos, sin, 1e-5, *heads, replace(ends, head=layers[0].down))
    with pytest.raises(RuntimeError, match="without the model's ends"):
        FusedDecodeStep(layers, caches, cos, sin, 1e-5, *heads).logits(*[torch.zeros(1, dtype=torch.int64)] * 5)


@pytest.mark.parametrize("keep", [(), ("embed_tokens",)])
def test_the_step_s_ends_run_in_c_where_embedding_and_head_are_int8(tiny_llama, keep):
    """With the int8 embedding and head that int4 gives them, a decode step goes from token ids to logits in one
    call; a float32 embedding leaves both ends to the modules around a step of the layers only. Every decode step's
    logits are bit for bit the modules' either way, so are the tokens."""
    from minillm.quant import quantize_model

    llm = LLM(tiny_llama, device="cpu", dtype=torch.float32, num_kv_blocks=64, block_size=4,
              enable_prefix_caching=False)
    quantize_model(llm.engine.model, "int4", 32, keep=keep)
    step = llm.engine.model.fused_decode(llm.engine.kv_cache)
    assert isinstance(step, FusedDecodeStep) and (step.ends is not None) == (keep == ())
    model, layer_calls = llm.engine.model, []

    def run_layers(x, positions, kv_cache, meta):
        layer_calls.append(meta.prefill is None)
        return type(model).run_layers(model, x, positions, kv_cache, meta)

    model.run_layers = run_layers
    ids, fused = decode_outputs(llm, PROMPTS, 6, True)
    del model.run_layers
    ref_ids, modules = decode_outputs(llm, PROMPTS, 6, False)
    assert ids == ref_ids and len(fused) == len(modules) == 5
    assert all(torch.equal(a, b) for a, b in zip(fused, modules))
    assert layer_calls.count(True) == (0 if keep == () else 5)  # decode steps that went through run_layers
