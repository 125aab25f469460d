"""Pruning: exact masks, the engine after pruning against transformers running the same pruned weights (so the
repacked oneDNN copies and the shrunk shapes are what the engine computes with), and clear errors."""

import pytest
import torch
import transformers

from conftest import requires_default_model
from hf_reference import hf_greedy
from minillm import LLM, SamplingParams, pruning
from minillm.layers import rms_norm
from tiny_models import CORPUS

PROMPT = "Prefill builds the cache; decode reads it. The quick brown fox jumps over the lazy dog."
CALIBRATION = " ".join(CORPUS)
PRUNINGS = {
    "unstructured": lambda llm: pruning.prune_magnitude(llm, 0.5),
    "2:4": lambda llm: pruning.prune_n_m(llm, 2, 4),
    "mlp": lambda llm: pruning.prune_mlp_channels(llm, 0.25),
    "heads": lambda llm: pruning.prune_attention_heads(llm, 1),
    "unstructured-calibrated": lambda llm: pruning.prune_magnitude(llm, 0.5, pruning.calibrate(llm, CALIBRATION)),
    "mlp-calibrated": lambda llm: pruning.prune_mlp_channels(llm, 0.25, pruning.calibrate(llm, CALIBRATION)),
    "heads-calibrated": lambda llm: pruning.prune_attention_heads(llm, 1, pruning.calibrate(llm, CALIBRATION)),
}


def make_llm(path) -> LLM:
    return LLM(path, device="cpu", dtype=torch.float32, num_kv_blocks=64, block_size=4)


def hf_model_of(llm: LLM):
    """A transformers model holding the engine's current weights (fused projections split back, sizes as now)."""
    model, path = llm.engine.model, llm.engine.path
    config = transformers.AutoConfig.from_pretrained(str(path))
    config.head_dim = model.config.head_dim
    config.num_attention_heads, config.intermediate_size = model.config.num_heads, model.config.intermediate_size
    state = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight,
             "lm_head.weight": (model.lm_head or model.embed_tokens).weight}
    for i, layer in enumerate(model.layers):
        attn, mlp, prefix = layer.self_attn, layer.mlp, f"model.layers.{i}."
        sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        for kind in ("weight", "bias"):
            fused = getattr(attn.qkv_proj, kind)
            for name, part in zip("qkv", () if fused is None else fused.split(sizes)):
                state[prefix + f"self_attn.{name}_proj.{kind}"] = part
        gate, up = mlp.gate_up_proj.weight.chunk(2)
        state.update({prefix + "self_attn.o_proj.weight": attn.o_proj.weight,
                      prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up,
                      prefix + "mlp.down_proj.weight": mlp.down_proj.weight,
                      prefix + "input_layernorm.weight": layer.input_layernorm.weight,
                      prefix + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight})
    hf = transformers.AutoModelForCausalLM.from_config(config)
    hf.load_state_dict({k: v.detach().clone() for k, v in state.items()})
    return hf.eval()


def test_magnitude_mask_drops_exactly_the_smallest():
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    keep = pruning.magnitude_mask(w, 0.3)
    assert int((~keep).sum()) == round(0.3 * w.numel())
    assert w[~keep].abs().max() <= w[keep].abs().min()
    assert pruning.magnitude_mask(w, 0.0).all()


def test_magnitude_mask_drops_exactly_its_share_among_ties():
    w = torch.tensor([[0.5, -1.0, 0.5, 2.0], [0.5, 0.0, -0.5, 1.0]])  # four entries tie at the cut
    keep = pruning.magnitude_mask(w, 0.5)
    assert int((~keep).sum()) == 4
    assert w[~keep].abs().max() <= w[keep].abs().min()
    assert keep.tolist() == [[False, True, False, True], [False, False, True, True]]  # ties go in memory order


def test_n_m_mask_keeps_the_largest_of_every_group():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    keep = pruning.n_m_mask(w, 2, 4).view(8, 16, 4)
    groups = w.abs().view(8, 16, 4)
    assert (keep.sum(-1) == 2).all()
    kept_min = groups.masked_fill(~keep, float("inf")).amin(-1)
    dropped_max = groups.masked_fill(keep, -1.0).amax(-1)
    assert (dropped_max <= kept_min).all()


