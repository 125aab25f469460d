"""Grader for exercise 7: your weight shards against minillm's; your parallel MLP on 2 and 3 gloo ranks against the
one-process MLP, with its all-reduces counted; your merge against attention over the union of the keys, and as the
merge step of minillm's ring attention on 2 and 3 ranks against full causal attention.

The ranks are separate processes (`run_group`); each loads your file anew from its path, and none outlives its
test, even when your code raises or hangs (`TIMEOUT_S`)."""

import importlib
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from exercises.conftest import _load
from minillm.kernels.online_softmax import partial_attention
from minillm.parallel.comm import run_group
from minillm.parallel.ring_attention import ring_attention, split_sequence

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


# --- merging partials -----------------------------------------------------------------------------------------------

def partials(q, k, v, mask=None):
    """minillm's partial attention for each head: q [heads, n, d], k, v [heads, m, d] -> (o, lse)."""
    scale = q.shape[-1] ** -0.5
    per_head = [partial_attention(q[h], k[h], v[h], scale, mask) for h in range(q.shape[0])]
    return torch.stack([o for o, _ in per_head]), torch.stack([lse for _, lse in per_head])


def qkv(heads, n, m, d, seed, scale=1.0):
    return randn(heads, n, d, seed=seed, scale=scale), randn(heads, m, d, seed=seed + 1, scale=scale), \
        randn(heads, m, d, seed=seed + 2)


@pytest.mark.points(2)
def test_merge_equals_attention_over_the_union(impl):
    for seed, (heads, n, m, split) in enumerate([(3, 5, 9, 4), (1, 1, 2, 1), (4, 7, 33, 30)]):
        q, k, v = qkv(heads, n, m, 16, seed=20 + 3 * seed)
        a, b = partials(q, k[:, :split], v[:, :split]), partials(q, k[:, split:], v[:, split:])
        want_o, want_lse = partials(q, k, v)
        o, lse = impl.merge_partials(*a, *b)
        assert_close(o, want_o, msg=lambda e: f"o [{heads}, {n}, 16], keys split {split}|{m - split}: {e}")
        assert_close(lse, want_lse, msg=lambda e: f"lse [{heads}, {n}], keys split {split}|{m - split}: {e}")
        o_swapped, lse_swapped = impl.merge_partials(*b, *a)
        assert_close(o_swapped, o, msg=lambda e: f"merging is symmetric (o): {e}")
        assert_close(lse_swapped, lse, msg=lambda e: f"merging is symmetric (lse): {e}")
    q, k, v = qkv(1, 6, 10, 8, seed=30)
    (o_a, lse_a), (o_b, lse_b) = partials(q, k[:, :3], v[:, :3]), partials(q, k[:, 3:], v[:, 3:])
    o, lse = impl.merge_partials(o_a[0], lse_a[0], o_b[0], lse_b[0])  # no head dimension: o [n, d], lse [n]
    want_o, want_lse = partials(q, k, v)
    assert_close(o, want_o[0], msg=lambda e: f"o [6, 8] (no head dimension): {e}")
    assert_close(lse, want_lse[0], msg=lambda e: f"lse [6] (no head dimension): {e}")


@pytest.mark.points(1)
def test_merge_large_scores_do_not_overflow(impl):
    q, k, v = qkv(2, 5, 12, 16, seed=40, scale=40.0)  # scores in the thousands: exp() alone overflows
    o, lse = impl.merge_partials(*partials(q, k[:, :5], v[:, :5]), *partials(q, k[:, 5:], v[:, 5:]))
    assert torch.isfinite(o).all() and torch.isfinite(lse).all(), "subtract the larger lse before exp()"
    want_o, want_lse = partials(q, k, v)
    assert_close(o, want_o, msg=lambda e: f"o with huge scores: {e}")
    assert_close(lse, want_lse, msg=lambda e: f"lse with huge scores: {e}")


