"""Chapter 1 — serving metrics: per-request timing records, their summaries (vLLM `bench serve` definitions),
arrival processes and a latency-CDF plot. Drivers that replay a workload live in `minillm.bench`."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # only for type hints
    from matplotlib.axes import Axes

SLO_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms")  # the per-request latencies an SLO may bound, as in vLLM's --goodput


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


# --- per-request metrics (seconds) -------------------------------------------------------------------------

def check_finished(record: RequestMetrics) -> None:
    """Raise ValueError unless `record` describes a finished request with at least one token."""
    if record.finished_time is None:
        raise ValueError("request has not finished (finished_time is None); summarize finished requests only")
    if record.first_token_time is None or record.output_tokens < 1:
        raise ValueError("request produced no output token (an aborted request?); it has no TTFT")
    if len(record.token_times) != record.output_tokens:
        raise ValueError(f"request has {len(record.token_times)} token_times for {record.output_tokens} output tokens")


def ttft(record: RequestMetrics) -> float:
    """Time to first token: first token − arrival (queueing, preprocessing, prefill and first sampling)."""
    check_finished(record)
    return record.first_token_time - record.arrival_time


def tpot(record: RequestMetrics) -> float | None:
    """Time per output token after the first: (finished − first token) / (output_tokens − 1); None for one token."""
    check_finished(record)
    if record.output_tokens < 2:
        return None
    return (record.finished_time - record.first_token_time) / (record.output_tokens - 1)


def itl(record: RequestMetrics) -> list[float]:
    """Inter-token latencies: every gap between consecutive tokens (empty for a one-token request)."""
    check_finished(record)
    return [b - a for a, b in zip(record.token_times, record.token_times[1:])]


def e2el(record: RequestMetrics) -> float:
    """End-to-end latency: finished − arrival."""
    check_finished(record)
    return record.finished_time - record.arrival_time


def percentile(values: Iterable[float], p: float) -> float:
    """The p-th percentile (0 ≤ p ≤ 100) with linear interpolation between order statistics (numpy's default)."""
    values = sorted(values)
    if not values:
        raise ValueError("percentile of no values is undefined")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    rank = (len(values) - 1) * p / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (rank - lo)


def check_slo(slo: Mapping[str, float]) -> None:
    """Raise ValueError for an SLO key other than ttft_ms, tpot_ms, e2el_ms, or a negative bound."""
    for key, bound in slo.items():
        if key not in SLO_KEYS:
            raise ValueError(f"unknown SLO key {key!r}; use any of {', '.join(SLO_KEYS)} (milliseconds)")
        if not isinstance(bound, (int, float)) or isinstance(bound, bool) or not bound >= 0:
            raise ValueError(f"SLO {key} must be a number of milliseconds >= 0, got {bound!r}")


def meets_slo(record: RequestMetrics, slo: Mapping[str, float]) -> bool:
    """Whether the request is within every bound of `slo` (ms, inclusive); one-token requests meet any TPOT bound."""
    check_slo(slo)
    measured = {"ttft_ms": ttft(record), "tpot_ms": tpot(record) or 0.0, "e2el_ms": e2el(record)}
    return all(measured[key] * 1000 <= bound for key, bound in slo.items())


def default_duration(records: Sequence[RequestMetrics]) -> float:
    """Seconds from the first arrival to the last finish: the default duration of a benchmark."""
    for r in records:
        check_finished(r)
    return max(r.finished_time for r in records) - min(r.arrival_time for r in records)


def goodput(records: Sequence[RequestMetrics], slo: Mapping[str, float] | None, duration: float | None = None) -> float:
    """Requests per second that meet every SLO in `slo` (all of them when `slo` is empty or None)."""
    if not records:
        raise ValueError("goodput of no requests is undefined")
    duration = default_duration(records) if duration is None else duration
    if not duration > 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration}")
    return sum(meets_slo(r, slo or {}) for r in records) / duration


