"""Chapter 9 — a replica's stream, slimmed: after a request's first output, each one carries only what is new.

A `RequestOutput` holds the prompt (its text and token ids) and every token time so far. Sent whole from a
replica to the ingress, each token would pickle the prompt and a growing list again: O(prompt + tokens) per
token. The replica sends the prompt once and each token time once (`Slim`); the ingress puts them back
(`Widen`), with one growing list of token times shared by the request's outputs, as the engine's own are.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..outputs import RequestOutput


@dataclass
class Slim:
    """At the replica, one request's outputs in turn: the first whole, the others without the prompt, each
    with only the token times not sent before."""

    started: bool = False
    times_sent: int = 0

    def __call__(self, out: RequestOutput) -> RequestOutput:
        times = out.metrics.token_times
        end = len(times)  # the engine may append meanwhile: what is sent is what is counted
        metrics = replace(out.metrics, token_times=times[self.times_sent:end])
        self.times_sent = end
        if not self.started:
            self.started = True
            return replace(out, metrics=metrics)
        return replace(out, prompt=None, prompt_token_ids=[], metrics=metrics)


@dataclass
class Widen:
    """At the ingress, one request's slimmed outputs in turn, whole again: the first one's prompt, and every
    token time so far."""

    first: RequestOutput | None = None
    token_times: list[float] = field(default_factory=list)

    def __call__(self, out: RequestOutput) -> RequestOutput:
        if self.first is None:
            self.first = out
        self.token_times.extend(out.metrics.token_times)
        return replace(out, prompt=self.first.prompt, prompt_token_ids=self.first.prompt_token_ids,
                       metrics=replace(out.metrics, token_times=self.token_times))
