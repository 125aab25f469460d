"""The minillm code this exercise rebuilds (the grader's reference; not a copy).

minillm's `accept` takes the verify step's logits, the request's SamplingParams and the drafter's q rows. The
adapters hand it what it expects: `accept_greedy` one-hot logits at the given argmaxes, under greedy params;
`accept_sampled` the log of each p row at temperature 1 (whose softmax is the row again) with the q rows as they are.
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
    return accept(drafts, p_rows.double().log(), SamplingParams(temperature=1.0), generator,
                  draft_probs=q_rows.double())
