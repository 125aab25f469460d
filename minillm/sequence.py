"""Chapter 4 — a request inside the engine: its tokens so far, its KV blocks, its sampling state and its status."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .metrics import RequestMetrics
from .sampling import SamplingParams

if TYPE_CHECKING:
    from .kv_handoff import KVTransferParams
    from .output_processor import CompletionState


def claim_request_id(request_id: str | None, in_use, ids: Iterator[int]) -> str:
    """A request's id: the given one (a ValueError if `in_use` holds it), or the next of `ids` not in use."""
    if request_id is None:
        while (request_id := str(next(ids))) in in_use:
            pass
    request_id = str(request_id)
    if request_id in in_use:
        raise ValueError(f"request id {request_id!r} is already in use")
    return request_id


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # blocks allocated; the prompt's K/V are on their way (ch. 9)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # a sequence is itself: compared by identity, as the scheduler's queues need
class Sequence:
    """Prompt and output tokens of one request; `num_cached_tokens` of them already have K/V in the cache."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the computed full blocks
    num_cached_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    index: int = 0  # which of the request's n completions this sequence produces
    leader: Sequence | None = None  # for a sibling of an n > 1 request: the sibling that computes the prompt
    num_prompt_logprobs: int = 0  # prompt positions whose log-probs are recorded (asked for by prompt_logprobs)
    generator: torch.Generator | None = None
    # the tokens that end it: EOS unless ignore_eos, and params.stop_token_ids (min_tokens keeps them out)
    stop_token_ids: frozenset[int] = frozenset()
    bad_words: tuple[tuple[int, ...], ...] = ()  # the token spellings of params.bad_words, never completed
    completion: CompletionState | None = None  # its text and log-probs as the caller sees them
    # chapter 9, prefill/decode disaggregation: a prefill whose blocks are held for a decode instance to pull,
    # and a decode whose prompt's K/V another instance computed (cleared once they are installed here)
    do_remote_decode: bool = False
    remote_prefill: KVTransferParams | None = None
    # chapter 10: tokens a drafter proposed to follow this one, checked by this step's forward pass, and when a draft
    # model sampled them, its distribution at each (`[drafts, vocab]`, on the CPU; None: q = 1 on each draft)
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    # chapter 10: the matcher of params.structured_outputs (llguidance's), advanced by every token this sequence
    # emits, so that it always stands after the output so far (also across a preemption, which keeps the output)
    grammar: Any = None

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def next_token_ids(self, n: int) -> list[int]:
        """The next `n` tokens to run through the model: those not computed yet, then this step's drafts."""
        start = self.num_cached_tokens
        return (self.token_ids + self.draft_token_ids)[start:start + n]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V are not in the cache yet: the whole prompt at first, then one per step."""
        return self.num_tokens - self.num_cached_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def prompt_logprob_positions(self, num_new_tokens: int) -> range:
        """Positions among this step's new tokens whose logits score a prompt token not yet scored."""
        start = max(self.num_cached_tokens, self.num_prompt_logprobs)
        end = min(self.num_cached_tokens + num_new_tokens, len(self.prompt_token_ids) - 1)
        return range(start, end) if self.params.prompt_logprobs is not None else range(0)

    def waits_for_leader(self, block_size: int) -> bool:
        """A sibling starts once its leader's full prompt blocks are computed, so it finds them in the cache."""
        lead = self.leader
        return lead is not None and not lead.is_finished and \
            lead.num_cached_tokens < len(lead.prompt_token_ids) // block_size * block_size
