"""What `generate` returns: one RequestOutput per prompt, holding its completion(s) and timing."""

from __future__ import annotations

from dataclasses import dataclass

from .metrics import RequestMetrics


@dataclass
class CompletionOutput:
    """One generated continuation: its text, tokens and why it stopped ("stop", "length", or None if running)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    """A request's prompt, completions so far, whether it finished, and its timing record."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