def test_unstructured_sparsity_is_exact_per_projection(tiny_llama):
    llm = make_llm(tiny_llama)
    result = pruning.prune_magnitude(llm, 0.5)
    for _, linear, rows in pruning._projections(llm.engine.model):
        for part in linear.weight.split(rows):
            assert int((part == 0).sum()) == round(0.5 * part.numel())
    assert result.pruned == result.linear_params // 2 and result.sparsity == 0.5
    assert 0 < result.model_fraction < result.sparsity


def test_2_4_holds_in_every_group_of_four(tiny_llama):
    llm = make_llm(tiny_llama)
    result = pruning.prune_n_m(llm)
    for _, linear, _ in pruning._projections(llm.engine.model):
        nonzero = (linear.weight != 0).view(linear.out_features, -1, 4).sum(-1)
        assert (nonzero <= 2).all()
    assert result.sparsity == 0.5


def test_calibration_measures_each_layer_input(tiny_llama):
    llm = make_llm(tiny_llama)
    ids = llm.get_tokenizer()(CALIBRATION).input_ids[:200]
    rms = pruning.calibrate(llm, ids, window=len(ids))
    model = llm.engine.model
    assert len(rms) == 4 * len(model.layers)
    for name, linear, _ in pruning._projections(model):
        assert rms[name].shape == (linear.in_features,) and (rms[name] > 0).all()
        assert "forward" not in vars(linear)  # the recording wrapper is gone
    with torch.no_grad():  # the first projection reads the normed embeddings of the calibration tokens
        x = model.embed_tokens(torch.tensor(ids))
        x = rms_norm(x, model.layers[0].input_layernorm.weight, model.config.rms_norm_eps)
    torch.testing.assert_close(rms["layers.0.self_attn.qkv_proj"], x.square().mean(0).sqrt())


