"""Chapter 4 — sampling parameters, and the sampler that turns next-token logits into tokens and
log-probabilities."""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .kernels import small_ops
from .layers import runs_in_c
from .structured_output import StructuredOutputsParams, allowed_tokens

if TYPE_CHECKING:
    from .sequence import Sequence

MAX_N = 128  # completions per request, OpenAI's bound
MAX_LOGPROBS = 20  # top alternatives per position, OpenAI's bound for top_logprobs (and vLLM's default)
SEED_RANGE = (-2 ** 63, 2 ** 64 - 1)  # what torch.Generator.manual_seed accepts
# The repetition penalty divides or multiplies float32 logits (float32 spans 1.18e-38 to 3.4e38): within these
# bounds the penalty is a normal float32 and a logit up to 1e8 in size stays finite after it. Temperature needs no
# such bound: `sample` divides in float64, after shifting the top logit to 0.
REPETITION_PENALTY_RANGE = (1e-30, 1e30)


class RequestOutputKind(enum.Enum):
    """What each output of a request carries (vLLM's names)."""

    CUMULATIVE = 0  # everything so far: the whole text and every token
    DELTA = 1  # only what is new since the previous output (for streaming)
    FINAL_ONLY = 2  # nothing until the request finishes, then everything


def _check_int(name: str, value, low: int, high: int | None = None, what: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {bound}{what}, got {value!r}")


def _check_float(name: str, value, ok, bound: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


def check_truncate_prompt_tokens(keep: int | None) -> None:
    """vLLM's `truncate_prompt_tokens` is None, -1 (as many as the context holds) or a count >= 1."""
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or (keep < 1 and keep != -1)):
        raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, or -1 for as many as the context holds, "
                         f"got {keep!r}")


def _token_id_list(ids) -> bool:
    return isinstance(ids, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                  for t in ids)


def check_token_ids(name: str, ids: list[int], vocab_size: int) -> None:
    """Reject token ids outside a vocabulary of `vocab_size` (a ValueError naming them)."""
    if bad := [t for t in ids if t >= vocab_size]:
        raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


