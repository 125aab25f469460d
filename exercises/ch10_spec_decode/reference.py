"""The minillm code this exercise rebuilds (the grader's reference; not a copy).

minillm's `accept` takes the verify step's logits and the request's SamplingParams, and knows one drafter,
prompt lookup, whose q is one-hot on each draft (a draft kept with probability p, a rejected one replaced by a
draw from p without it). The adapters hand it what it expects: `accept_greedy` one-hot logits at the given
argmaxes, under greedy params; `accept_sampled` the log of each row, at temperature 1 (whose softmax is the row
again), after folding the drafter's q into the rows it draws from: row i becomes a = min(1, p[d] / q[d]) on the
draft d and (1 - a) times the residual max(0, p - q), renormalized, elsewhere (the residual is 0 at d whenever
a < 1). Prompt lookup's one-hot q leaves a row as it is; for any q, keeping d with probability a and otherwise
drawing from that row without d is exactly rules 1 to 3 of the stub.
"""

import torch

from minillm.sampling import SamplingParams
from minillm.spec_decode import accept, propose_ngram

__all__ = ["propose_ngram", "accept_greedy", "accept_sampled"]
GRADED = __all__  # every name is the student's to write


def accept_greedy(drafts: list[int], target_argmax: list[int]) -> list[int]:
    logits = torch.zeros(len(target_argmax), max(drafts + target_argmax) + 1)
    logits[torch.arange(len(target_argmax)), target_argmax] = 1.0
    return accept(drafts, logits, SamplingParams(temperature=0.0), None)


def accept_sampled(drafts: list[int], p_rows: torch.Tensor, q_rows: torch.Tensor,
                   generator: torch.Generator) -> list[int]:
    p, q, d = p_rows.double(), q_rows.double(), torch.tensor(drafts, dtype=torch.long).view(-1, 1)
    k = len(drafts)
    a = (p[:k].gather(1, d) / q.gather(1, d)).clamp(max=1.0)
    residual = (p[:k] - q).clamp(min=0.0)
    folded = ((1 - a) * residual / residual.sum(1, keepdim=True).clamp(min=1e-300)).scatter(1, d, a)
    return accept(drafts, torch.cat([folded, p[k:]]).log(), SamplingParams(temperature=1.0), generator)
