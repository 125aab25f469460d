"""Grader for exercise 5: your online-softmax pieces against minillm's, the properties that make them exact,
and the tiling itself: which key blocks tiled_attention visits, in what order, what it keeps between them."""

import math

import pytest
import torch
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def full_attention(q, k, v, scale, causal=False):
    """Attention with the whole score matrix, in float32 (bottom-right causal; rows seeing no key -> 0)."""
    s = (q.float() @ k.float().T) * scale
    if causal:
        n, m = s.shape
        s = s.masked_fill(torch.arange(m)[None, :] > torch.arange(n)[:, None] + (m - n), float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ v.float()


def qkv(n, m, d, seed, scale=1.0, dtype=torch.float32):
    return randn(n, d, seed=seed, scale=scale, dtype=dtype), randn(m, d, seed=seed + 1, scale=scale, dtype=dtype), \
        randn(m, d, seed=seed + 2, dtype=dtype)


@pytest.mark.points(2)
def test_partial_attention_matches_reference(impl, ref):
    for seed, (n, m, d) in enumerate([(1, 1, 8), (5, 7, 16), (16, 3, 64), (9, 33, 32)]):
        q, k, v = qkv(n, m, d, seed)
        (o, lse), (ro, rlse) = impl.partial_attention(q, k, v, d ** -0.5), ref.partial_attention(q, k, v, d ** -0.5)
        assert_close(o, ro, msg=lambda e: f"o, n={n} m={m} d={d}: {e}")
        assert_close(lse, rlse, msg=lambda e: f"lse, n={n} m={m} d={d}: {e}")


@pytest.mark.points(1)
def test_partial_attention_mask_and_empty_rows(impl, ref):
    q, k, v = qkv(6, 10, 16, seed=10)
    mask = randn(6, 10, seed=13) > 0
    mask[2] = False  # this query sees no key
    o, lse = impl.partial_attention(q, k, v, 0.25, mask=mask)
    ro, rlse = ref.partial_attention(q, k, v, 0.25, mask=mask)
    assert not torch.isnan(o).any(), "a row that sees no key must give o = 0, not NaN"
    assert torch.isneginf(lse[2]), f"a row that sees no key has lse = -inf, got {lse[2]}"
    assert_close(o, ro, msg=lambda e: f"masked o: {e}")
    assert_close(lse, rlse, msg=lambda e: f"masked lse: {e}")


@pytest.mark.points(2)
def test_merge_equals_attention_over_the_union(impl, ref):
    for seed, (n, m, split, d) in enumerate([(4, 10, 3, 16), (7, 33, 16, 32), (1, 2, 1, 8), (16, 64, 60, 64)]):
        q, k, v = qkv(n, m, d, seed=20 + seed)
        scale = d ** -0.5
        a = ref.partial_attention(q, k[:split], v[:split], scale)
        b = ref.partial_attention(q, k[split:], v[split:], scale)
        o, lse = impl.merge_partials(*a, *b)
        assert_close(o, full_attention(q, k, v, scale), msg=lambda e: f"merged o, keys split {split}|{m - split}: {e}")
        assert_close(lse, torch.logsumexp((q @ k.T) * scale, dim=-1), msg=lambda e: f"merged lse: {e}")
        o_swapped, _ = impl.merge_partials(*b, *a)
        assert_close(o_swapped, o, msg=lambda e: f"merging is symmetric: {e}")


@pytest.mark.points(1)
def test_merge_large_scores_do_not_overflow(impl, ref):
    q, k, v = qkv(5, 12, 16, seed=30, scale=40.0)  # scores in the thousands: exp() alone overflows
    a, b = ref.partial_attention(q, k[:5], v[:5], 1.0), ref.partial_attention(q, k[5:], v[5:], 1.0)
    o, lse = impl.merge_partials(*a, *b)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all(), "subtract the larger lse before exp()"
    ro, rlse = ref.merge_partials(*a, *b)
    assert_close(o, ro, msg=lambda e: f"o with huge scores: {e}")
    assert_close(lse, rlse, msg=lambda e: f"lse with huge scores: {e}")


@pytest.mark.points(1)
def test_merge_with_empty_partials(impl, ref):
    q, k, v = qkv(4, 6, 8, seed=40)
    some = ref.partial_attention(q, k, v, 0.5)
    empty = (torch.zeros(4, 8), torch.full((4,), float("-inf")))
    o, lse = impl.merge_partials(*some, *empty)
    assert_close(o, some[0], msg=lambda e: f"merging with an empty partial changes nothing (o): {e}")
    assert_close(lse, some[1], msg=lambda e: f"merging with an empty partial changes nothing (lse): {e}")
    o, lse = impl.merge_partials(*empty, *empty)
    assert not torch.isnan(o).any() and (o == 0).all(), "two empty partials merge into o = 0, not NaN"
    assert torch.isneginf(lse).all(), "two empty partials merge into lse = -inf"


@pytest.mark.points(2)
def test_tiled_attention_matches_reference(impl, ref):
    for seed, (n, m, d, block_n) in enumerate([(1, 1, 8, 16), (5, 37, 16, 8), (16, 16, 64, 16), (9, 40, 32, 1),
                                               (3, 20, 16, 64), (12, 50, 32, 7)]):
        q, k, v = qkv(n, m, d, seed=50 + seed)
        out = impl.tiled_attention(q, k, v, block_n=block_n)
        assert out.shape == q.shape, f"output shape {tuple(out.shape)}, expected {tuple(q.shape)}"
        assert_close(out, ref.tiled_attention(q, k, v, block_n=block_n),
                     msg=lambda e: f"n={n} m={m} d={d} block_n={block_n}: {e}")
        assert_close(out, full_attention(q, k, v, d ** -0.5), msg=lambda e: f"against full attention: {e}")


@pytest.mark.points(2)
def test_tiled_attention_causal_bottom_right(impl, ref):
    for seed, (n, m, block_n) in enumerate([(8, 8, 3), (3, 20, 8), (1, 17, 4), (20, 6, 4), (16, 16, 16)]):
        q, k, v = qkv(n, m, 16, seed=60 + seed)
        out = impl.tiled_attention(q, k, v, block_n=block_n, causal=True)
        assert not torch.isnan(out).any(), f"n={n} > m={m}: rows that see no key must be zeros, not NaN"
        assert_close(out, full_attention(q, k, v, 0.25, causal=True),
                     msg=lambda e: f"causal, n={n} queries, m={m} keys, block_n={block_n}: {e}")


@pytest.mark.points(1)
def test_tiled_attention_scale_and_large_scores(impl, ref):
    q, k, v = qkv(6, 30, 16, seed=70, scale=30.0)
    for scale in (None, 0.05, 1.0):
        out = impl.tiled_attention(q, k, v, block_n=8, scale=scale)
        assert torch.isfinite(out).all(), f"scale={scale}: keep a running max so exp() never overflows"
        assert_close(out, ref.tiled_attention(q, k, v, block_n=8, scale=scale), msg=lambda e: f"scale={scale}: {e}")


@pytest.mark.points(1)
def test_tiled_attention_bfloat16(impl, ref):
    q, k, v = qkv(7, 19, 32, seed=80, dtype=torch.bfloat16)
    out = impl.tiled_attention(q, k, v, block_n=4, causal=True)
    assert out.dtype == torch.bfloat16, f"return q's dtype; got {out.dtype}"
    assert_close(out, ref.tiled_attention(q, k, v, block_n=4, causal=True), atol=2e-2, rtol=2e-2,
                 msg=lambda e: f"bf16 (accumulate in float32): {e}")


# The tiling tests watch every PyTorch operation tiled_attention runs and find its work by value: the scores of
# each key block, the running state after each block. Sizes are chosen so that nothing a tiled loop needs (k or v
# whole, one [n, block_n] block of scores, the [n, d] accumulator) is as large as the [n, m] score matrix.
N, M, D, BLOCK = 12, 96, 8, 8  # 12 blocks of 8 keys


class OpLog(TorchDispatchMode):
    """Records a copy of every tensor each PyTorch operation returns while active, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.outputs += [t.detach().clone() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def run_logged(impl, q, k, v, causal=False):
    with OpLog() as log:
        out = impl.tiled_attention(q, k, v, block_n=BLOCK, causal=causal)
    assert_close(out, full_attention(q, k, v, D ** -0.5, causal), msg=lambda e: f"wrong result: {e}")
    return log.outputs


def holds(t, want):
    """Whether tensor t holds the values of `want` (shapes may differ by size-1 dims or a transpose)."""
    if not t.is_floating_point() or t.numel() != want.numel():
        return False
    t = t.double().reshape(-1, *want.shape[1:]) if want.dim() > 1 else t.double().reshape(-1)
    if t.shape != want.shape:
        return False
    return torch.allclose(t, want, rtol=1e-4, atol=1e-5) or (
        want.dim() == 2 and torch.allclose(t.reshape(want.shape[::-1]).T, want, rtol=1e-4, atol=1e-5))


def tiling_inputs():
    q, k, v = qkv(N, M, D, seed=90, scale=1.5)
    scores = (q.double() @ k.double().T) * D ** -0.5
    return q, k, v, scores


def blocks(scores):
    """Per key block: its key range, its scores in the forms a loop may compute them (raw, scaled, base 2)."""
    raw = scores / D ** -0.5
    return [(start, min(start + BLOCK, M), [x[:, start:start + BLOCK] for x in (raw, scores, scores / math.log(2))])
            for start in range(0, M, BLOCK)]


def block_visits(outputs, scores):
    """(position in the log, key block) for each operation whose result is one key block's scores for every query."""
    found = []
    for i, t in enumerate(outputs):
        if t.dim() >= 2 and BLOCK in t.shape:
            found += [(i, j) for j, (_, _, forms) in enumerate(blocks(scores)) if any(holds(t, f) for f in forms)]
    return found


@pytest.mark.points(2)
def test_tiled_attention_visits_key_blocks_in_order(impl, ref):
    q, k, v, scores = tiling_inputs()
    visits = [j for _, j in block_visits(run_logged(impl, q, k, v), scores)]
    for j, (start, end, _) in enumerate(blocks(scores)):
        assert j in visits, (f"no scores of key block {j} (keys {start}..{end - 1}) for all {N} queries: score q "
                             f"against one block of {BLOCK} keys at a time")
    order = [j for i, j in enumerate(visits) if i == 0 or j != visits[i - 1]]
    assert order == sorted(set(order)), (f"key blocks not visited once each in order 0..{len(blocks(scores)) - 1} "
                                         f"(a second pass?): saw {order}")


@pytest.mark.points(2)
def test_tiled_attention_never_builds_the_score_matrix(impl, ref):
    q, k, v, _ = tiling_inputs()
    for causal in (False, True):
        biggest = max(run_logged(impl, q, k, v, causal), key=torch.Tensor.numel, default=torch.empty(0))
        assert biggest.numel() < N * M, (
            f"a {list(biggest.shape)} tensor is as large as the [{N}, {M}] score matrix (causal={causal}): keep one "
            f"[{N}, {BLOCK}] block of scores and per-row state")


@pytest.mark.points(2)
def test_tiled_attention_running_state_after_each_block(impl, ref):
    q, k, v, scores = tiling_inputs()
    outputs = run_logged(impl, q, k, v)
    firsts = {}
    for i, j in block_visits(outputs, scores):
        firsts.setdefault(j, i)
    for j, (start, end, _) in enumerate(blocks(scores)):
        if j not in firsts:
            pytest.fail(f"no scores of key block {j}, so no state after it (see the visiting order)", pytrace=False)
        window = outputs[firsts[j]:firsts.get(j + 1, len(outputs))]  # from block j's scores to block j + 1's
        seen = scores[:, :end]
        m = seen.amax(dim=-1)
        l = torch.exp(seen - m[:, None]).sum(dim=-1)
        acc = torch.exp(seen - m[:, None]) @ v.double()[:end]
        has = lambda *wants: any(holds(t, w) for t in window for w in wants)  # noqa: E731
        assert (has(m, m / math.log(2)) and has(l)) or has(m + torch.log(l)), (
            f"after key block {j}, no running max and sum (or lse) equal to the exact ones over keys 0..{end - 1}")
        assert has(acc, acc / l[:, None]), (
            f"after key block {j}, no running output (acc or acc / l) equal to the exact one over keys 0..{end - 1}")
