"""Chapter 4 — what `generate` returns: one RequestOutput per prompt, holding its completion(s) and timing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .metrics import RequestMetrics

if TYPE_CHECKING:
    from .kv_handoff import KVTransferParams

# One position's log-probabilities: the token there and the top alternatives, by token id.
PositionLogprobs = dict[int, "Logprob"]


@dataclass
class Logprob:
    """A token's log-probability at one position, its rank there (1 = most likely) and its text."""

    logprob: float
    rank: int
    decoded_token: str


@dataclass
class CompletionOutput:
    """One generated continuation: its text, tokens and why it stopped.

    `finish_reason` is "stop" (EOS, or a stop string or stop token id, which `stop_reason` then holds),
    "length", "abort", "error" (its logits had no finite value to sample from; the others in its batch carry
    on), or None while running. With `RequestOutputKind.DELTA` the text, tokens and log-probs are only the new
    ones since the previous output.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt, completions so far, whether it finished, and its timing record.

    `prompt_logprobs`, when asked for, has one entry per prompt token, the first `None`. `kv_transfer_params`
    is the handle a prefill for a remote decode hands over (chapter 9), else None.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = field(default=None)
    kv_transfer_params: KVTransferParams | None = None
