"""Per-request timing records, filled by the engine as tokens are produced."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (seconds, `time.perf_counter`) of one request's life and its token counts."""

    arrival_time: float
    prompt_tokens: int = 0
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    output_tokens: int = 0

    def record_token(self, now: float) -> None:
        """Note that one more output token was produced at `now`."""
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)
        self.output_tokens += 1
