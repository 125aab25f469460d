"""The chapter 5 grader grades the tiling, not only the result: an untiled tiled_attention keeps the points for
its correct output and loses those that watch the blocks, the memory and the running state."""

from pathlib import Path

import pytest

from exercises.grade import run_grader

EXERCISE = Path(__file__).resolve().parents[1] / "exercises" / "ch05_flash_attention"
ORDER, MEMORY, STATE = ("test_tiled_attention_visits_key_blocks_in_order",
                        "test_tiled_attention_never_builds_the_score_matrix",
                        "test_tiled_attention_running_state_after_each_block")

PIECES = '''
import torch


def partial_attention(q, k, v, scale, mask=None):
    s = (q.float() @ k.float().T) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[:, None]).nan_to_num(0.0) @ v.float(), lse


def merge_partials(o1, lse1, o2, lse2):
    top = torch.maximum(lse1, lse2)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w1, w2 = torch.exp(lse1 - top), torch.exp(lse2 - top)
    total = w1 + w2
    return (w1[:, None] * o1 + w2[:, None] * o2) / total.clamp_min(1e-38)[:, None], top + torch.log(total)


def visible(n, m, start, end):
    return torch.arange(start, end)[None, :] <= torch.arange(n)[:, None] + (m - n)
'''

FULL_MATRIX = '''
def tiled_attention(q, k, v, block_n=16, causal=False, scale=None):
    s = (q.float() @ k.float().T) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        s = s.masked_fill(~visible(q.shape[0], k.shape[0], 0, k.shape[0]), float("-inf"))
    return (torch.softmax(s, dim=-1).nan_to_num(0.0) @ v.float()).to(q.dtype)
'''

TWO_PASSES = '''
def tiled_attention(q, k, v, block_n=16, causal=False, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    n, m = q.shape[0], k.shape[0]

    def scores(start):
        s = (q.float() @ k[start:start + block_n].float().T) * scale
        return s.masked_fill(~visible(n, m, start, start + s.shape[1]), float("-inf")) if causal else s

    top = torch.full((n,), float("-inf"))
    for start in range(0, m, block_n):  # first pass: the row maxima
        top = torch.maximum(top, scores(start).amax(dim=-1))
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    l, acc = torch.zeros(n), torch.zeros(n, v.shape[-1])
    for start in range(0, m, block_n):  # second pass: sums and outputs under the final maxima
        p = torch.exp(scores(start) - top[:, None])
        l, acc = l + p.sum(dim=-1), acc + p @ v[start:start + block_n].float()
    return (acc / l.clamp_min(1e-38)[:, None]).to(q.dtype)
'''

MERGED_BLOCKS = '''
def tiled_attention(q, k, v, block_n=16, causal=False, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    n, m = q.shape[0], k.shape[0]
    o, lse = torch.zeros(n, v.shape[-1]), torch.full((n,), float("-inf"))
    for start in range(0, m, block_n):
        end = min(start + block_n, m)
        mask = visible(n, m, start, end) if causal else None
        o, lse = merge_partials(o, lse, *partial_attention(q, k[start:end], v[start:end], scale, mask))
    return o.to(q.dtype)
'''


@pytest.mark.parametrize("tiled, loses", [(FULL_MATRIX, {ORDER, MEMORY, STATE}), (TWO_PASSES, {ORDER, STATE}),
                                          (MERGED_BLOCKS, set())], ids=["full-matrix", "two-passes", "merged-blocks"])
def test_grader_takes_the_tiling_points_from_untiled_submissions(tmp_path, tiled, loses):
    submission = tmp_path / "online_softmax.py"
    submission.write_text(PIECES + tiled)
    failed = {r.name: r.reason for r in run_grader(EXERCISE, str(submission)) if not r.passed}
    assert set(failed) == loses, failed
