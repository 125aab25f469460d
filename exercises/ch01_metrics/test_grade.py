"""Grader for exercise 1: your serving metrics against minillm's, on random workloads and on edge cases."""

import math
import random

import pytest


def make_record(ref, arrival, token_times, prompt_tokens=8, finished=True):
    r = ref.RequestMetrics(arrival_time=arrival, prompt_tokens=prompt_tokens)
    for t in token_times:
        r.record_token(t)
    r.finished_time = token_times[-1] if finished and token_times else None
    return r


def random_records(ref, seed, n=20, one_token_share=0.2):
    """A random workload: staggered arrivals, queueing delays, 1-12 tokens; times on a 1 ms grid, so ties occur."""
    rng = random.Random(seed)
    records, arrival = [], 0.0
    for _ in range(n):
        arrival += round(rng.expovariate(5.0), 3)
        t = arrival + round(rng.uniform(0.001, 0.5), 3)
        tokens = 1 if rng.random() < one_token_share else rng.randint(2, 12)
        times = [t]
        for _ in range(tokens - 1):
            times.append(times[-1] + rng.choice([0.02, 0.02, 0.03, round(rng.uniform(0.01, 0.2), 3)]))
        records.append(make_record(ref, arrival, times, prompt_tokens=rng.randint(1, 300)))
    return records


def same(a, b):
    """Equal up to float rounding, with None == None and NaN == NaN."""
    if a is None or b is None:
        return a is b
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == pytest.approx(b, rel=1e-9, abs=1e-12)


@pytest.mark.points(1)
def test_ttft_and_e2el(impl, ref):
    for seed in range(5):
        for i, r in enumerate(random_records(ref, seed)):
            assert same(impl.ttft(r), ref.ttft(r)), f"seed {seed}, request {i}: ttft {impl.ttft(r)} != {ref.ttft(r)}"
            assert same(impl.e2el(r), ref.e2el(r)), f"seed {seed}, request {i}: e2el {impl.e2el(r)} != {ref.e2el(r)}"


@pytest.mark.points(2)
def test_tpot(impl, ref):
    for seed in range(5):
        for i, r in enumerate(random_records(ref, seed, one_token_share=0.4)):
            got, want = impl.tpot(r), ref.tpot(r)
            assert same(got, want), f"seed {seed}, request {i} with {r.output_tokens} tokens: tpot {got} != {want}"
    one = make_record(ref, 0.0, [0.4])
    assert impl.tpot(one) is None, "a one-token request has no TPOT: return None"


@pytest.mark.points(1)
def test_itl(impl, ref):
    for seed in range(5):
        for i, r in enumerate(random_records(ref, seed)):
            got, want = list(impl.itl(r)), ref.itl(r)
            assert len(got) == len(want) and all(map(same, got, want)), \
                f"seed {seed}, request {i} with {r.output_tokens} tokens: itl {got} != {want}"


@pytest.mark.points(2)
def test_percentile_matches_reference(impl, ref):
    rng = random.Random(0)
    for n in (1, 2, 3, 7, 10, 100, 1001):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for p in (0, 1, 10, 25, 50, 75, 90, 95, 99, 99.9, 100):
            got, want = impl.percentile(values, p), ref.percentile(values, p)
            assert same(got, want), f"{n} values, p={p}: {got} != {want}"


@pytest.mark.points(1)
def test_percentile_ties_and_errors(impl, ref):
    cases = [([5.0, 5.0, 5.0, 5.0], 90), ([1, 2, 2, 2, 3], 50), ([1, 2, 2, 2, 3], 90), ([3.0, 1.0, 2.0], 100),
             ([3.0, 1.0, 2.0], 0), ([42.0], 99), ([2.0, 1.0], 50)]
    for values, p in cases:
        got, want = impl.percentile(list(values), p), ref.percentile(values, p)
        assert same(got, want), f"percentile({values}, {p}) = {got}, expected {want}"
    with pytest.raises(ValueError):
        impl.percentile([], 50)  # no values: no percentile
    with pytest.raises(ValueError):
        impl.percentile([1.0, 2.0], 101)