def bad_words_token_ids(words: list[str], encode) -> tuple[tuple[int, ...], ...]:
    """The token sequences that spell each of `words` (vLLM's rule): the word as written (leading spaces dropped),
    and with one leading space when that spelling is a different first token and as many tokens. `encode` turns
    text into token ids without special tokens."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(encode(word.lstrip()))
        spaced = tuple(encode(" " + word.lstrip()))
        out.append(bare)
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return tuple(out)


def banned_tokens(bad_words: tuple[tuple[int, ...], ...], output: list[int]) -> Iterator[int]:
    """The tokens that would complete a bad word now: each word's last token, when the output so far ends with
    its other tokens (a one-token word is always banned)."""
    for word in bad_words:
        head = len(word) - 1
        if head <= len(output) and (head == 0 or tuple(output[-head:]) == word[:-1]):
            yield word[-1]


@dataclass
class SamplingParams:
    """How to pick each next token, how many completions, what to report and when to stop.

    vLLM's names and defaults (greedy by default). Every field is checked here, at the boundary, so a
    bad value is a `ValueError` naming it rather than a failure inside a later engine step.
    """

    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    ignore_eos: bool = False
    seed: int | None = None
    stop: str | list[str] | None = None
    logprobs: int | None = None  # log-probs of each chosen token and of this many top alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token (after the first)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stop_token_ids: list[int] | None = None  # sampling one of these ends the completion (stop_reason: the id)
    min_tokens: int = 0  # no EOS, stop token or stop string before this many output tokens
    min_p: float = 0.0  # drop tokens less likely than min_p x the top token (after temperature)
    repetition_penalty: float = 1.0  # tokens already in the prompt or output: logit / p if positive, x p if not
    presence_penalty: float = 0.0  # subtracted from the logit of every token already in the output
    frequency_penalty: float = 0.0  # subtracted once per earlier occurrence in the output
    include_stop_str_in_output: bool = False  # keep the matched stop string (or stop token's text) in the text
    skip_special_tokens: bool = True  # leave special tokens' text out of the output text
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    bad_words: list[str] | None = None  # words never generated (each with and without a leading space)
    truncate_prompt_tokens: int | None = None  # run only the prompt's last k tokens (-1: as many as the context holds)
    # chapter 10: what the output must match (a JSON schema, regex, choice or grammar); such a completion ends when
    # it samples EOS, which its grammar allows only where the output is complete, even with ignore_eos
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1, MAX_N)
        _check_float("temperature", self.temperature, lambda t: t >= 0, ">= 0 (0 means greedy)")
        _check_float("top_p", self.top_p, lambda p: 0 < p <= 1, "in (0, 1]")
        _check_int("top_k", self.top_k, -1, what=" (0 or -1 disables it)")
        _check_int("max_tokens", self.max_tokens, 1)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, *SEED_RANGE, what=" or None")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is None:
            stops = []
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = list(stops)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS, what=" or None")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not _token_id_list(ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (integers >= 0) or None, "
                             f"got {self.stop_token_ids!r}")
        self.stop_token_ids = list(ids)
        if self.allowed_token_ids is not None:
            if not _token_id_list(self.allowed_token_ids) or not self.allowed_token_ids:
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids (integers >= 0) or None, "
                                 f"got {self.allowed_token_ids!r}")
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) and w.strip()
                                                                        for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of words (strings with some non-space text) or None, "
                                 f"got {self.bad_words!r}")
            self.bad_words = list(self.bad_words)
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or None, "
                             f"got {type(self.structured_outputs).__name__}")
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens, what=" (at most max_tokens)")
        if self.min_tokens and self.structured_outputs is not None:  # it would hold back the EOS a grammar may force
            raise ValueError("min_tokens cannot be used with structured_outputs: the grammar decides where the "
                             "output may end")
        _check_float("min_p", self.min_p, lambda p: 0 <= p <= 1, "in [0, 1]")
        low, high = REPETITION_PENALTY_RANGE
        _check_float("repetition_penalty", self.repetition_penalty, lambda p: low <= p <= high,
                     f"in [{low:g}, {high:g}] (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), lambda p: -2 <= p <= 2, "in [-2, 2]")
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether a repetition, presence or frequency penalty is on (each changes even a greedy choice)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Set to -inf every logit of a token less likely than min_p x the top token, outside the top-k, or outside
    the smallest set whose probability reaches top-p (in that order, as vLLM)."""
    if min_p > 0:  # p < min_p * p_top  <=>  logit < top logit + log(min_p): the softmax's normaliser cancels
        floor = logits.amax(-1, keepdim=True) + math.log(min_p)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p (the top token always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[..., 0] = False  # also when top_p is below float32's range and compares as 0
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """`[rows, vocab]` counts of each token id in each list: one bincount over all of them."""
    ids = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long, device=device)
    lengths = torch.tensor([len(t) for t in token_lists], device=device)
    rows = torch.repeat_interleave(torch.arange(len(token_lists), device=device), lengths)
    return torch.bincount(rows * vocab + ids, minlength=len(token_lists) * vocab).view(len(token_lists), vocab)


