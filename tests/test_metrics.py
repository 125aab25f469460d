"""Serving metrics: hand-computed summaries, percentiles against numpy, goodput under SLOs, arrival processes,
the open- and closed-loop drivers (minillm.bench) on a tiny random model, and an import without PyTorch."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from minillm import LLMEngine, SamplingParams
from minillm.bench import replay, run_closed_loop
from minillm.metrics import (RequestMetrics, e2el, gamma_arrivals, goodput, itl, meets_slo, percentile, plot_cdf,
                             poisson_arrivals, summarize, tpot, ttft)


def record(arrival: float, token_times: list[float], prompt_tokens: int = 4) -> RequestMetrics:
    """A finished request whose tokens came at `token_times` (seconds)."""
    r = RequestMetrics(arrival_time=arrival, prompt_tokens=prompt_tokens)
    for t in token_times:
        r.record_token(t)
    r.finished_time = token_times[-1]
    return r


@pytest.fixture
def three() -> list[RequestMetrics]:
    """A: 3 tokens; B: a single token; C: 4 evenly spaced tokens. First arrival 0 s, last finish 1.2 s."""
    return [record(0.0, [0.1, 0.3, 0.6], 5), record(0.2, [0.5], 3), record(0.4, [0.9, 1.0, 1.1, 1.2], 7)]


def test_per_request_metrics(three):
    a, b, c = three
    assert ttft(a) == pytest.approx(0.1) and ttft(b) == pytest.approx(0.3) and ttft(c) == pytest.approx(0.5)
    assert tpot(a) == pytest.approx(0.25) and tpot(b) is None and tpot(c) == pytest.approx(0.1)
    assert itl(a) == pytest.approx([0.2, 0.3]) and itl(b) == [] and itl(c) == pytest.approx([0.1] * 3)
    assert e2el(a) == pytest.approx(0.6) and e2el(b) == pytest.approx(0.3) and e2el(c) == pytest.approx(0.8)
    for r in (a, c):  # E2EL = TTFT + (n - 1) * TPOT, exactly
        assert e2el(r) == pytest.approx(ttft(r) + (r.output_tokens - 1) * tpot(r))


def test_summarize_by_hand(three):
    s = summarize(three)
    expected = {
        "completed": 3, "duration": 1.2, "total_input_tokens": 15, "total_output_tokens": 8,
        "request_throughput": 3 / 1.2, "output_throughput": 8 / 1.2, "total_token_throughput": 23 / 1.2,
        "goodput": 3 / 1.2,  # no SLO: every request counts
        "ttft_ms_mean": 300, "ttft_ms_median": 300, "ttft_ms_p50": 300, "ttft_ms_p90": 460, "ttft_ms_p99": 496,
        "tpot_ms_mean": 175, "tpot_ms_median": 175, "tpot_ms_p50": 175, "tpot_ms_p90": 235, "tpot_ms_p99": 248.5,
        "itl_ms_mean": 160, "itl_ms_median": 100, "itl_ms_p50": 100, "itl_ms_p90": 260, "itl_ms_p99": 296,
        "e2el_ms_mean": 1700 / 3, "e2el_ms_median": 600, "e2el_ms_p50": 600, "e2el_ms_p90": 760, "e2el_ms_p99": 796,
    }
    assert s.keys() == expected.keys()
    for key, value in expected.items():
        assert s[key] == pytest.approx(value), key


def test_summarize_duration_and_percentiles(three):
    s = summarize(three, duration=4.0, percentiles=(25, 99.9))
    assert s["request_throughput"] == 0.75 and s["output_throughput"] == 2.0 and s["total_token_throughput"] == 5.75
    assert "ttft_ms_p99" not in s and s["ttft_ms_p25"] == pytest.approx(200) and "e2el_ms_p99.9" in s
    assert s["ttft_ms_p99.9"] == pytest.approx(300 + 0.998 * 200)


@pytest.mark.parametrize("slo, good", [
    ({"ttft_ms": 400}, 2),                   # C waited 500 ms
    ({"tpot_ms": 120}, 2),                   # A is too slow per token; B has one token and passes any TPOT SLO
    ({"ttft_ms": 400, "tpot_ms": 120}, 1),   # every SLO must hold: only B
    ({"e2el_ms": 600}, 2),                   # bounds are inclusive: A's 600 ms passes
    ({"ttft_ms": 1, "tpot_ms": 1}, 0),
    ({}, 3),
])
def test_goodput(three, slo, good):
    assert goodput(three, slo) == pytest.approx(good / 1.2)
    assert summarize(three, slo=slo)["goodput"] == pytest.approx(good / 1.2)
    assert sum(meets_slo(r, slo) for r in three) == good


def test_one_token_requests_only():
    s = summarize([record(0.0, [0.2]), record(0.1, [0.4])], slo={"tpot_ms": 0})
    assert s["ttft_ms_mean"] == pytest.approx(250) and s["e2el_ms_p50"] == pytest.approx(250)
    assert math.isnan(s["tpot_ms_mean"]) and math.isnan(s["tpot_ms_p99"]) and math.isnan(s["itl_ms_median"])
    assert s["goodput"] == pytest.approx(2 / 0.4)


def test_ties_and_single_values():
    assert percentile([7.0], 0) == 7.0 and percentile([7.0], 99) == 7.0
    assert all(percentile([5, 5, 5, 5], p) == 5 for p in (0, 50, 90, 99, 100))
    assert percentile([1, 2, 2, 2, 3], 50) == 2 and percentile([3, 1, 2], 100) == 3 and percentile([3, 1, 2], 0) == 1
    s = summarize([record(0.0, [0.1, 0.2]), record(0.0, [0.1, 0.2])])
    assert s["ttft_ms_p99"] == pytest.approx(100) and s["tpot_ms_p50"] == pytest.approx(100)


def test_percentile_matches_numpy_linear():
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 10, 101):
        values = rng.exponential(size=n).tolist() + rng.integers(0, 3, size=n).tolist()  # with ties
        for p in (0, 1, 25, 50, 90, 99, 99.9, 100):
            assert percentile(values, p) == pytest.approx(np.percentile(values, p), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("call, message", [
    (lambda: summarize([]), "no request records"),
    (lambda: percentile([], 50), "no values"),
    (lambda: percentile([1.0], 101), r"\[0, 100\]"),
    (lambda: summarize([record(0, [1])], percentiles=(-1,)), r"\[0, 100\]"),
    (lambda: summarize([RequestMetrics(0.0)]), "not finished"),
    (lambda: ttft(RequestMetrics(0.0, finished_time=1.0)), "no output token"),
    (lambda: summarize([record(0, [1])], slo={"ttft": 100}), "unknown SLO key 'ttft'"),
    (lambda: goodput([record(0, [1])], {"itl_ms": 5}), "unknown SLO key"),
    (lambda: goodput([record(0, [1])], {"ttft_ms": -5}), ">= 0"),
    (lambda: goodput([], {}), "no requests"),
    (lambda: summarize([record(0, [1])], duration=0), "duration"),
])
def test_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_arrivals_seeded_and_ordered():
    a = gamma_arrivals(4.0, 50, burstiness=0.5, seed=3)
    assert a == gamma_arrivals(4.0, 50, burstiness=0.5, seed=3) != gamma_arrivals(4.0, 50, burstiness=0.5, seed=4)
    assert len(a) == 50 and a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    assert poisson_arrivals(4.0, 50, seed=3) == gamma_arrivals(4.0, 50, burstiness=1.0, seed=3)
    assert gamma_arrivals(math.inf, 3) == [0.0, 0.0, 0.0]
    for bad in [dict(rate=0, n=3), dict(rate=1, n=0), dict(rate=1, n=3, burstiness=0)]:
        with pytest.raises(ValueError):
            gamma_arrivals(**bad)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrival_rate_and_burstiness(burstiness):
    gaps = np.diff(gamma_arrivals(5.0, 20_001, burstiness=burstiness, seed=0))
    assert gaps.mean() == pytest.approx(1 / 5.0, rel=0.05)  # the mean rate is the one asked for
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)  # CV = 1/sqrt(burstiness)


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama):
    return LLMEngine(tiny_llama, device="cpu", max_num_seqs=4)


PROMPTS = ["The quick brown fox", "Prefill builds the cache", "decode reads it", "one token at a time",
           "Le modèle lit le cache", "1234567890"]


def test_replay_on_tiny_model(tiny_engine):
    arrivals = poisson_arrivals(40.0, len(PROMPTS), seed=1)
    params = [SamplingParams(max_tokens=1 + i % 3, ignore_eos=True) for i in range(len(PROMPTS))]
    outs = replay(tiny_engine, PROMPTS, params, arrivals)
    assert [o.prompt for o in outs] == PROMPTS and all(o.finished for o in outs)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    records = [o.metrics for o in outs]
    start = records[0].arrival_time
    assert [r.arrival_time - start for r in records] == pytest.approx(arrivals, abs=1e-9)  # the scheduled times
    assert all(r.arrival_time <= r.first_token_time <= r.finished_time for r in records)
    assert max(r.finished_time for r in records) - start >= arrivals[-1]
    assert summarize(records)["completed"] == len(PROMPTS)
    assert not tiny_engine.has_unfinished_requests()


def test_closed_loop_caps_requests_in_flight(tiny_engine):
    outs = run_closed_loop(tiny_engine, PROMPTS, SamplingParams(max_tokens=3, ignore_eos=True), concurrency=2)
    assert [o.prompt for o in outs] == PROMPTS and all(o.metrics.output_tokens == 3 for o in outs)
    records = [o.metrics for o in outs]
    for r in records:  # when each request arrived, at most one other was still in flight
        assert sum(q.arrival_time <= r.arrival_time < q.finished_time for q in records) <= 2
    with pytest.raises(ValueError, match="concurrency"):
        run_closed_loop(tiny_engine, PROMPTS, SamplingParams(), concurrency=0)


def test_replay_rejects_bad_schedules(tiny_engine):
    with pytest.raises(ValueError, match="one arrival time per prompt"):
        replay(tiny_engine, PROMPTS, SamplingParams(), [0.0])
    with pytest.raises(ValueError, match="non-decreasing"):
        replay(tiny_engine, PROMPTS[:2], SamplingParams(), [1.0, 0.0])
    with pytest.raises(ValueError, match="SamplingParams"):
        replay(tiny_engine, PROMPTS[:2], [SamplingParams()], [0.0, 0.0])
    assert not tiny_engine.has_unfinished_requests()


def test_plot_cdf():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    plot_cdf(ax, [3.0, 1.0, 2.0, 10.0], "ttft", percentiles=(50, 99))
    (line,) = ax.get_lines()[:1]
    assert list(line.get_xdata()) == [1.0, 2.0, 3.0, 10.0] and line.get_ydata()[-1] == 1.0
    assert [t.get_text() for t in ax.texts] == ["P50", "P99"]
    with pytest.raises(ValueError):
        plot_cdf(ax, [], "empty")
    plt.close(fig)


def test_import_does_not_load_torch():
    """Benchmark clients import the records and summaries on machines without the engine's dependencies."""
    code = "import sys, minillm.metrics; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
