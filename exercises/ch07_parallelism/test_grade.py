"""Grader for exercise 7: your weight shards against minillm's; your parallel MLP on 2 and 3 gloo ranks against the
one-process MLP, with its all-reduces counted; your sort by expert and your combine against minillm's, and as the
dispatch and combine steps of minillm's expert-parallel MoE layer on 2 and 3 ranks against the one-process layer.

The ranks are separate processes (`run_group`); each loads your file anew from its path, and none outlives its
test, even when your code raises or hangs (`TIMEOUT_S`)."""

from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import minillm.moe
from exercises.conftest import _load
from minillm.config import ModelConfig
from minillm.moe import SparseMoeBlock
from minillm.parallel.comm import run_group

TIMEOUT_S = 30  # per group of ranks: a few seconds to start, the rest for your code
WORLD_SIZES = (2, 3)
HIDDEN, INTER = 40, 48  # INTER splits over 2 and 3 ranks; HIDDEN != INTER tells the two all-reducible products apart


def randn(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# --- shards ---------------------------------------------------------------------------------------------------------

@pytest.mark.points(1)
def test_shard_column(impl, ref):
    w = randn(12, 5, seed=0)
    for p in WORLD_SIZES:
        shards = [impl.shard_column(w, r, p) for r in range(p)]
        for r, shard in enumerate(shards):
            assert shard.shape == (12 // p, 5), f"rank {r} of {p}: shape {tuple(shard.shape)}, expected {(12 // p, 5)}"
            assert torch.equal(shard, ref.shard_column(w, r, p)), f"rank {r} of {p}: not the rank's block of rows"
        assert torch.equal(torch.cat(shards), w), f"{p} ranks: the shards, stacked in rank order, are not w"


@pytest.mark.points(2)
def test_shard_column_fused_parts(impl, ref):
    gate_up = randn(2 * 6, 5, seed=1)
    for p in WORLD_SIZES:
        gate, up = gate_up.split(6)
        n = 6 // p
        for r in range(p):
            shard = impl.shard_column(gate_up, r, p, [6, 6])
            assert torch.equal(shard, torch.cat([gate[r * n:(r + 1) * n], up[r * n:(r + 1) * n]])), (
                f"gate|up, rank {r} of {p}: expected the rank's rows of gate, then the same rows of up")
    qkv = randn(8 + 4 + 4, 3, seed=2).bfloat16()
    for r in range(2):
        shard = impl.shard_column(qkv, r, 2, [8, 4, 4])
        assert shard.dtype == torch.bfloat16, f"q|k|v: the shard is {shard.dtype}, w is bfloat16"
        assert torch.equal(shard, ref.shard_column(qkv, r, 2, [8, 4, 4])), (
            f"q|k|v of sizes [8, 4, 4], rank {r} of 2: not the rank's slice of each part, in order")


@pytest.mark.points(1)
def test_shard_row(impl, ref):
    w = randn(5, 12, seed=3)
    for p in WORLD_SIZES:
        shards = [impl.shard_row(w, r, p) for r in range(p)]
        for r, shard in enumerate(shards):
            assert shard.shape == (5, 12 // p), f"rank {r} of {p}: shape {tuple(shard.shape)}, expected {(5, 12 // p)}"
            assert torch.equal(shard, ref.shard_row(w, r, p)), f"rank {r} of {p}: not the rank's block of columns"
        assert torch.equal(torch.cat(shards, dim=1), w), f"{p} ranks: the shards, side by side in rank order, are not w"


@pytest.mark.points(1)
def test_shard_errors(impl):
    cases = [("shard_column of 10 rows over 3 ranks", impl.shard_column, (randn(10, 4, seed=4), 0, 3)),
             ("shard_column of parts [6, 5] over 2 ranks", impl.shard_column, (randn(11, 4, seed=5), 0, 2, [6, 5])),
             ("shard_row of 10 columns over 3 ranks", impl.shard_row, (randn(4, 10, seed=6), 2, 3))]
    for what, function, args in cases:
        with pytest.raises(ValueError):
            function(*args)
            pytest.fail(f"{what}: no ValueError")


# --- the MLP on 2 and 3 ranks ---------------------------------------------------------------------------------------

def mlp_weights():
    """x for two calls ([tokens, hidden] and [batch, tokens, hidden]), the fused gate|up weight and down's."""
    return ([randn(5, HIDDEN, seed=10), randn(2, 3, HIDDEN, seed=11)], randn(2 * INTER, HIDDEN, seed=12, scale=0.2),
            randn(HIDDEN, INTER, seed=13, scale=0.2))


def one_process_mlp(x, gate_up, down):
    gate, up = gate_up.split(INTER)
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def _mlp_rank(comm, impl_path, xs, gate_up_shards, down_shards):
    """Runs on each rank: your parallel_mlp on each x, with the collectives it ran: {op: (calls, bytes sent)}."""
    impl = _load(Path(impl_path), "_exercise_impl")
    results = []
    for x in xs:
        comm.stats.clear()
        out = impl.parallel_mlp(comm, x, gate_up_shards[comm.rank], down_shards[comm.rank])
        results.append((out, {op: (s.calls, s.bytes) for op, s in comm.stats.items() if s.calls}))
    return results


@pytest.fixture(scope="module")
def mlp_runs(impl, ref):
    """{world size: per rank, per x: (output, collectives)} from your parallel_mlp, given minillm's shards."""
    xs, gate_up, down = mlp_weights()
    runs = {}
    for p in WORLD_SIZES:
        gate_up_shards = [ref.shard_column(gate_up, r, p, [INTER, INTER]) for r in range(p)]
        down_shards = [ref.shard_row(down, r, p) for r in range(p)]
        runs[p] = run_group(_mlp_rank, p, impl.__file__, xs, gate_up_shards, down_shards, timeout=TIMEOUT_S)
    return runs


def check_mlp_outputs(runs):
    xs, gate_up, down = mlp_weights()
    for p, ranks in runs.items():
        for r, results in enumerate(ranks):
            for x, (out, _) in zip(xs, results):
                want = one_process_mlp(x, gate_up, down)
                assert isinstance(out, torch.Tensor) and out.shape == want.shape, (
                    f"rank {r} of {p}, x {list(x.shape)}: returned {getattr(out, 'shape', type(out).__name__)}, "
                    f"expected the whole output {list(want.shape)}")
                assert_close(out, want, atol=1e-5, rtol=1e-5,
                             msg=lambda e: f"rank {r} of {p}, x {list(x.shape)}, against the one-process MLP: {e}")


@pytest.mark.points(3)
def test_parallel_mlp_matches_one_process(impl, mlp_runs):
    check_mlp_outputs(mlp_runs)


@pytest.mark.points(2)
def test_parallel_mlp_one_all_reduce(impl, mlp_runs):
    check_mlp_outputs(mlp_runs)  # a wrong result earns nothing here, however little it communicates
    xs, _, _ = mlp_weights()
    for p, ranks in mlp_runs.items():
        for r, results in enumerate(ranks):
            for x, (_, comms) in zip(xs, results):
                output_bytes = 2 * (p - 1) * x.shape[:-1].numel() * HIDDEN * 4 // p
                ran = comms or "no collective through comm"
                assert comms == {"all_reduce": (1, output_bytes)}, (
                    f"rank {r} of {p}, x {list(x.shape)}: ran {ran} ({{op: (calls, bytes sent)}}); expected one "
                    f"comm.all_reduce, of the [..., {HIDDEN}] row-parallel product: "
                    f"{{'all_reduce': (1, {output_bytes})}}")


# --- sorting by expert and combining -------------------------------------------------------------------------------

def routing(tokens, num_experts, top_k, seed):
    """Each token's top_k distinct experts, drawn at random, and float32 routing weights summing to 1 per token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)]) if tokens else \
        torch.empty(0, top_k, dtype=torch.long)
    return ids, torch.rand(tokens, top_k, generator=g).softmax(dim=-1)


def check_sorted(impl, ref, ids, num_experts, what):
    order, counts = impl.sort_by_expert(ids, num_experts)
    want_order, want_counts = ref.sort_by_expert(ids, num_experts)
    for name, got, want in (("counts", counts, want_counts), ("order", order, want_order)):
        assert isinstance(got, torch.Tensor) and got.dtype == torch.int64 and got.shape == want.shape, (
            f"{what}: {name} is {getattr(got, 'dtype', type(got).__name__)} of shape "
            f"{tuple(getattr(got, 'shape', ()))}, expected int64 of shape {tuple(want.shape)}")
        assert torch.equal(got, want), f"{what}: {name} {got.tolist()}, expected {want.tolist()}"


@pytest.mark.points(2)
def test_sort_by_expert(impl, ref):
    for tokens, experts, k, seed in [(7, 6, 2, 70), (1, 4, 1, 71), (12, 8, 3, 72), (5, 3, 3, 73)]:
        ids, _ = routing(tokens, experts, k, seed)
        check_sorted(impl, ref, ids, experts, f"{tokens} tokens, top {k} of {experts} experts")


@pytest.mark.points(1)
def test_sort_by_expert_unchosen_experts_and_no_tokens(impl, ref):
    ids = torch.tensor([[5, 0], [0, 2], [2, 5], [0, 5]])  # experts 1, 3 and 4 get nothing; ties keep pair order
    check_sorted(impl, ref, ids, 6, f"ids {ids.tolist()} of 6 experts")
    check_sorted(impl, ref, torch.empty(0, 2, dtype=torch.long), 6, "no tokens (ids [0, 2])")


def expected_combine(rows, order, weights):
    """The weighted sum written out pair by pair, in float64."""
    tokens, k = weights.shape
    where = {int(p): i for i, p in enumerate(order)}  # pair number -> its row
    out = torch.zeros(tokens, rows.shape[-1], dtype=torch.float64)
    for t in range(tokens):
        for j in range(k):
            out[t] += float(weights[t, j]) * rows[where[t * k + j]].double()
    return out


@pytest.mark.points(2)
def test_combine(impl, ref):
    for tokens, experts, k, seed in [(7, 6, 2, 80), (1, 4, 1, 81), (9, 8, 3, 82)]:
        ids, weights = routing(tokens, experts, k, seed)
        order, _ = ref.sort_by_expert(ids, experts)
        rows = randn(tokens * k, 16, seed=seed + 10)
        out = impl.combine(rows, order, weights, torch.float32)
        what = f"{tokens} tokens, top {k}"
        assert isinstance(out, torch.Tensor) and out.shape == (tokens, 16) and out.dtype == torch.float32, (
            f"{what}: returned {getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}, "
            f"expected float32 {(tokens, 16)}")
        assert_close(out.double(), expected_combine(rows, order, weights), atol=1e-5, rtol=1e-5,
                     msg=lambda e: f"{what}, against each token's weighted sum of its pairs' rows: {e}")
        assert_close(out, ref.combine(rows, order, weights, torch.float32), msg=lambda e: f"{what}: {e}")


@pytest.mark.points(1)
def test_combine_bfloat16_and_no_tokens(impl, ref):
    ids, weights = routing(6, 5, 2, seed=90)
    order, _ = ref.sort_by_expert(ids, 5)
    rows = randn(12, 16, seed=91).bfloat16()
    out = impl.combine(rows, order, weights, torch.bfloat16)
    assert out.dtype == torch.bfloat16, f"rows of bfloat16 with dtype bfloat16: returned {out.dtype}"
    assert_close(out, ref.combine(rows, order, weights, torch.bfloat16),
                 msg=lambda e: f"bfloat16 rows, weighted in float32, then cast: {e}")
    empty = impl.combine(torch.empty(0, 16), torch.empty(0, dtype=torch.long), torch.empty(0, 2), torch.float32)
    assert isinstance(empty, torch.Tensor) and empty.shape == (0, 16), (
        f"no tokens: returned {tuple(getattr(empty, 'shape', ()))}, expected (0, 16)")


# --- dispatch and combine in minillm's expert-parallel layer on 2 and 3 ranks ---------------------------------------

EXPERTS, TOP_K, EXPERT_INTER = 6, 2, 24  # 6 experts: 3 per rank on 2 ranks, 2 per rank on 3
MOE_TOKENS = (1, 2, 7, 12)  # fewer tokens than ranks (a rank with none), and counts the ranks do not divide


def moe_block(comm=None):
    """A Mixtral-style MoE layer with fixed random weights: expert-parallel over comm's ranks, or on one process."""
    config = ModelConfig(vocab_size=16, hidden_size=HIDDEN, intermediate_size=INTER, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=10, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64,
                         tie_word_embeddings=False, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                         moe_intermediate_size=EXPERT_INTER)
    block = SparseMoeBlock(config, comm, expert_parallel=comm is not None)
    with torch.no_grad():
        block.gate.weight.copy_(randn(EXPERTS, HIDDEN, seed=100))
        for weight, full in ((block.experts.gate_up_proj, randn(EXPERTS, 2 * EXPERT_INTER, HIDDEN, seed=101, scale=0.2)),
                             (block.experts.down_proj, randn(EXPERTS, HIDDEN, EXPERT_INTER, seed=102, scale=0.2))):
            weight.weight_loader(weight.weight, full)  # each rank keeps the experts it holds
    return block


def moe_input(tokens):
    return randn(tokens, HIDDEN, seed=110 + tokens)


def _moe_rank(comm, impl_path):
    """Runs on each rank: minillm's expert-parallel MoE layer with your sort_by_expert and combine as its dispatch
    and combine steps, on each number of tokens; its outputs and how often your functions ran."""
    impl = _load(Path(impl_path), "_exercise_impl")
    block, calls = moe_block(comm), {"sort_by_expert": 0, "combine": 0}

    def counted(name):
        def run(*args):
            calls[name] += 1
            return getattr(impl, name)(*args)
        return run

    with mock.patch.multiple(minillm.moe, sort_by_expert=counted("sort_by_expert"), combine=counted("combine")), \
            torch.no_grad():
        outs = [block(moe_input(n)) for n in MOE_TOKENS]
    return outs, calls


@pytest.mark.points(3)
def test_expert_parallel_with_your_dispatch_and_combine(impl):
    with torch.no_grad():
        one_process = moe_block()
        want = [one_process(moe_input(n)) for n in MOE_TOKENS]
    for p in WORLD_SIZES:
        ranks = run_group(_moe_rank, p, impl.__file__, timeout=TIMEOUT_S)
        for r, (outs, calls) in enumerate(ranks):
            assert all(calls.values()), f"rank {r} of {p}: minillm's layer did not run your {calls} (calls)"
            for n, out, expected in zip(MOE_TOKENS, outs, want):
                assert_close(out, expected, atol=1e-5, rtol=1e-5,
                             msg=lambda e: f"{p} ranks, rank {r}, {n} tokens, against the one-process layer: {e}")
