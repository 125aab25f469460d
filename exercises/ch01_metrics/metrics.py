"""Exercise 1 — serving metrics from raw request records.

Replace each `raise NotImplementedError(...)` with your code, then run `make grade CH=01`.
Use plain Python (numpy is allowed, but write `percentile` yourself); do not import minillm
(that is what you are rebuilding).

A record is any object with these attributes (minillm's `RequestMetrics`), all times in seconds:
    arrival_time        when the request arrived
    first_token_time    when its first output token was produced (None if none was)
    token_times         when each output token was produced (token_times[0] == first_token_time)
    finished_time       when it finished (None while it is still running)
    prompt_tokens       number of prompt tokens
    output_tokens       number of output tokens (== len(token_times))
A record is *finished* when finished_time and first_token_time are set and output_tokens >= 1.
Every function below raises ValueError (with a message saying what is wrong) when given a record that
is not finished.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

SLO_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms")


def ttft(record) -> float:
    """Time to first token, in seconds: first_token_time - arrival_time."""
    raise NotImplementedError("ttft: write this function")


def tpot(record) -> float | None:
    """Time per output token after the first, in seconds: (finished - first token) / (output_tokens - 1).

    None for a request with a single output token (it has no gap between tokens).
    """
    raise NotImplementedError("tpot: write this function")


def itl(record) -> list[float]:
    """Inter-token latencies, in seconds: every gap between consecutive token_times ([] for one token)."""
    raise NotImplementedError("itl: write this function")


def e2el(record) -> float:
    """End-to-end latency, in seconds: finished_time - arrival_time."""
    raise NotImplementedError("e2el: write this function")


def percentile(values: Iterable[float], p: float) -> float:
    """The p-th percentile of values, with numpy's default ("linear") method, written by hand.

    Sort the n values; the percentile sits at fractional rank r = (n - 1) * p / 100 (0-based): take
    sorted[floor(r)] and move towards the next value by the fractional part of r.
    ValueError for no values, or for p outside [0, 100].
    """
    raise NotImplementedError("percentile: write this function")


def meets_slo(record, slo: Mapping[str, float]) -> bool:
    """Whether the request meets every bound in slo, e.g. {"ttft_ms": 500, "tpot_ms": 100} (milliseconds).

    Keys are any of SLO_KEYS; a bound is met when the latency (in ms) is <= the bound. A one-token request
    meets any TPOT bound. ValueError for any other key.
    """
    raise NotImplementedError("meets_slo: write this function")


def goodput(records: Sequence, slo: Mapping[str, float] | None, duration: float | None = None) -> float:
    """Requests per second that meet every SLO in slo (every request counts when slo is empty or None).

    duration defaults to the span from the first arrival to the last finish (seconds).
    ValueError for no records, or a duration that is not > 0.
    """
    raise NotImplementedError("goodput: write this function")


def summarize(records: Sequence, duration: float | None = None, slo: Mapping[str, float] | None = None,
              percentiles: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """A benchmark summary: one flat dict, like `vllm bench serve` prints. Keys and values:

    completed (number of records), duration (seconds; the default as in goodput),
    total_input_tokens, total_output_tokens (sums of prompt_tokens and output_tokens),
    request_throughput, output_throughput, total_token_throughput (requests, output tokens and
    input + output tokens per second of duration), goodput (as goodput() computes it),
    and for each metric M of ttft, tpot, itl, e2el, in milliseconds:
        M_ms_mean, M_ms_median, and M_ms_p{p} for each p in percentiles, formatted with f"{p:g}"
        (so "ttft_ms_p99", "ttft_ms_p99.9").
    TTFT and E2EL take one value per request, TPOT one per request with >= 2 tokens, ITL every gap of
    every request pooled together. A metric with no values (only one-token requests) is float("nan").
    ValueError for no records, an unknown SLO key, or a percentile outside [0, 100].
    """
    raise NotImplementedError("summarize: write this function")
