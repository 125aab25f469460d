"""Sampling parameters are validated at the boundary; the filters and the sampler do what they say."""

import pytest
import torch

from minillm.sampling import SamplingParams, filter_logits, sample


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2),
                                 dict(top_k=2.5), dict(max_tokens=0), dict(max_tokens=True), dict(seed="1"),
                                 dict(stop=""), dict(stop=[1])])
def test_bad_parameters_are_named(bad):
    (name,) = bad
    with pytest.raises(ValueError, match=name):
        SamplingParams(**bad)


def test_stop_is_normalised_to_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams().stop == []


def test_top_k_keeps_k_best():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0]])
    kept = filter_logits(logits, top_k=2, top_p=1.0).isfinite()
    assert kept.tolist() == [[False, True, False, True]]


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = filter_logits(probs.log(), top_k=0, top_p=0.8).isfinite()
    assert kept.tolist() == [[True, True, False, False]]
    kept = filter_logits(probs.log(), top_k=0, top_p=0.01).isfinite()  # the top token always survives
    assert kept.tolist() == [[True, False, False, False]]


def test_greedy_is_argmax_and_seed_repeats():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    assert sample(logits, [SamplingParams()] * 3, [None] * 3) == logits.argmax(-1).tolist()
    p = SamplingParams(temperature=1.0)
    draws = [sample(logits, [p] * 3, [torch.Generator().manual_seed(7) for _ in range(3)]) for _ in range(2)]
    assert draws[0] == draws[1]


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([sample(logits, [SamplingParams(temperature=1.0)], [gen])[0]
                                          for _ in range(3000)]), minlength=3)
    torch.testing.assert_close(counts / 3000, logits.softmax(-1)[0], atol=0.03, rtol=0)


def test_tiny_temperatures_sample_the_top_token_without_nan():
    logits = torch.tensor([[1.0, 3.0, 2.0], [40.0, -5.0, 39.0]])
    for temperature in (1e-30, 1e-300, 5e-324):
        params = [SamplingParams(temperature=temperature, seed=1)] * 2
        assert sample(logits, params, [torch.Generator().manual_seed(1) for _ in params]) == [1, 0]


def test_top_p_below_float32_range_keeps_the_top_token():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert torch.isfinite(filter_logits(logits, 0, 1e-47)).sum() == 1
    params = [SamplingParams(temperature=1.0, top_p=1e-47, seed=3)]
    assert sample(logits, params, [torch.Generator().manual_seed(3)]) == [1]
