"""The chapter 10 grader has the power to tell rejection sampling from its usual mistakes: a submission that keeps
every draft, rejects every draft, keeps a draft with probability p whatever q is, or replaces a rejected draft by
a draw from p instead of max(0, p - q) earns none of the statistical tests' points; one that draws its random
numbers another way, but by the same rule, earns them all."""

from pathlib import Path

import pytest

from exercises.grade import run_grader

EXERCISE = Path(__file__).resolve().parents[1] / "exercises" / "ch10_spec_decode"
LAWS, DISTRIBUTION, ACCEPTANCE = ("test_accept_sampled_laws", "test_accept_sampled_keeps_the_models_distribution",
                                  "test_accept_sampled_acceptance_and_residual")

PIECES = '''
import torch


def propose_ngram(tokens, k, n_min, n_max):
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        for j in range(len(tokens) - 1 - n, -1, -1):
            if tokens[j:j + n] == tokens[-n:]:
                return tokens[j + n:j + n + k]
    return []


def accept_greedy(drafts, target_argmax):
    m = 0
    while m < len(drafts) and drafts[m] == target_argmax[m]:
        m += 1
    return drafts[:m] + [target_argmax[m]]


def draw(row, generator):
    return int(torch.multinomial(row.double(), 1, generator=generator))
'''

ACCEPT_ALL = '''
def accept_sampled(drafts, p_rows, q_rows, generator):
    return list(drafts) + [draw(p_rows[len(drafts)], generator)]
'''

RESAMPLE_ALL = '''
def accept_sampled(drafts, p_rows, q_rows, generator):
    return [draw(p_rows[0], generator)]
'''

KEEP_WITH_P = '''
def accept_sampled(drafts, p_rows, q_rows, generator):
    for i, d in enumerate(drafts):
        if torch.rand(1, generator=generator).item() < p_rows[i, d]:  # q ignored
            continue
        return drafts[:i] + [draw((p_rows[i] - q_rows[i]).clamp(min=0), generator)]
    return list(drafts) + [draw(p_rows[len(drafts)], generator)]
'''

RESIDUAL_FROM_P = '''
def accept_sampled(drafts, p_rows, q_rows, generator):
    for i, d in enumerate(drafts):
        if torch.rand(1, generator=generator).item() < p_rows[i, d] / q_rows[i, d]:
            continue
        return drafts[:i] + [draw(p_rows[i], generator)]  # not max(0, p - q)
    return list(drafts) + [draw(p_rows[len(drafts)], generator)]
'''

INVERSE_CDF = '''
def inverse_cdf(row, generator):
    cdf = row.double().cumsum(0)
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp(max=len(row) - 1))


def accept_sampled(drafts, p_rows, q_rows, generator):
    for i, d in enumerate(drafts):
        if torch.rand(1, generator=generator, dtype=torch.float64) * q_rows[i, d] < p_rows[i, d]:
            continue
        return drafts[:i] + [inverse_cdf((p_rows[i] - q_rows[i]).clamp(min=0), generator)]
    return list(drafts) + [inverse_cdf(p_rows[len(drafts)], generator)]
'''


@pytest.mark.parametrize("accept_sampled, loses", [
    (ACCEPT_ALL, {LAWS, DISTRIBUTION, ACCEPTANCE}),
    (RESAMPLE_ALL, {LAWS, DISTRIBUTION, ACCEPTANCE}),
    (KEEP_WITH_P, {LAWS, DISTRIBUTION, ACCEPTANCE}),
    (RESIDUAL_FROM_P, {DISTRIBUTION, ACCEPTANCE}),  # its acceptance is right, and every law holds
    (INVERSE_CDF, set()),  # the same rule, its random numbers drawn and used another way
], ids=["accept-all", "resample-all", "keep-with-p", "residual-from-p", "inverse-cdf"])
def test_grader_takes_the_sampling_points_from_wrong_rules(tmp_path, accept_sampled, loses):
    submission = tmp_path / "speculative.py"
    submission.write_text(PIECES + accept_sampled)
    failed = {r.name: r.reason for r in run_grader(EXERCISE, str(submission)) if not r.passed}
    assert set(failed) == loses, failed
