"""Chapter 6 — perplexity: how well a model predicts a text, token by token, measured through the engine itself.

The log-probabilities come from the engine's own forward pass (`SamplingParams(prompt_logprobs=0)`), so
what is measured is the model as it is served: its dtype, its kernels and its quantized weights. A text
longer than one window is scored in overlapping windows (Hugging Face's sliding-window recipe): every
token is scored once, with at least `window - stride` tokens of context except near the start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib.resources import files

import numpy as np

from .sampling import SamplingParams


def eval_text() -> str:
    """The text shipped with minillm for measuring perplexity: prose on several topics, then some code."""
    return files(__package__).joinpath("data/eval_text.md").read_text(encoding="utf-8")


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """`(begin, end, first)` per window: it reads tokens [begin, end) and scores tokens [first, end).

    Windows start every `stride` tokens; each scores only the tokens no earlier window reached, so the
    first token is never scored (nothing comes before it) and every other token is scored exactly once.
    """
    if not isinstance(window, int) or isinstance(window, bool) or window < 2:
        raise ValueError(f"window must be an integer >= 2, got {window!r}")
    if not isinstance(stride, int) or isinstance(stride, bool) or not 1 <= stride < window:
        raise ValueError(f"stride must be an integer in [1, window - 1] = [1, {window - 1}], got {stride!r}")
    if num_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score (the first has no context), got {num_tokens}")
    spans, first = [], 1
    for begin in range(0, num_tokens, stride):
        end = min(begin + window, num_tokens)
        spans.append((begin, end, first))
        if end == num_tokens:
            break
        first = end
    return spans


def token_logprobs(llm, token_ids: list[int], window: int = 1024, stride: int | None = None) -> np.ndarray:
    """Log-prob of each token after the first given the tokens before it (in its window): `len(token_ids) - 1`.

    All windows go to the engine in one `generate` call, which batches them. A request that asks for
    prompt log-probs takes no prefix-cache hits (the block manager computes every prompt position for
    it), so a warm cache changes nothing; a window missing any position is an error, never a shifted
    score. `stride` defaults to half the window.
    """

    stride = window // 2 if stride is None and isinstance(window, int) else stride
    token_ids = list(token_ids)
    spans = sliding_windows(len(token_ids), window, stride)
    longest = max(end - begin for begin, end, _ in spans)
    if longest >= llm.engine.max_model_len:
        raise ValueError(f"window {window} is too long for this engine: a prompt holds at most "
                         f"{llm.engine.max_model_len - 1} tokens")
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([token_ids[begin:end] for begin, end, _ in spans], params, use_tqdm=False)
    logprobs = np.empty(len(token_ids) - 1)
    for (begin, end, first), out in zip(spans, outs):
        if len(out.prompt_logprobs) != end - begin:  # positions served from a cache would come back unscored
            raise RuntimeError(f"the engine scored {len(out.prompt_logprobs) - 1} of a window's {end - begin - 1}"
                               " prompt positions")
        for pos in range(first, end):
            logprobs[pos - 1] = out.prompt_logprobs[pos - begin][token_ids[pos]].logprob
    return logprobs


@dataclass
class PerplexityResult:
    """How many tokens were scored, their mean negative log-likelihood (nats), its exp, and each token's NLL."""

    num_tokens: int
    nll: float
    perplexity: float
    token_nll: np.ndarray  # one per scored token, in text order (token i + 1 of the tokenized text)


def perplexity(llm, text: str | None = None, max_tokens: int | None = None, window: int = 1024,
               stride: int = 512) -> PerplexityResult:
    """Perplexity of `text` (default: `eval_text()`), or of its first `max_tokens` tokens, under `llm`'s model."""
    if text is None:
        text = eval_text()
    if not isinstance(text, str):
        raise ValueError(f"text must be a string, got {type(text).__name__}")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 2):
        raise ValueError(f"max_tokens must be an integer >= 2 or None, got {max_tokens!r}")
    _, token_ids = llm.engine.tokenize(text)
    token_nll = -token_logprobs(llm, token_ids[:max_tokens], window, stride)
    nll = float(token_nll.mean())
    return PerplexityResult(len(token_nll), nll, math.exp(nll), token_nll)


@dataclass
class Agreement:
    """How closely greedy decoding under one model follows a reference model's greedy outputs."""

    prefix_tokens: list[int]  # per prompt: tokens equal to the reference's before the first difference
    top1: float  # share of the reference's tokens that are also this model's first choice, given the same context
    num_tokens: int  # reference tokens compared

    @property
    def identical(self) -> int:
        """Prompts whose whole output equals the reference's."""
        return sum(n == -1 for n in self.prefix_tokens)


def greedy_agreement(llm, prompts: list[list[int]], reference: list[list[int]]) -> Agreement:
    """Compare `llm`'s greedy outputs with `reference` (another model's greedy outputs for the same prompts).

    Free-running outputs split for good at their first different token, after which the two texts diverge;
    so the teacher-forced rate is given too: with the reference's tokens as context, how often this model's
    top choice is the reference's next token (from its prompt log-probs, rank 1). In `prefix_tokens`, -1
    marks an output equal to the reference's in full.
    """
    if len(prompts) != len(reference) or not all(reference):
        raise ValueError("give one non-empty reference output per prompt")
    outs = llm.generate(prompts, [SamplingParams(max_tokens=len(r), ignore_eos=True) for r in reference],
                        use_tqdm=False)
    prefix = []
    for out, ref in zip(outs, reference):
        ours = out.outputs[0].token_ids
        prefix.append(next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), -1))
    params = SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    forced = llm.generate([p + r for p, r in zip(prompts, reference)], params, use_tqdm=False)
    hits = [out.prompt_logprobs[len(p) + i][t].rank == 1
            for out, p, r in zip(forced, prompts, reference) for i, t in enumerate(r)]
    return Agreement(prefix, sum(hits) / len(hits), len(hits))


def change_interval(base_nll: np.ndarray, nll: np.ndarray, block: int = 32, samples: int = 2000,
                    level: float = 0.9, seed: int = 0) -> tuple[float, float, float]:
    """A perplexity change in percent, `exp(mean(nll) - mean(base_nll)) - 1`, with a `level` interval.

    Both models scored the same tokens, so the change is read from the per-token differences, resampled in
    contiguous blocks of `block` tokens (a paired block bootstrap: neighbouring tokens are not independent).
    The interval says how much the change depends on which stretch of text was scored, which is the noise a
    ranking of two formats on one short text must clear. Returns (change, low, high).
    """
    base_nll, nll = np.asarray(base_nll, dtype=np.float64), np.asarray(nll, dtype=np.float64)
    if base_nll.ndim != 1 or base_nll.shape != nll.shape or len(nll) < 2 * block:
        raise ValueError(f"give two equal-length per-token NLL arrays of at least {2 * block} tokens")
    diff = nll - base_nll
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    blocks = diff[: len(diff) // block * block].reshape(-1, block).mean(axis=1)
    rng = np.random.default_rng(seed)
    means = blocks[rng.integers(0, len(blocks), size=(samples, len(blocks)))].mean(axis=1)
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return tuple(100 * math.expm1(m) for m in (diff.mean(), low, high))