def apply_masks(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The tokens a sequence may not sample, set to -inf in `logits [seqs, vocab]` before anything else (vLLM's
    order): those outside its `allowed_token_ids`, those that would complete one of its `bad_words`, and those its
    grammar refuses next (chapter 10's structured output).

    Returns `logits` itself when no sequence has any of them, else a float32 copy.
    """
    allowed = [i for i, s in enumerate(seqs) if s.params.allowed_token_ids]
    banned = [(i, t) for i, s in enumerate(seqs) if s.bad_words
              for t in banned_tokens(s.bad_words, s.output_token_ids)]
    constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if not allowed and not banned and not constrained:
        return logits
    logits = logits.to(torch.float32, copy=True)
    if constrained:  # row by row, in place: no gather and scatter of the rows
        refused = ~allowed_tokens([seqs[i].grammar for i in constrained], logits.shape[-1]).to(logits.device)
        for i, row in zip(constrained, refused):
            logits[i].masked_fill_(row, float("-inf"))
    if allowed:
        keep = torch.zeros(len(allowed), logits.shape[-1], dtype=torch.bool, device=logits.device)
        ids = [seqs[i].params.allowed_token_ids for i in allowed]
        keep[[j for j, row in enumerate(ids) for _ in row], list(itertools.chain.from_iterable(ids))] = True
        logits[allowed] = logits[allowed].masked_fill(~keep, float("-inf"))
    if banned:
        logits[[i for i, _ in banned], [t for _, t in banned]] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The rules that change even a greedy choice, applied to `logits [seqs, vocab]` before temperature (vLLM's
    order): before `min_tokens` a sequence's stop tokens (EOS, stop_token_ids) are set to -inf; then the
    repetition penalty (over prompt and output tokens), frequency and presence penalties (over output tokens).

    Returns `logits` itself when no sequence asks for any of them, else a float32 copy.
    """
    early = [i for i, s in enumerate(seqs) if len(s.output_token_ids) < s.params.min_tokens and s.stop_token_ids]
    rows = [i for i, s in enumerate(seqs) if s.params.penalized]
    if not early and not rows:
        return logits
    logits = logits.to(torch.float32, copy=True)
    if early:
        banned = [(i, t) for i in early for t in seqs[i].stop_token_ids]
        logits[[i for i, _ in banned], [t for _, t in banned]] = float("-inf")
    if rows:
        penalized = [seqs[i] for i in rows]
        vocab, device = logits.shape[-1], logits.device
        part = logits[rows]
        output = _token_counts([s.output_token_ids for s in penalized], vocab, device)
        seen = output > 0
        if any(s.params.repetition_penalty != 1 for s in penalized):
            repetition = torch.tensor([s.params.repetition_penalty for s in penalized], device=device)[:, None]
            seen_anywhere = seen | (_token_counts([s.prompt_token_ids for s in penalized], vocab, device) > 0)
            part = torch.where(seen_anywhere, torch.where(part > 0, part / repetition, part * repetition), part)
        frequency, presence = (torch.tensor([getattr(s.params, name) for s in penalized], device=device)[:, None]
                               for name in ("frequency_penalty", "presence_penalty"))
        logits[rows] = part - frequency * output - presence * seen
    return logits


def first_argmax(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (its first top value, as `argmax`), or -1 where that top value is not finite: one pass
    over the logits and one transfer from the device. Float32 rows on a CPU go to a C loop (`kernels/small_ops.c`),
    which PyTorch's max with indices runs several times slower; the tests check both agree."""
    if runs_in_c(logits) and logits.is_contiguous():
        return small_ops.argmax(logits).tolist()
    top, argmax = logits.max(dim=-1)
    return torch.where(top.isfinite(), argmax, -1).tolist()


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int | None]:
    """One token per row of `logits [seqs, vocab]`: argmax when greedy, else a draw from the filtered softmax.

    Each sequence draws from its own generator, so a seeded request samples the same text whatever it is
    batched with. Masks and penalties, when asked for, are already in `logits` (`apply_masks`,
    `apply_penalties`). A row whose top logit is not finite (a NaN or +inf in it, or every token at -inf) has no
    distribution: its token is None, and the other rows are sampled as usual.
    """
    tokens = first_argmax(logits)
    for i, (p, gen) in enumerate(zip(params, generators)):
        if tokens[i] < 0:
            tokens[i] = None
            continue
        if p.greedy:
            continue
        row = logits[i].double()
        # shifted so the largest is 0, and divided in float64: a tiny temperature then sends the others to
        # -inf, rather than the largest to +inf or the temperature to float32's 0 (either makes a NaN)
        row = filter_logits(((row - row.max()) / p.temperature).float(), p.top_k, p.top_p, p.min_p)
        probs = row.softmax(-1)
        tokens[i] = int(torch.multinomial(probs.cpu(), 1, generator=gen))
    return tokens


@dataclass
class TokenLogprobs:
    """Log-probabilities at one position: of the token that came next, and of the `k` most likely tokens."""

    token_id: int
    logprob: float
    rank: int  # 1 for the most likely token
    top_ids: list[int]
    top_logprobs: list[float]


def logprobs_of(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprobs]:
    """Log-softmax of each row of `logits [rows, vocab]` at `token_ids[row]`, with its rank and the top `k`.

    These are the model's own distribution, before masks, penalties, temperature, top-k or top-p (vLLM's
    "raw_logprobs").
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, device=logp.device)
    chosen = logp.gather(1, ids[:, None])
    ranks = (logp > chosen).sum(-1) + 1
    top = torch.topk(logp, k, dim=-1) if k else None
    chosen, ranks = chosen[:, 0].tolist(), ranks.tolist()
    top_ids, top_lps = (top.indices.tolist(), top.values.tolist()) if top else ([[]] * len(token_ids),) * 2
    return [TokenLogprobs(t, lp, r, i, v) for t, lp, r, i, v in zip(token_ids, chosen, ranks, top_ids, top_lps)]
