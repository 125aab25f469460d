"""Chapter 10 — speculative decoding: guess the next few tokens cheaply, then check them all in one forward pass.

A drafter proposes up to k tokens for a decoding sequence. The engine runs the sequence's last token and the
drafts through the model in one step (k + 1 positions over the paged KV cache, like a short prompt chunk), and
keeps the drafts the model agrees with, plus one token of its own: from 1 to k + 1 tokens per step for the price
of one pass over the weights. Greedy, a draft is kept while it equals the model's choice, so the output is the
same token for token. Sampling, a draft is kept with probability min(1, p / q), p the model's probability of it
and q the drafter's, and a rejected one is replaced by a draw from max(0, p - q), renormalized (Leviathan et al.;
Chen et al.): the output is then distributed exactly as the model's own samples. The drafter here is prompt lookup
(vLLM's "ngram"): the latest earlier occurrence of the sequence's last few tokens predicts what follows them. It
needs no second model and proposes with certainty (q = 1 on its token), so a draft is kept with probability p.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

import numpy as np
import torch

from .sampling import SamplingParams, filter_logits

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: `{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
    "prompt_lookup_min": m}`: up to k drafts per step, from the longest of the last n..m tokens found earlier."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method {self.method!r} is not supported; use "
                             + ", ".join(map(repr, METHODS)))
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) is above "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a dict, or its JSON text (the command line's `--speculative-config`); None stays None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        if unknown := sorted(value.keys() - known):
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        if missing := sorted({"method", "num_speculative_tokens"} - value.keys()):
            raise ValueError(f"speculative_config needs {missing}")
        return cls(**value)


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: for n from `n_max` down to `n_min`, find the latest earlier occurrence of the last n tokens;
    the up to k tokens that followed it are the drafts (none when no suffix occurred before)."""
    ids = np.asarray(tokens)
    for n in range(min(n_max, len(ids) - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # every n tokens but the suffix itself
        starts = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if len(starts):
            start = int(starts[-1]) + n
            return tokens[start:start + k]
    return []


def speculates(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a sequence's next tokens may be drafted: not when a rule depends on the tokens before each position
    (penalties, bad words, min_tokens still holding back stop tokens, a structured output's grammar), which one pass
    cannot apply to the drafts' positions. A grammar's mask at a draft's position needs its matcher advanced over
    the drafts before it, and rolled back over those rejected; a constrained sequence simply decodes one token
    per step."""
    return (not params.penalized and not params.bad_words and num_output_tokens >= params.min_tokens
            and params.structured_outputs is None)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The model's sampling distribution at each row of `logits [rows, vocab]`, as `sample` draws from it."""
    rows = logits.double()
    rows = ((rows - rows.amax(-1, keepdim=True)) / params.temperature).float()
    return filter_logits(rows, params.top_k, params.top_p, params.min_p).softmax(-1)


def accept(drafts: list[int], logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> list[int] | None:
    """The tokens a step emits for one sequence: the drafts kept, then the model's own next token. `logits` holds
    k + 1 rows (masks applied): row i scores the position of draft i, the last row the one after every draft.
    None when a row needed has no finite top logit (the sequence then fails, as `sample` says)."""
    top, argmax = logits.max(dim=-1)
    finite = top.isfinite().tolist()
    if params.greedy:
        choice, kept = argmax.tolist(), 0
        while kept < len(drafts) and finite[kept] and drafts[kept] == choice[kept]:
            kept += 1
        return drafts[:kept] + [choice[kept]] if finite[kept] else None
    for i, draft in enumerate(drafts):
        if not finite[i]:
            return None
        p = target_probs(logits[i:i + 1], params)[0].cpu()
        if torch.rand(1, generator=generator).item() < p[draft].item():
            continue  # kept with probability p / q, q = 1
        p[draft] = 0.0  # max(0, p - q): the draft's mass removed, the rest renormalized by multinomial
        return drafts[:i] + [int(torch.multinomial(p, 1, generator=generator))]
    if not finite[len(drafts)]:
        return None
    p = target_probs(logits[len(drafts):], params)[0].cpu()
    return drafts + [int(torch.multinomial(p, 1, generator=generator))]