@pytest.mark.points(2)
def test_goodput(impl, ref):
    # bounds off the records' 1 ms grid, so that no float rounding decides a request (exact bounds: next test)
    slos = [{"ttft_ms": 300.5}, {"tpot_ms": 40.5}, {"e2el_ms": 800.5}, {"ttft_ms": 300.5, "tpot_ms": 40.5},
            {"ttft_ms": 400.5, "tpot_ms": 60.5, "e2el_ms": 1000.5}, {}]
    for seed in range(4):
        records = random_records(ref, seed)
        for slo in slos:
            for i, r in enumerate(records):
                assert impl.meets_slo(r, slo) == ref.meets_slo(r, slo), f"seed {seed}, request {i}, SLO {slo}"
            got, want = impl.goodput(records, slo), ref.goodput(records, slo)
            assert same(got, want), f"seed {seed}, SLO {slo}: goodput {got} != {want}"
        slo = {"ttft_ms": 300.5}
        got, want = impl.goodput(records, slo, duration=10.0), ref.goodput(records, slo, duration=10.0)
        assert same(got, want), f"seed {seed}, duration=10: goodput {got} != {want}"
    assert same(impl.goodput(records, None), ref.goodput(records, None)), "slo=None: every request counts"


@pytest.mark.points(1)
def test_goodput_edge_cases(impl, ref):
    one = make_record(ref, 0.0, [0.25])  # one token: meets any TPOT SLO
    exact = make_record(ref, 0.0, [0.5, 0.75, 1.0])  # TTFT 500 ms, TPOT 250 ms, E2EL 1000 ms
    assert impl.meets_slo(one, {"tpot_ms": 0}), "a one-token request meets any TPOT SLO"
    assert impl.meets_slo(exact, {"ttft_ms": 500, "tpot_ms": 250, "e2el_ms": 1000}), "bounds are inclusive (<=)"
    assert not impl.meets_slo(exact, {"ttft_ms": 499})
    assert same(impl.goodput([one, exact], {"tpot_ms": 100}), 1 / 1.0), "only the one-token request is good"
    with pytest.raises(ValueError):
        impl.goodput([one], {"ttft": 100})  # unknown key: the unit is part of the name
    with pytest.raises(ValueError):
        impl.goodput([], {"ttft_ms": 100})


@pytest.mark.points(3)
def test_summarize_matches_reference(impl, ref):
    settings = [dict(), dict(slo={"ttft_ms": 300.5, "tpot_ms": 40.5}), dict(duration=30.0),
                dict(percentiles=(25, 75, 99.9)), dict(percentiles=())]
    for seed in range(4):
        records = random_records(ref, seed, n=5 + 10 * seed)
        for kwargs in settings:
            got, want = impl.summarize(records, **kwargs), ref.summarize(records, **kwargs)
            assert set(got) == set(want), f"keys differ: missing {sorted(set(want) - set(got))}, " \
                                          f"unexpected {sorted(set(got) - set(want))}"
            for key in want:
                assert same(got[key], want[key]), f"seed {seed}, {kwargs}: {key} = {got[key]}, expected {want[key]}"


@pytest.mark.points(1)
def test_summarize_edge_cases(impl, ref):
    ones = [make_record(ref, 0.0, [0.2]), make_record(ref, 0.1, [0.2]), make_record(ref, 0.1, [0.5])]
    got, want = impl.summarize(ones), ref.summarize(ones)
    for key in want:
        assert same(got.get(key), want[key]), f"only one-token requests: {key} = {got.get(key)}, expected {want[key]}"
    with pytest.raises(ValueError):
        impl.summarize([])  # nothing to summarize
    with pytest.raises(ValueError):
        impl.summarize([make_record(ref, 0.0, [0.1, 0.2], finished=False)])  # still running
    with pytest.raises(ValueError):
        impl.summarize(ones, slo={"latency_ms": 100})