@pytest.mark.points(2)
def test_merge_with_a_fully_masked_block(impl):
    q, k, v = qkv(2, 6, 10, 8, seed=50)
    causal = torch.arange(10)[None, :] <= torch.arange(6)[:, None]  # query i sees keys 0..i
    first, rest = partials(q, k[:, :4], v[:, :4], causal[:, :4]), partials(q, k[:, 4:], v[:, 4:], causal[:, 4:])
    assert torch.isneginf(rest[1][:, :4]).all()  # queries 0..3 see none of keys 4..9
    o, lse = impl.merge_partials(*first, *rest)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any(), "rows where one partial is empty gave NaN"
    want_o, want_lse = partials(q, k, v, causal)
    assert_close(o, want_o, msg=lambda e: f"o, where some rows see no key of one block: {e}")
    assert_close(lse, want_lse, msg=lambda e: f"lse, where some rows see no key of one block: {e}")
    masked = partials(q, k[:, 6:], v[:, 6:], causal[:, 6:])  # no query sees keys 6..9: a fully masked block
    for what, args in [("block, then masked block", (*first, *masked)),
                       ("masked block, then block", (*masked, *first))]:
        o, lse = impl.merge_partials(*args)
        assert_close(o, first[0], msg=lambda e: f"{what}: merging a fully masked block changes nothing (o): {e}")
        assert_close(lse, first[1], msg=lambda e: f"{what}: merging a fully masked block changes nothing (lse): {e}")
    o, lse = impl.merge_partials(*masked, *masked)
    assert not torch.isnan(o).any() and (o == 0).all(), "two fully masked blocks merge into o = 0, not NaN"
    assert torch.isneginf(lse).all(), "two fully masked blocks merge into lse = -inf"


# --- the merge in a ring of 2 and 3 ranks ---------------------------------------------------------------------------

RING_TOTAL, RING_HEADS, RING_KV_HEADS, RING_D = 11, 4, 2, 16


def ring_inputs():
    return (randn(RING_TOTAL, RING_HEADS, RING_D, seed=60), randn(RING_TOTAL, RING_KV_HEADS, RING_D, seed=61),
            randn(RING_TOTAL, RING_KV_HEADS, RING_D, seed=62))


def _ring_rank(comm, impl_path):
    """Runs on each rank: minillm's ring attention over this rank's slice, merging with your merge_partials;
    its outputs (causal, then not) and how often your merge ran."""
    impl = _load(Path(impl_path), "_exercise_impl")
    calls = []

    def merge(*args):
        calls.append(1)
        return impl.merge_partials(*args)

    q, k, v = ring_inputs()
    start, end = split_sequence(RING_TOTAL, comm.world_size)[comm.rank]
    with mock.patch.object(importlib.import_module("minillm.parallel.ring_attention"), "merge_partials", merge):
        outs = [ring_attention(comm, q[start:end], k[start:end], v[start:end], start, RING_TOTAL, causal)
                for causal in (True, False)]
    return outs, len(calls)


@pytest.mark.points(3)
def test_ring_attention_with_your_merge(impl):
    q, k, v = (t.transpose(0, 1) for t in ring_inputs())
    for p in WORLD_SIZES:
        ranks = run_group(_ring_rank, p, impl.__file__, timeout=TIMEOUT_S)
        assert all(calls for _, calls in ranks), "minillm's ring attention did not run your merge_partials"
        for i, causal in enumerate((True, False)):
            out = torch.cat([outs[i] for outs, _ in ranks])
            assert not torch.isnan(out).any(), (f"{p} ranks, causal={causal}: NaN in the output (a block that a "
                                                f"rank's queries cannot see at all has lse = -inf)")
            want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True).transpose(0, 1)
            assert_close(out, want, atol=1e-5, rtol=1e-5,
                         msg=lambda e: f"{p} ranks, causal={causal}, against attention on one process: {e}")
