"""Chapter 10 — speculative decoding: guess the next few tokens cheaply, then check them all in one forward pass.

A drafter proposes up to k tokens for a decoding sequence. The engine runs the sequence's last token and the
drafts through the model in one step (k + 1 positions over the paged KV cache, like a short prompt chunk), and
keeps the drafts the model agrees with, plus one token of its own: from 1 to k + 1 tokens per step for the price
of one pass over the weights. Greedy, a draft is kept while it equals the model's choice, so the output is the
same token for token. Sampling, a draft x drawn from the drafter's distribution q is kept with probability
min(1, p(x) / q(x)), p the model's distribution, and a rejected one is replaced by a draw from max(0, p - q),
renormalized (Leviathan et al.; Chen et al.): the output is then distributed exactly as the model's own samples.

Two drafters. Prompt lookup (vLLM's "ngram"): the latest earlier occurrence of the sequence's last few tokens
predicts what follows them; it needs no second model and proposes with certainty (q = 1 on its token, so a draft
is kept with probability p(x)). A draft model (vLLM's "draft_model", `draft_model.py`): a cheaper model with the
same tokenizer, here the same model quantized to int4, drafts token by token from its own q.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

from .quant import QUANTIZATIONS
from .sampling import SamplingParams, filter_logits

METHODS = ("ngram", "draft_model")
NGRAM_KEYS = {"prompt_lookup_max": 4, "prompt_lookup_min": 2}  # with their defaults
DRAFT_MODEL_KEYS = ("model", "quantization")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`, with vLLM's key names.

    Prompt lookup: `{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min":
    m}`: up to k drafts per step, from the longest of the last n..m tokens found earlier (n = 4, m = 2 by default).

    A draft model: `{"method": "draft_model", "model": path, "num_speculative_tokens": k, "quantization": "int4"}`:
    the model at `path` (None: the default model, as `LLM(model=None)`) drafts k tokens per step; it must share
    the target's tokenizer. `quantization` (one of chapter 6's formats, or None) quantizes the draft's weights as
    they load, as `LLM(quantization=...)` does the target's; vLLM's key of that name says which format a draft
    checkpoint is stored in, so here it also turns a float checkpoint into a cheap drafter.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | Path | None = None
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method {self.method!r} is not supported; use "
                             + " or ".join(map(repr, METHODS)))
        others = DRAFT_MODEL_KEYS if self.method == "ngram" else NGRAM_KEYS
        for name in others:
            if getattr(self, name) is not None:
                owner = "draft_model" if self.method == "ngram" else "ngram"
                raise ValueError(f"speculative_config {name} is only for method {owner!r}, not {self.method!r}")
        if self.method == "ngram":
            for name, default in NGRAM_KEYS.items():
                if getattr(self, name) is None:
                    object.__setattr__(self, name, default)
        for name in ("num_speculative_tokens", *(NGRAM_KEYS if self.method == "ngram" else ())):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name} must be a positive integer, got {value!r}")
        if self.method == "ngram" and self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) is above "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.model is not None and not isinstance(self.model, (str, Path)):
            raise ValueError(f"speculative_config model must be a path or None, got {self.model!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"speculative_config quantization {self.quantization!r} is not supported; use "
                             + ", ".join(map(repr, QUANTIZATIONS)) + " or None")

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


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws from at each row of `logits [rows, vocab]` under `params` (temperature,
    top-k, top-p, min-p): the model's p when the rows are the model's, the drafter's q when they are the draft
    model's."""
    rows = logits.double()
    rows = ((rows - rows.amax(-1, keepdim=True)) / params.temperature).float()
    return filter_logits(rows, params.top_k, params.top_p, params.min_p).softmax(-1)


def accept(drafts: list[int], logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           draft_probs: torch.Tensor | None = None) -> list[int] | None:
    """The tokens a step emits for one sequence: the drafts kept, then the model's own next token. `logits` holds
    k + 1 rows (masks applied): row i scores the position of draft i, the last row the one after every draft.
    `draft_probs` holds the drafter's distribution q at each draft's position (`[k, vocab]`, on the CPU), from which
    the drafts were drawn; None for a drafter certain of its tokens (prompt lookup: q = 1 on the draft). None when a
    row needed has no finite top logit (the sequence then fails, as `sample` says)."""
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
        p = sampling_probs(logits[i:i + 1], params)[0].cpu()
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[draft] = 1.0
        else:
            q = draft_probs[i]
        if torch.rand(1, generator=generator).item() * q[draft].item() < p[draft].item():
            continue  # kept with probability min(1, p(x) / q(x))
        residual = (p - q).clamp_min(0.0)  # max(0, p - q), renormalized by multinomial
        if not residual.sum() > 0:  # p <= q everywhere only by rounding (p and q both sum to 1): draw from p
            residual = p
        return drafts[:i] + [int(torch.multinomial(residual, 1, generator=generator))]
    if not finite[len(drafts)]:
        return None
    p = sampling_probs(logits[len(drafts):], params)[0].cpu()
    return drafts + [int(torch.multinomial(p, 1, generator=generator))]
