"""Grader for exercise 10: your prompt-lookup drafter and greedy acceptance against minillm's, token for token; your
rejection sampling by what it must do to the distribution, measured over thousands of seeded draws.

The sampled rule is graded by statistics, not by comparing draws, so the order in which you draw random numbers
is yours. Each frequency must lie within 5 standard deviations (plus half a count) of its exact value; with the
sample sizes below a correct implementation misses that bound with probability under 1e-4 over all the checks
together (exact binomial tails, summed), while one that keeps every draft, rejects every draft, keeps a draft
with probability p (ignoring q) or replaces a rejected draft by a draw from p (not from max(0, p - q)) misses it
in each statistical test by 26 standard deviations or more, emits a token of probability 0, or rejects a draft
that must be kept.
"""

import random

import pytest
import torch

SIGMAS = 5


def probs(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def assert_distribution(samples: list[int], expected: torch.Tensor, what: str) -> None:
    """The frequency of each value among `samples` within SIGMAS standard deviations of `expected` (a value of
    probability 0 or 1 must never, or always, occur)."""
    n = len(samples)
    assert n > 0, f"{what}: no samples, expected some"
    freq = torch.bincount(torch.tensor(samples), minlength=len(expected)).double() / n
    assert len(freq) == len(expected), f"{what}: a value {len(freq) - 1} outside 0..{len(expected) - 1}"
    sd = (expected * (1 - expected) / n).sqrt()
    off = [i for i in range(len(expected)) if abs(freq[i] - expected[i]) > SIGMAS * sd[i] + 0.5 / n]
    if off:
        i = off[0]
        how = f"{abs(float(freq[i] - expected[i]) / sd[i]):.1f} standard deviations off" if sd[i] > 0 else \
            f"expected {'never' if expected[i] == 0 else 'always'}"
        pytest.fail(f"{what}, {n} samples: frequencies {[round(float(f), 3) for f in freq]}, expected "
                    f"{[round(float(e), 3) for e in expected]} (value {i}: {how})", pytrace=False)


def check_step(out, drafts: list[int], where: str) -> list[int]:
    """The step's output is a list of ints: a prefix of the drafts, then one token."""
    assert isinstance(out, list) and all(type(t) is int for t in out), \
        f"{where}: returned {out!r}, expected a list of Python ints"
    assert 1 <= len(out) <= len(drafts) + 1 and out[:-1] == drafts[:len(out) - 1], \
        f"{where}: returned {out}, expected the drafts kept ({drafts}, a prefix) then one token"
    return out


# ---------------------------------------------------------------------------------------------------- prompt lookup

NGRAM_CASES = [  # tokens, k, n_min, n_max, drafts
    ([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 2, 1, 3, [8, 1], "the latest earlier '1 2 3' came before 8"),
    ([1, 2, 3, 4, 5, 9, 4, 5], 3, 1, 3, [9, 4, 5], "'4 5' last came before '9 4 5'"),
    ([7, 1, 2, 5, 1, 2], 4, 2, 2, [5, 1, 2], "fewer than k when the sequence ends first"),
    ([5, 1, 2, 8, 9, 2, 6, 1, 2], 1, 1, 2, [8], "the longest suffix found wins over a later shorter one"),
    ([7, 7, 7, 7], 2, 1, 3, [7], "an occurrence may overlap the suffix"),
    ([1, 2, 3, 4], 3, 1, 3, [], "nothing repeats"),
    ([1, 2, 1, 2], 2, 4, 5, [], "n_min longer than any earlier occurrence can be"),
    ([4], 3, 1, 3, [], "one token"),
    ([], 3, 1, 3, [], "no tokens"),
]


@pytest.mark.points(1)
def test_propose_ngram_examples(impl):
    for tokens, k, n_min, n_max, want, why in NGRAM_CASES:
        got = impl.propose_ngram(list(tokens), k, n_min, n_max)
        assert got == want, f"propose_ngram({tokens}, k={k}, n_min={n_min}, n_max={n_max}) = {got}, expected " \
                            f"{want} ({why})"


@pytest.mark.points(2)
def test_propose_ngram_matches_minillm(impl, ref):
    rng = random.Random(10)
    for case in range(600):
        tokens = [rng.randrange(rng.choice([2, 3, 5, 20])) for _ in range(rng.randrange(0, 40))]
        n_min = rng.randint(1, 3)
        k, n_max = rng.randint(1, 6), rng.randint(n_min, 5)
        got, want = impl.propose_ngram(list(tokens), k, n_min, n_max), ref.propose_ngram(tokens, k, n_min, n_max)
        assert got == want, f"case {case}: propose_ngram({tokens}, k={k}, n_min={n_min}, n_max={n_max}) = {got}, " \
                            f"expected {want}"


# ---------------------------------------------------------------------------------------------------------- greedy

GREEDY_CASES = [  # drafts, target_argmax, emitted
    ([3, 1, 4], [3, 1, 4, 1], [3, 1, 4, 1], "every draft kept, then the model's token after them"),
    ([3, 1, 4], [2, 1, 4, 1], [2], "the first draft rejected: only the model's token"),
    ([5, 7, 2], [5, 7, 9, 4], [5, 7, 9], "two kept, the third replaced by the model's choice"),
    ([1, 2, 3], [1, 9, 3, 4], [1, 9], "a draft after the first mismatch is not kept, even if it matches"),
    ([], [6], [6], "no drafts: the model's own token"),
    ([0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], "repeated tokens"),
]


@pytest.mark.points(2)
def test_accept_greedy_cases(impl):
    for drafts, argmax, want, why in GREEDY_CASES:
        args = (list(drafts), list(argmax))
        got = impl.accept_greedy(*args)
        assert got == want and all(type(t) is int for t in got), \
            f"accept_greedy({drafts}, {argmax}) = {got!r}, expected {want} ({why})"
        assert args == (drafts, argmax), f"accept_greedy({drafts}, {argmax}) changed its arguments to {args}"


@pytest.mark.points(2)
def test_accept_greedy_matches_minillm(impl, ref):
    rng = random.Random(20)
    for case in range(1000):
        k, vocab = rng.randrange(0, 8), rng.choice([2, 3, 50])
        argmax = [rng.randrange(vocab) for _ in range(k + 1)]
        agree = rng.random()  # from drafts that all agree to drafts that rarely do
        drafts = [t if rng.random() < agree else rng.randrange(vocab) for t in argmax[:k]]
        got, want = impl.accept_greedy(list(drafts), list(argmax)), ref.accept_greedy(drafts, argmax)
        assert got == want, f"case {case}: accept_greedy({drafts}, {argmax}) = {got}, expected {want}"


# -------------------------------------------------------------------------------------------------------- sampling

def one_hot(drafts: list[int], vocab: int) -> torch.Tensor:
    """Prompt lookup's q: certain of each draft."""
    return torch.nn.functional.one_hot(torch.tensor(drafts, dtype=torch.long), vocab).double().view(len(drafts), vocab)


def dirichlet_rows(rows: int, vocab: int, gen: torch.Generator, zeros: float) -> torch.Tensor:
    """Random distributions in which about a fraction `zeros` of the tokens have probability exactly 0."""
    w = -torch.rand(rows, vocab, generator=gen, dtype=torch.float64).log()
    w[torch.rand(rows, vocab, generator=gen) < zeros] = 0.0
    w[w.sum(1) == 0, 0] = 1.0
    return w / w.sum(1, keepdim=True)


@pytest.mark.points(2)
def test_accept_sampled_laws(impl):
    """What holds on every draw: a prefix of the drafts then one token; never a token of probability 0; a draft
    the model gives probability 0 never kept; every draft kept when q equals p; the inputs left unchanged."""
    ours, theirs = torch.Generator().manual_seed(30), torch.Generator().manual_seed(31)  # the grader's, the impl's
    for trial in range(300):
        k, vocab = trial % 5, 40
        dtype = torch.float32 if trial % 2 else torch.float64
        p = dirichlet_rows(k + 1, vocab, ours, zeros=0.5).to(dtype)
        q = dirichlet_rows(k, vocab, ours, zeros=0.3).to(dtype) if trial % 3 else p[:k].clone()
        drafts = torch.multinomial(q, 1, generator=ours).view(-1).tolist() if k else []
        p_in, q_in, drafts_in = p.clone(), q.clone(), list(drafts)
        where = f"trial {trial}: {k} drafts, vocab {vocab}, {dtype}" + (", q = p" if trial % 3 == 0 else "")
        out = check_step(impl.accept_sampled(drafts_in, p_in, q_in, theirs), drafts, where)
        assert torch.equal(p_in, p) and torch.equal(q_in, q) and drafts_in == drafts, \
            f"{where}: accept_sampled changed drafts, p_rows or q_rows"
        zero = [i for i, t in enumerate(out) if p[i, t] == 0]
        assert not zero, f"{where}: emitted token {out[zero[0]]} at position {zero[0]}, where p gives it 0 " \
                         f"({'a kept draft' if zero[0] < len(out) - 1 else 'the token drawn'}); drafts {drafts}"
        if trial % 3 == 0:
            assert len(out) == k + 1, f"{where}: q equals p, so every draft must be kept; emitted {out}"


def run(impl, p: torch.Tensor, q: torch.Tensor, n: int, seed: int, drafts: list[int] | None = None) -> list[list[int]]:
    """n steps: the drafts fixed, or drawn from q afresh for each step (by a generator of the grader's own)."""
    ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    k = q.shape[0]
    fresh = drafts is None
    outs = []
    for step in range(n):
        if fresh:
            drafts = torch.multinomial(q, 1, generator=ours).view(-1).tolist() if k else []
        outs.append(check_step(impl.accept_sampled(list(drafts), p.clone(), q.clone(), theirs), drafts,
                               f"step {step}, drafts {drafts}"))
    return outs


P_A = probs([0.50, 0.30, 0.15, 0.05, 0.00], [0.10, 0.20, 0.40, 0.30, 0.00], [0.05, 0.15, 0.20, 0.25, 0.35])
Q_A = probs([0.10, 0.60, 0.10, 0.00, 0.20], [0.30, 0.30, 0.20, 0.20, 0.00])
P_B = probs([0.10, 0.10, 0.60, 0.10, 0.10], [0.70, 0.05, 0.05, 0.10, 0.10], [0.00, 0.20, 0.10, 0.20, 0.50],
            [0.30, 0.30, 0.00, 0.20, 0.20])
DRAFTS_B = [2, 0, 4]  # prompt lookup's drafts: q one-hot on them
P_C = probs([0.25, 0.00, 0.40, 0.35, 0.00])
P_D = probs([0.20, 0.30, 0.50], [0.60, 0.10, 0.30])
Q_D = probs([0.60, 0.30, 0.10])

DISTRIBUTION_CASES = [  # name, p_rows, q_rows, steps
    ("a drafter with its own q, 2 drafts", P_A, Q_A, 4000),
    ("prompt lookup (q one-hot), 3 drafts", P_B, one_hot(DRAFTS_B, 5), 3000),
    ("no drafts", P_C, probs().view(0, 5), 2000),
    ("a drafter that overrates token 0, 1 draft", P_D, Q_D, 3000),
]


@pytest.mark.points(5)
def test_accept_sampled_keeps_the_models_distribution(impl):
    """Drafts drawn from q at every step: the token emitted at each position must follow the model's p there,
    and the number kept the product of the acceptance rates sum(min(p_i, q_i))."""
    for seed, (name, p, q, n) in enumerate(DISTRIBUTION_CASES):
        outs = run(impl, p, q, n, seed=100 + seed)
        k, rate = q.shape[0], torch.minimum(p[:-1], q).sum(1)  # the chance that draft i is kept, once reached
        reach = torch.cat([torch.ones(1, dtype=torch.float64), rate.cumprod(0)])  # P(at least i drafts kept)
        lengths = reach - torch.cat([reach[1:], torch.zeros(1, dtype=torch.float64)])  # P(exactly i kept)
        assert_distribution([len(o) - 1 for o in outs], lengths,
                            f"{name}: the number of drafts kept (by acceptance rates {rate.tolist()})")
        for i in range(k + 1):
            assert_distribution([o[i] for o in outs if len(o) > i], p[i],
                                f"{name}: the token emitted at position {i}, which must be a draw from p_{i}")


@pytest.mark.points(4)
def test_accept_sampled_acceptance_and_residual(impl):
    """Drafts fixed: draft i is kept with probability min(1, p_i[d] / q_i[d]) once reached, and a rejected draft
    is replaced by a draw from max(0, p_i - q_i), renormalized."""
    cases = [  # name, p_rows, q_rows, drafts, steps
        ("q_0 above p_0 on the draft", P_A[:2], Q_A[:1], [1], 2000),
        ("p_0 is 0 on the draft", P_A[:2], Q_A[:1], [4], 1000),
        ("p_0 above q_0 on the draft", P_A[:2], Q_A[:1], [0], 500),
        ("the second draft, the first always kept", P_A, Q_A, [0, 1], 3000),
        ("prompt lookup (q one-hot)", P_B, one_hot(DRAFTS_B, 5), DRAFTS_B, 2000),
    ]
    for seed, (name, p, q, drafts, n) in enumerate(cases):
        outs = run(impl, p, q, n, seed=200 + seed, drafts=drafts)
        d = torch.tensor(drafts).view(-1, 1)
        keep = (p[:len(drafts)].gather(1, d) / q.gather(1, d)).clamp(max=1.0).view(-1)
        reach = torch.cat([torch.ones(1, dtype=torch.float64), keep.cumprod(0)])
        lengths = reach - torch.cat([reach[1:], torch.zeros(1, dtype=torch.float64)])
        assert_distribution([len(o) - 1 for o in outs], lengths,
                            f"drafts {drafts}, {name}: the number kept (keep probabilities min(1, p/q) = "
                            f"{[round(float(a), 3) for a in keep]})")
        for i in range(len(drafts)):
            if lengths[i] * n >= 100:  # enough rejections of draft i to see the residual
                residual = (p[i] - q[i]).clamp(min=0)
                assert_distribution([o[i] for o in outs if len(o) == i + 1], residual / residual.sum(),
                                    f"drafts {drafts}, {name}: the token replacing rejected draft {i}, a draw from "
                                    f"max(0, p_{i} - q_{i}) renormalized")
