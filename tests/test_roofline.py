"""The roofline counts against FLOPs measured by torch's FlopCounterMode, and the memory-budget numbers."""

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from conftest import requires_default_model
from minillm import LLM, SamplingParams
from minillm import roofline as rl
from minillm.config import ModelConfig

LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
                      max_position_embeddings=8192, tie_word_embeddings=True)


def count_flops(llm, prompts, max_tokens):
    """Run the prompts through `LLMEngine.step`, each step under FlopCounterMode (attention through the math
    kernel, whose matmuls the counter sees); returns one {"mm": .., "bmm": ..} per step, prefill first."""
    engine, steps = llm.engine, []
    for prompt in prompts:
        engine.add_request(None, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        counter = FlopCounterMode(display=False)
        with counter, sdpa_kernel(SDPBackend.MATH):
            engine.step()
        steps.append({str(op).removeprefix("aten."): n for op, n in counter.get_flop_counts()["Global"].items()})
    return steps


def matmul_flops(ops):
    """Our counts, split as the counter splits them: linear layers (aten.mm) and attention's two matmuls."""
    by_name = {op.name: op for op in ops}
    linear = sum(by_name[n].flops * by_name[n].repeat for n in LINEARS)
    values = by_name["attn_values"]  # q.k and p.v do the same number of multiply-adds
    return linear, 2 * values.flops * values.repeat


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return LLM(tiny_llama, device="cpu", dtype=torch.float32, enable_prefix_caching=False)


def test_prefill_flops_match_flop_counter(tiny):
    config = tiny.engine.config
    lens = [20, 40]
    (counted,) = count_flops(tiny, [[5] * n for n in lens], 1)  # both prompts in one step, one token each
    linear, attention = matmul_flops(rl.forward_costs(config, lens, lens))
    assert counted["mm"] == linear
    # the math kernel computes every (query, key) score and masks the upper triangle afterwards;
    # we count only the causal pairs, n(n+1)/2 of the n^2, as a flash kernel skips the rest
    full = 4 * config.num_heads * config.head_dim * sum(n * n for n in lens) * config.num_layers
    assert counted["bmm"] == full
    assert attention == full * sum(n * (n + 1) // 2 for n in lens) / sum(n * n for n in lens)


@pytest.mark.parametrize("batch", [1, 3])
def test_decode_flops_match_flop_counter(tiny, batch):
    config = tiny.engine.config
    _, counted, _ = count_flops(tiny, [[7] * 31] * batch, 3)  # context 32 at the first decode step: no block padding
    linear, attention = matmul_flops(rl.decode_costs(config, batch, 32))
    assert (counted["mm"], counted["bmm"]) == (linear, attention)


@requires_default_model
@pytest.mark.slow
def test_default_model_decode_flops_match_flop_counter(default_llm):
    config = default_llm.engine.config
    _, counted = count_flops(default_llm, [[42] * 47], 2)  # the decode step attends to 48 tokens
    assert (counted["mm"], counted["bmm"]) == matmul_flops(rl.decode_costs(config, 1, 48))


@pytest.mark.parametrize("config", [SMOLLM2, rl.LLAMA2_7B], ids=["smollm2", "llama2-7b"])
def test_decode_reads_every_weight_once(config):
    """One decode step reads each parameter once (the tied head counts the embedding matrix as the head's)."""
    for batch in (1, 8):
        weights = sum(op.weight_bytes * op.repeat for op in rl.decode_costs(config, batch, 100, dtype_bytes=2))
        embedding_rows = (batch - (0 if config.tie_word_embeddings else config.vocab_size)) * config.hidden_size
        assert weights == 2 * (config.num_params + embedding_rows)


def test_intensity_decode_far_below_prefill():
    for config in (SMOLLM2, rl.LLAMA2_7B):
        decode = rl.arithmetic_intensity(rl.decode_costs(config, 1, 512))
        prefill = rl.arithmetic_intensity(rl.prefill_costs(config, 512))
        assert decode < 2 and prefill > 100  # bf16 decode: about 2 FLOPs per 2-byte weight
        batched = [rl.arithmetic_intensity(rl.decode_costs(config, b, 512)) for b in (1, 4, 16, 64)]
        assert batched == sorted(batched) and batched[-1] > 10 * batched[0]
    assert rl.arithmetic_intensity(rl.decode_costs(SMOLLM2, 1, 1, dtype_bytes=4)) == pytest.approx(0.5, rel=0.01)


def test_causal_pairs_and_cached_prefix():
    ops = {op.name: op for op in rl.forward_costs(SMOLLM2, [4, 1], [10, 7])}
    pairs = (4 * 6 + 4 * 5 // 2) + 7  # 4 new tokens after 6 cached: 7, 8, 9, 10 keys; plus a decode token on 7
    assert ops["attn_values"].flops == 2 * SMOLLM2.head_dim * SMOLLM2.num_heads * pairs
    assert ops["attn_values"].kv_bytes == 2 * (10 + 7) * SMOLLM2.num_kv_heads * SMOLLM2.head_dim
    assert ops["lm_head"].flops == 2 * 2 * SMOLLM2.hidden_size * SMOLLM2.vocab_size  # one row per sequence


def test_bad_lengths_are_rejected():
    with pytest.raises(ValueError, match="query_len <= context_len"):
        rl.forward_costs(SMOLLM2, [5], [4])
    with pytest.raises(ValueError, match="one query length"):
        rl.forward_costs(SMOLLM2, [1, 1], [4])


def test_memory_budget_of_7b_and_ours():
    rows = {r["model"]: r for r in rl.memory_budget({"7B": rl.LLAMA2_7B, "ours": SMOLLM2})}
    seven = rows["7B"]
    assert seven["params"] == 6_738_415_616  # Llama-2-7B's published parameter count
    assert 13e9 < seven["bf16"] < 14e9 and 26e9 < seven["fp32"] < 28e9
    assert seven["fp32"] == 2 * seven["bf16"] == 4 * seven["int8"] == 8 * seven["int4"]
    assert seven["kv_per_token"] == 32 * 32 * 128 * 2 * 2  # layers x kv heads x head dim x (K, V) x bf16
    assert rows["ours"]["params"] == 134_515_008 and rows["ours"]["fp32"] == pytest.approx(538e6, rel=1e-3)
    with pytest.raises(ValueError, match="weight format"):
        rl.weight_bytes(SMOLLM2, "fp8")


def test_ridge_point_and_roofline():
    peak, bw = 100e9, 20e9
    assert rl.ridge_point(peak, bw) == 5.0
    assert list(rl.attainable_flops([1.0, 5.0, 50.0], peak, bw)) == [20e9, 100e9, 100e9]


def test_measurements_are_positive_and_checked():
    for kind in ("copy", "triad", "read"):
        bw = rl.measure_bandwidth(kind, nbytes=1 << 22, device="cpu", repeats=3)
        assert math.isfinite(bw) and bw > 1e8
    assert rl.measure_matmul_flops(n=128, device="cpu", repeats=3) > 1e8
    with pytest.raises(ValueError, match="bandwidth kernel"):
        rl.measure_bandwidth("scale", nbytes=1 << 20)


def test_interleaved_timing_takes_turns():
    calls = []
    fns = [lambda i=i: calls.append(i) for i in range(3)]
    times = rl.time_interleaved(fns, repeats=3, warmup=1)
    assert [len(t) for t in times] == [3, 3, 3] and all(t >= 0 for ts in times for t in ts)
    # one warm-up round in order, then each repeat starts one function later
    assert calls == [0, 1, 2, 0, 1, 2, 1, 2, 0, 2, 0, 1]


def test_cache_bandwidth_rereads_a_small_working_set():
    small = rl.measure_cache_bandwidth(1 << 14, device="cpu", read_bytes=1 << 22, repeats=3)
    assert math.isfinite(small) and small > 1e8
    with pytest.raises(ValueError, match="at least one float32"):
        rl.measure_cache_bandwidth(2)


def test_cpu_cache_sizes_from_sysfs(tmp_path):
    for i, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"),
                                             (3, "Unified", "32M")]):
        index = tmp_path / f"index{i}"
        index.mkdir()
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (index / name).write_text(f"{value}\n")
    assert rl.cpu_cache_sizes(str(tmp_path)) == {"L1d": 48 << 10, "L2": 1 << 20, "L3": 32 << 20}
    assert rl.cpu_cache_sizes(str(tmp_path / "absent")) == {}


def test_int8_peak_counts_real_multiply_adds():
    """The peak's loop is not optimized away: its accumulators end where the dot products put them."""
    from minillm.kernels.int4_cpu import int4_cpu_isa

    isa, lib = int4_cpu_isa(), rl.int8_peak_library()
    if isa not in ("avx512vnni", "avx2") or lib is None:
        pytest.skip(f"the kernel multiplies with {isa} here")
    import ctypes

    threads, iters, sink = torch.get_num_threads(), 100, ctypes.c_int32(0)
    macs = lib.int8_macs(iters, ctypes.byref(sink))
    # thread t's chains c start every 32-bit lane at c and add, each round, the products of 3s and (t + 1)s: 4 of
    # them a lane (vpdpbusd: 16 lanes, 12 chains) or, with AVX2, 4 (c + 1) (t + 1) (8 lanes, 4 chains, each
    # "round" of iters eight rounds of products)
    tsum = threads * (threads + 1) // 2
    if isa == "avx512vnni":
        assert macs == threads * iters * 12 * 64
        assert sink.value == threads * 16 * 66 + 16 * 12 * 12 * iters * tsum
    else:
        assert macs == threads * iters * 8 * 4 * 32
        assert sink.value == threads * 8 * 6 + 8 * 4 * 10 * 8 * iters * tsum
    assert rl.measure_int8_peak(seconds=0.02, amx=False) > 1e9
    sink.value = 0
    if lib.int8_macs_amx(iters, ctypes.byref(sink)) == 0:
        return  # no AMX here: the kernel never uses it either
    # AMX: 4 tiles of 16 x 16 sums start at 0 and add, each round, 32 products of 3s and (t + 1)s
    sink.value = 0
    assert lib.int8_macs_amx(iters, ctypes.byref(sink)) == threads * iters * 4 * 16 * 16 * 32
    assert sink.value == 4 * 256 * 32 * 3 * iters * tsum
    assert rl.measure_int8_peak(seconds=0.02, amx=True) > rl.measure_int8_peak(seconds=0.02, amx=False)


def test_batched_steps_start_pair_and_free(tiny, tiny_llama):
    engine = tiny.engine
    free = engine.block_manager.num_free_blocks
    ids = rl.start_decoding(engine, 3, 20, torch.Generator().manual_seed(0))
    assert len(ids) == 3 and all(s.num_uncomputed_tokens == 1 for s in engine.scheduler.running)
    from minillm.kv_cache import kv_block_bytes

    per_token = kv_block_bytes(engine.config, engine.args.block_size, engine.dtype) / engine.args.block_size
    tokens = sum(s.num_tokens for s in engine.scheduler.running)
    assert rl.running_kv_bytes(engine) == per_token * tokens
    assert rl.running_step_bytes(engine) == rl.step_weight_bytes(engine.model) + per_token * tokens
    steps, products = rl.paired_steps(engine, rl.matvec_step(engine.model, 3), 2)
    assert len(steps) == len(products) == 2 and min(steps + products) > 0
    ways = rl.alternated_steps(engine, rl.matvec_step(engine.model, 3), 2)  # in one call and layer by layer
    assert {way: tuple(map(len, times)) for way, times in ways.items()} == {True: (2, 2), False: (2, 2)}
    assert engine.model.use_fused_step  # as it was
    for rid in ids:
        engine.abort(rid)
    assert not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks == free
    small = LLM(tiny_llama, device="cpu", dtype=torch.float32, max_num_seqs=4, enable_prefix_caching=False)
    with pytest.raises(RuntimeError, match="of 6 requests decode at once"):
        rl.start_decoding(small.engine, 6, 20, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("tie", [True, False])
def test_step_parts_count_each_call_in_one_part(tmp_path, tie):
    """decode_batch's breakdown: with a clock that ticks once per reading, each timed call lasts one tick, so a
    part's total counts its calls; an untied head's product counts under the head only, not under products too."""
    from types import SimpleNamespace

    from benchmarks import decode_batch
    from tiny_models import build_tiny_model

    llm = LLM(build_tiny_model(tmp_path / "m", tie=tie), device="cpu", dtype=torch.float32,
              enable_prefix_caching=False)
    engine, layers = llm.engine, llm.engine.config.num_layers
    ids = rl.start_decoding(engine, 2, 20, torch.Generator().manual_seed(0))
    ticks = iter(range(10**6))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode_batch, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
        parts = decode_batch.step_parts(engine, 3)
    assert (parts["products"], parts["head"], parts["norms"]) == (4 * layers, 1, 2 * layers + 1)
    for rid in ids:
        engine.abort(rid)
