"""Grader for exercise 2: your FLOP and byte counts against minillm.roofline's, op by op, on several model shapes."""

import pytest

from minillm.config import ModelConfig


def config(vocab, hidden, inter, layers, heads, kv_heads, head_dim, tie=True, bias=False):
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                       rope_theta=1e4, max_position_embeddings=4096, tie_word_embeddings=tie, qkv_bias=bias)


TINY = config(320, 64, 128, 2, 4, 2, 16)
SMOLLM2 = config(49152, 576, 1536, 30, 9, 3, 64)
LLAMA2_7B = config(32000, 4096, 11008, 32, 32, 32, 128, tie=False)
QWEN_BIAS = config(151936, 896, 4864, 24, 14, 2, 64, bias=True)
ODD_HEAD_DIM = config(1000, 128, 352, 3, 4, 1, 48)  # head_dim is not hidden / heads
CONFIGS = {"tiny": TINY, "smollm2": SMOLLM2, "llama2-7b": LLAMA2_7B, "qwen-bias": QWEN_BIAS, "odd-head-dim": ODD_HEAD_DIM}

# (query_lens, context_lens): fresh prompts, decode batches, and mixed steps with cached prefixes
BATCHES = {"prefill of 1 token": ([1], [1]), "prefill of 7": ([7], [7]), "two prompts": ([3, 10], [3, 10]),
           "decode batch 3, context 50": ([1] * 3, [50] * 3), "decode, uneven contexts": ([1, 1], [9, 200]),
           "4 new after 6 cached + a decode": ([4, 1], [10, 7])}
FIELDS = ("flops", "weight_bytes", "act_bytes", "kv_bytes", "repeat")
NAMES = ["embed_tokens", "rms_norm x2", "qkv_proj", "rope", "store_kv", "attn_scores", "attn_values", "o_proj",
         "residual x2", "gate_up_proj", "silu_and_mul", "down_proj", "final_norm", "lm_head"]


def compare(impl_ops, ref_ops, names, where):
    """Every field of the named ops equal (up to float rounding), with a message naming op, field and case."""
    got = {op.name: op for op in impl_ops}
    for want in ref_ops:
        if want.name not in names:
            continue
        assert want.name in got, f"{where}: no op named {want.name!r} (names: {sorted(got)})"
        for field in FIELDS:
            g, w = getattr(got[want.name], field), getattr(want, field)
            assert g == pytest.approx(w, rel=1e-9), f"{where}: {want.name}.{field} = {g}, expected {w}"


def check_all(impl, ref, names, dtype_bytes=2, weight_bytes=None):
    for cname, cfg in CONFIGS.items():
        for bname, (q, c) in BATCHES.items():
            compare(impl.forward_costs(cfg, q, c, dtype_bytes, weight_bytes),
                    ref.forward_costs(cfg, q, c, dtype_bytes, weight_bytes), names,
                    f"{cname}, {bname}, dtype_bytes={dtype_bytes}, weight_bytes={weight_bytes}")


@pytest.mark.points(3)
def test_linear_layers(impl, ref):
    check_all(impl, ref, {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"})


@pytest.mark.points(3)
def test_attention(impl, ref):
    check_all(impl, ref, {"store_kv", "attn_scores", "attn_values"})


@pytest.mark.points(2)
def test_embedding_final_norm_and_head(impl, ref):
    check_all(impl, ref, {"embed_tokens", "final_norm", "lm_head"})
    many = [100] * 5  # 500 new tokens, more than TINY's 320 vocabulary rows
    compare(impl.forward_costs(TINY, many, many), ref.forward_costs(TINY, many, many), {"embed_tokens"},
            "tiny, 5 prompts of 100 tokens (more tokens than embedding rows)")


@pytest.mark.points(1)
def test_elementwise_ops(impl, ref):
    check_all(impl, ref, {"rms_norm x2", "rope", "residual x2", "silu_and_mul"})


@pytest.mark.points(1)
def test_op_order_and_repeat(impl, ref):
    ops = impl.forward_costs(SMOLLM2, [5], [5])
    assert [op.name for op in ops] == NAMES, f"ops must come in the order of the table, got {[op.name for op in ops]}"
    want = {op.name: op.repeat for op in ref.forward_costs(SMOLLM2, [5], [5])}
    assert {op.name: op.repeat for op in ops} == want, "repeat: num_layers for ops inside a block, 1 outside"


@pytest.mark.points(1)
def test_dtype_and_weight_bytes(impl, ref):
    check_all(impl, ref, set(NAMES), dtype_bytes=4)
    check_all(impl, ref, set(NAMES), dtype_bytes=2, weight_bytes=0.5)  # int4 weights, bf16 activations


@pytest.mark.points(1)
def test_prefill_and_decode_wrappers(impl, ref):
    for cname, cfg in CONFIGS.items():
        for n, seqs in [(1, 1), (33, 1), (16, 3)]:
            compare(impl.prefill_costs(cfg, n, 2, seqs), ref.prefill_costs(cfg, n, 2, seqs), set(NAMES),
                    f"{cname}: prefill_costs({n} tokens, {seqs} sequences)")
        for batch, ctx in [(1, 1), (1, 300), (8, 64)]:
            compare(impl.decode_costs(cfg, batch, ctx, 4), ref.decode_costs(cfg, batch, ctx, 4), set(NAMES),
                    f"{cname}: decode_costs(batch {batch}, context {ctx}, fp32)")


@pytest.mark.points(2)
def test_totals_and_intensity(impl, ref):
    for cname, cfg in CONFIGS.items():
        for ops, what in [(ref.prefill_costs(cfg, 128), "prefill of 128"), (ref.decode_costs(cfg, 4, 700), "decode")]:
            for fn in ("total_flops", "total_bytes", "arithmetic_intensity"):
                got, want = getattr(impl, fn)(ops), getattr(ref, fn)(ops)
                assert got == pytest.approx(want, rel=1e-9), f"{cname}, {what}: {fn} = {got}, expected {want}"
    op = ref.OpCost("x", flops=10, weight_bytes=4, act_bytes=1, repeat=3)
    assert impl.total_flops([op]) == 30 and impl.total_bytes([op]) == 15, "multiply each op by its repeat"


@pytest.mark.points(1)
def test_ridge_point(impl, ref):
    for peak, bw in [(989e12, 4.8e12), (100e9, 20e9), (1.0, 3.0)]:
        assert impl.ridge_point(peak, bw) == pytest.approx(ref.ridge_point(peak, bw)), f"peak {peak:g}, bandwidth {bw:g}"


@pytest.mark.points(1)
def test_bad_lengths_raise(impl):
    for q, c in [([5], [4]), ([0], [3]), ([1, 1], [4]), ([], [])]:
        with pytest.raises(ValueError):
            impl.forward_costs(TINY, q, c)


@pytest.mark.points(1)
def test_decode_and_prefill_on_the_roofline(impl):
    for cname, cfg in CONFIGS.items():
        decode = impl.arithmetic_intensity(impl.decode_costs(cfg, 1, 512))
        prefill = impl.arithmetic_intensity(impl.prefill_costs(cfg, 512))
        assert decode < 2 < 20 < prefill, f"{cname}: bf16 decode should sit near 1 FLOP/byte, prefill far right"
        batched = [impl.arithmetic_intensity(impl.decode_costs(cfg, b, 512)) for b in (1, 2, 8, 32)]
        assert batched == sorted(batched), f"{cname}: batching decode must raise its intensity, got {batched}"
