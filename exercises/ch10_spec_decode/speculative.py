"""Exercise 10 — speculative decoding: propose drafts by prompt lookup, then keep those the model agrees with.

Replace each `raise NotImplementedError(...)` with your code, then run `make grade CH=10`.
Plain Python and PyTorch are enough; do not import minillm.spec_decode or minillm.sampling (that is what you are
rebuilding).

A drafter proposes k tokens d_0 .. d_{k-1} that may follow a sequence. The model scores the sequence's last
token and the k drafts in one forward pass, which gives k + 1 rows: row i is the model's next-token
distribution at the position of draft i (after the sequence and d_0 .. d_{i-1}), and row k the one after every
draft. The step keeps a prefix of the drafts and adds one token of the model's own, so it emits from 1 to
k + 1 tokens for the price of one pass over the weights:

    emitted = drafts[:m] + [t]      m drafts kept (0 <= m <= k), then t, drawn from row m's rule below

Greedy (temperature 0), a draft is kept while it equals the model's argmax, and t is the argmax at the first
mismatch (or after the last draft): the output is the model's own greedy output, token for token.

Sampling, with p_i the model's distribution at row i and q_i the drafter's distribution for d_i (d_i was drawn
from q_i), walk the drafts in order (Leviathan et al. 2023, Chen et al. 2023):

1. Keep d_i with probability min(1, p_i[d_i] / q_i[d_i]), and go on to draft i + 1.
2. Otherwise reject it and stop: t is drawn from the residual max(0, p_i - q_i) (element-wise), renormalized
   to sum to 1, and the drafts after d_i are dropped.
3. If every draft was kept, t is drawn from p_k.

Then each emitted token is distributed exactly as if the model had sampled it alone: the first is a draw from
p_0, and so on. Prompt lookup proposes with certainty, so its q_i is one-hot on d_i: a draft is kept with
probability p_i[d_i], and a rejected one is replaced by a draw from p_i with d_i's mass removed.
"""

from __future__ import annotations

import torch


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup (vLLM's "ngram" drafter): up to k draft tokens for the sequence `tokens`.

    For n from min(n_max, len(tokens) - 1) down to n_min (1 <= n_min <= n_max, k >= 1): look for an earlier
    occurrence of the sequence's last n tokens, that is a start j with tokens[j:j + n] == tokens[-n:] and
    j + n <= len(tokens) - 1 (it may overlap the suffix, but is not the suffix itself). If there is one, take
    the LATEST such j and return the tokens that followed it, tokens[j + n:j + n + k] (fewer than k when the
    sequence ends first). Otherwise try the next shorter n. No occurrence for any n: return [].

    propose_ngram([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 2, 1, 3) == [8, 1]; propose_ngram([1, 2, 3, 4], 3, 1, 3) == [].
    """
    raise NotImplementedError("propose_ngram: write this function")


def accept_greedy(drafts: list[int], target_argmax: list[int]) -> list[int]:
    """The tokens a greedy step emits: the longest prefix of `drafts` whose every token equals the model's argmax
    at its position, then the model's argmax at the first position not kept.

    `target_argmax` has len(drafts) + 1 entries: target_argmax[i] is the model's choice at draft i's position, the
    last one its choice after every draft. With m drafts kept, return drafts[:m] + [target_argmax[m]]
    (len(drafts) + 1 tokens when all are kept; one token when there are no drafts).
    accept_greedy([5, 7, 2], [5, 7, 9, 4]) == [5, 7, 9].
    """
    raise NotImplementedError("accept_greedy: write this function")


def accept_sampled(drafts: list[int], p_rows: torch.Tensor, q_rows: torch.Tensor,
                   generator: torch.Generator) -> list[int]:
    """The tokens a sampling step emits, by rules 1 to 3 of the module docstring (rejection sampling).

    drafts     k token ids (k >= 0), draft i drawn by the drafter from q_rows[i]
    p_rows     [k + 1, vocab] float: the model's probabilities, row i at draft i's position, row k after every
               draft; each row sums to 1 (within rounding) and may hold zeros
    q_rows     [k, vocab] float: the drafter's probabilities; q_rows[i, drafts[i]] > 0. Prompt lookup's are
               one-hot: q_rows[i, drafts[i]] = 1
    generator  the source of every random number you draw (`torch.rand(1, generator=generator)`,
               `torch.multinomial(row, 1, generator=generator)`), so that a seeded grade repeats; how many you
               draw and in which order is up to you

    Returns drafts[:m] + [t] as a list of Python ints, m the number of drafts kept (0 to k). Leaves `drafts`,
    `p_rows` and `q_rows` unchanged. A token the model gives probability 0 is never emitted: a draft with
    p_rows[i, d] == 0 is always rejected, and the residual gives it no mass. When q_rows[i] == p_rows[i] the
    draft is always kept.
    """
    raise NotImplementedError("accept_sampled: write this function")