# --- the benchmark summary -----------------------------------------------------------------------------------

def _stats(name: str, seconds: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    """Mean, median and percentiles of one latency, in milliseconds (NaN when no request has one)."""
    ms = [s * 1000 for s in seconds]
    out = {f"{name}_ms_mean": sum(ms) / len(ms) if ms else math.nan,
           f"{name}_ms_median": percentile(ms, 50) if ms else math.nan}
    for p in percentiles:
        out[f"{name}_ms_p{p:g}"] = percentile(ms, p) if ms else math.nan
    return out


def summarize(records: Sequence[RequestMetrics], duration: float | None = None,
              slo: Mapping[str, float] | None = None, percentiles: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """A flat dict of latency statistics (ms), throughputs (per second over `duration`) and goodput.

    Definitions follow `vllm bench serve`: TTFT, TPOT (requests with ≥ 2 tokens), ITL (all gaps, pooled), E2EL;
    `duration` defaults to first arrival → last finish; `slo` bounds ttft_ms / tpot_ms / e2el_ms for goodput.
    """
    if not records:
        raise ValueError("no request records to summarize")
    check_slo(slo or {})
    for p in percentiles:
        if not 0 <= p <= 100:
            raise ValueError(f"percentiles must be in [0, 100], got {p}")
    duration = default_duration(records) if duration is None else duration
    if not duration > 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration}")
    input_tokens = sum(r.prompt_tokens for r in records)
    output_tokens = sum(r.output_tokens for r in records)
    out = {"completed": len(records), "duration": duration,
           "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
           "request_throughput": len(records) / duration, "output_throughput": output_tokens / duration,
           "total_token_throughput": (input_tokens + output_tokens) / duration,
           "goodput": goodput(records, slo, duration)}
    out |= _stats("ttft", [ttft(r) for r in records], percentiles)
    out |= _stats("tpot", [t for t in map(tpot, records) if t is not None], percentiles)
    out |= _stats("itl", [gap for r in records for gap in itl(r)], percentiles)
    out |= _stats("e2el", [e2el(r) for r in records], percentiles)
    return out


# --- arrival processes -------------------------------------------------------------------------------------

def gamma_arrivals(rate: float, n: int, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Arrival times (s, the first at 0) whose gaps are Gamma(shape=burstiness, mean=1/rate), like vLLM's
    `--burstiness`: 1 is a Poisson process, below 1 burstier, above 1 more regular (CV = 1/√burstiness)."""
    if n < 1:
        raise ValueError(f"need n >= 1 arrivals, got {n}")
    if not rate > 0 or not burstiness > 0:
        raise ValueError(f"rate and burstiness must be > 0, got rate={rate}, burstiness={burstiness}")
    if math.isinf(rate):
        return [0.0] * n  # every request at once: an offline batch
    gaps = np.random.default_rng(seed).gamma(burstiness, 1 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def poisson_arrivals(rate: float, n: int, seed: int = 0) -> list[float]:
    """Arrival times (s, the first at 0) of a Poisson process of `rate` requests per second."""
    return gamma_arrivals(rate, n, 1.0, seed)


# --- plots -------------------------------------------------------------------------------------------------

def plot_cdf(ax: Axes, values_ms: Sequence[float], label: str, percentiles: Sequence[float] = (50, 90, 99)) -> None:
    """Draw the empirical CDF of a latency on a matplotlib axis, with the requested percentiles marked."""
    xs = np.sort(np.asarray(values_ms, dtype=float))
    if xs.size == 0:
        raise ValueError("no values to plot")
    line, = ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=label)
    for p in percentiles:
        x = percentile(xs, p)
        ax.axvline(x, color=line.get_color(), linestyle=":", linewidth=1)
        ax.annotate(f"P{p:g}", (x, p / 100), xytext=(3, -10), textcoords="offset points", fontsize=8,
                    color=line.get_color())
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of requests ≤ x")
    ax.set_ylim(0, 1.02)
