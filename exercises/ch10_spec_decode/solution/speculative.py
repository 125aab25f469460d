"""A solution to exercise 10 written from the stub's docstrings alone, never from minillm.

`python -m exercises.selfcheck` grades it: full marks prove that the stub says everything the grader checks. It
draws its random numbers in another order than minillm (every uniform first), which the statistical grader
allows. It lives in its own folder so that the stub finder sees one student file.
"""

from __future__ import annotations

import torch


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the longest suffix found, n_max down to n_min."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[-n:]
        for j in range(len(tokens) - 1 - n, -1, -1):  # latest first; j + n <= len(tokens) - 1
            if tokens[j:j + n] == suffix:
                return tokens[j + n:j + n + k]
    return []


def accept_greedy(drafts: list[int], target_argmax: list[int]) -> list[int]:
    """Drafts kept while they equal the argmax, then the argmax at the first position not kept."""
    m = 0
    while m < len(drafts) and drafts[m] == target_argmax[m]:
        m += 1
    return [int(t) for t in drafts[:m]] + [int(target_argmax[m])]


def _draw(row: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(row.double(), 1, generator=generator))


def accept_sampled(drafts: list[int], p_rows: torch.Tensor, q_rows: torch.Tensor,
                   generator: torch.Generator) -> list[int]:
    """Rejection sampling: keep draft i with probability min(1, p/q), else draw from max(0, p - q); all kept:
    draw from the last row."""
    k = len(drafts)
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64)
    for i, d in enumerate(drafts):
        p, q = p_rows[i].double(), q_rows[i].double()
        if uniforms[i] < p[d] / q[d]:  # kept with probability min(1, p/q)
            continue
        residual = (p - q).clamp(min=0.0)
        return [int(t) for t in drafts[:i]] + [_draw(residual, generator)]
    return [int(t) for t in drafts] + [_draw(p_rows[k], generator)]