def test_calibrated_scores_weigh_each_weight_by_its_input(tiny_llama):
    llm, plain = make_llm(tiny_llama), make_llm(tiny_llama)
    names = [name for name, _, _ in pruning._projections(llm.engine.model)]
    ones = {name: torch.ones(linear.in_features) for name, linear, _ in pruning._projections(llm.engine.model)}
    pruning.prune_magnitude(llm, 0.4, ones)  # equal inputs: the same choice as magnitude alone
    pruning.prune_magnitude(plain, 0.4)
    assert all(torch.equal(a, b) for a, b in zip(llm.engine.model.parameters(), plain.engine.model.parameters()))
    # a large input protects the weights that read it: the 2:4 pattern then keeps input 3 of every group
    llm = make_llm(tiny_llama)
    boost = {name: torch.tensor([1.0, 1.0, 1.0, 1e6]).repeat(t.numel() // 4) for name, t in ones.items()}
    pruning.prune_n_m(llm, 2, 4, boost)
    for _, linear, _ in pruning._projections(llm.engine.model):
        groups = (linear.weight != 0).view(linear.out_features, -1, 4)
        assert groups[..., 3].all() and (groups.sum(-1) <= 2).all()
    with pytest.raises(ValueError, match="no entry for"):
        pruning.prune_mlp_channels(make_llm(tiny_llama), 0.25, {names[0]: ones[names[0]]})


@pytest.mark.parametrize("kind", PRUNINGS)
def test_pruned_engine_matches_transformers_with_the_same_weights(tiny_llama, kind):
    llm = make_llm(tiny_llama)
    ids = llm.get_tokenizer()(PROMPT).input_ids
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    llm.generate([ids], params, use_tqdm=False)  # fills the prefix cache with keys and values of the old weights
    before = llm.engine.next_token_logits(ids)
    assert llm.engine.model.layers[0].self_attn.qkv_proj.packed is not None  # the engine computes on packed copies
    PRUNINGS[kind](llm)
    hf = hf_model_of(llm)
    expected, ref_logits = hf_greedy(hf, ids, 12)
    after = llm.engine.next_token_logits(ids)
    assert (after - before).abs().max() > 1e-2  # pruning changed the model's scores...
    torch.testing.assert_close(after, ref_logits, atol=1e-4, rtol=0)  # ...to those of the pruned weights
    assert llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_structured_pruning_in_every_family(tiny_any):
    """Heads and MLP channels cut from each supported family (a q/k/v bias, an untied head) match transformers."""
    llm = make_llm(tiny_any)
    rms = pruning.calibrate(llm, CALIBRATION)
    pruning.prune_attention_heads(llm, 1, rms)
    pruning.prune_mlp_channels(llm, 0.5, rms)
    ids = llm.get_tokenizer()(PROMPT).input_ids
    expected, ref_logits = hf_greedy(hf_model_of(llm), ids, 12)
    torch.testing.assert_close(llm.engine.next_token_logits(ids), ref_logits, atol=1e-4, rtol=0)
    out = llm.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected


def test_mlp_channels_shrink_the_matrices(tiny_llama):
    llm = make_llm(tiny_llama)
    model = llm.engine.model
    before = sum(p.numel() for p in model.parameters())
    result = pruning.prune_mlp_channels(llm, 0.25)
    assert model.config.intermediate_size == llm.engine.config.intermediate_size == 96
    for i, layer in enumerate(model.layers):
        assert layer.mlp.gate_up_proj.weight.shape == (192, 64) and layer.mlp.gate_up_proj.out_features == 192
        assert layer.mlp.down_proj.weight.shape == (64, 96) and layer.mlp.down_proj.in_features == 96
        assert len(result.removed[i]) == 32
    assert result.pruned == before - sum(p.numel() for p in model.parameters()) == 2 * 32 * 3 * 64
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8


def test_heads_go_evenly_from_each_kv_group(tiny_llama):
    llm = make_llm(tiny_llama)
    model = llm.engine.model
    scores = [pruning.head_scores(layer.self_attn) for layer in model.layers]
    result = pruning.prune_attention_heads(llm, 1)
    assert model.config.num_heads == 2
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        assert attn.num_heads == 2 and attn.q_size == 32
        assert attn.qkv_proj.weight.shape == (6 * 16, 64) and attn.o_proj.weight.shape == (64, 32)
        # one head per group of two (heads 0-1 read KV head 0, heads 2-3 KV head 1), the weaker one
        assert [h // 2 for h in result.removed[i]] == [0, 1]
        assert all(scores[i][h] <= scores[i][h ^ 1] for h in result.removed[i])
    assert result.pruned == 2 * 2 * (16 * 64 + 64 * 16)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan"), "0.5", True])
def test_bad_sparsity_is_refused(tiny_llama, bad):
    llm = make_llm(tiny_llama)
    weights = [p.clone() for p in llm.engine.model.parameters()]
    for call in (pruning.prune_magnitude, pruning.prune_mlp_channels):
        with pytest.raises(ValueError, match="must be a number in"):
            call(llm, bad)
    assert all(torch.equal(a, b) for a, b in zip(weights, llm.engine.model.parameters()))


def test_other_bad_arguments_are_refused(tiny_llama):
    llm = make_llm(tiny_llama)
    with pytest.raises(ValueError, match="0 < n < m"):
        pruning.prune_n_m(llm, 4, 4)
    with pytest.raises(ValueError, match="multiple of m"):
        pruning.n_m_mask(torch.randn(4, 6))
    with pytest.raises(ValueError, match="per_group"):
        pruning.prune_attention_heads(llm, 2)  # would empty every KV group
    with pytest.raises(ValueError, match="all 128 MLP channels"):
        pruning.prune_mlp_channels(llm, 0.999)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        pruning.calibrate(llm, [5])
    llm.engine.add_request(None, PROMPT, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="unfinished requests"):
        pruning.prune_magnitude(llm, 0.5)
    quantized = LLM(tiny_llama, device="cpu", dtype=torch.float32, num_kv_blocks=64, quantization="int8")
    with pytest.raises(ValueError, match="prune before quantizing"):
        pruning.prune_n_m(quantized)


@requires_default_model
@pytest.mark.slow
def test_default_model_calibration_chooses_better_weights():
    """On the real model, held-out text: 2:4 sparsity and a tenth of the MLP channels cost far less perplexity when
    each weight is scored by the size of its input than by its magnitude alone."""
    from minillm.perplexity import eval_text, perplexity

    sections = eval_text().split("\n## ")
    calibration, held_out = "\n## ".join(sections[0::2]), "\n## ".join(sections[1::2])
    llm = LLM(device="cpu", dtype=torch.float32, num_kv_blocks=256)
    dense = perplexity(llm, held_out, max_tokens=512).perplexity
    rms = pruning.calibrate(llm, calibration)
    for prune in (lambda llm, rms: pruning.prune_n_m(llm, 2, 4, rms),
                  lambda llm, rms: pruning.prune_mlp_channels(llm, 0.1, rms)):
        results = []
        for scores in (None, rms):
            llm = LLM(device="cpu", dtype=torch.float32, num_kv_blocks=256)
            prune(llm, scores)
            results.append(perplexity(llm, held_out, max_tokens=512).perplexity)
        plain, calibrated = results
        assert dense < calibrated < plain / 2
