"""Perplexity through the engine equals transformers' own log-probs, window by window, on the same contexts."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import requires_default_model
from hf_reference import load_hf
from minillm import LLM, SamplingParams
from minillm.perplexity import (PerplexityResult, change_interval, eval_text, perplexity, sliding_windows,
                                token_logprobs)


@torch.inference_mode()
def hf_token_logprobs(model, token_ids: list[int], window: int, stride: int) -> np.ndarray:
    """Hugging Face's sliding-window recipe, written out independently: log-prob of each token after the first."""
    out = np.full(len(token_ids) - 1, np.nan)
    prev_end = 0
    for begin in range(0, len(token_ids), stride):
        end = min(begin + window, len(token_ids))
        trg_len = end - prev_end  # the recipe's new targets: the last trg_len tokens of the window
        logp = model(torch.tensor([token_ids[begin:end]])).logits[0].double().log_softmax(-1)
        for pos in range(max(end - trg_len, begin + 1), end):
            assert np.isnan(out[pos - 1]), "a token scored twice"
            out[pos - 1] = logp[pos - begin - 1, token_ids[pos]].item()
        prev_end = end
        if end == len(token_ids):
            break
    assert not np.isnan(out).any(), "a token left unscored"
    return out


@pytest.fixture(scope="module")
def tiny_hf(tiny_llama):
    return load_hf(tiny_llama)


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama):
    return LLM(tiny_llama, device="cpu", dtype=torch.float32)


def random_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("n, window, stride", [
    (2, 64, 32),  # the smallest text
    (40, 64, 32),  # shorter than a window
    (64, 64, 32), (65, 64, 32),  # exactly one window, and one token more
    (200, 64, 32), (200, 64, 1), (200, 64, 63), (200, 2, 1), (193, 48, 16),  # last window ends exactly at n
])
def test_engine_logprobs_equal_transformers(tiny_engine, tiny_hf, n, window, stride):
    ids = random_ids(n, tiny_hf.config.vocab_size, seed=n + window + stride)
    got = token_logprobs(tiny_engine, ids, window, stride)
    assert got.shape == (n - 1,)
    np.testing.assert_allclose(got, hf_token_logprobs(tiny_hf, ids, window, stride), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n, window, stride", [(n, w, s) for n in (2, 3, 17, 64, 100, 101) for w in (2, 5, 16, 64)
                                               for s in range(1, w, max(1, w // 3))])
def test_windows_score_every_token_once_with_enough_context(n, window, stride):
    spans = sliding_windows(n, window, stride)
    scored = [pos for _, end, first in spans for pos in range(first, end)]
    assert scored == list(range(1, n))
    for begin, end, first in spans:
        assert 0 <= begin < first <= end <= n and end - begin <= window
        assert begin == 0 or first - begin >= window - stride  # context of the first token this window scores
    assert spans[-1][1] == n


def test_prefix_cache_and_chunked_prefill_change_nothing(tiny_llama, tiny_hf):
    """A warm prefix cache holding every window's blocks, and windows split over several steps, give the same."""
    ids = random_ids(150, tiny_hf.config.vocab_size, seed=1)
    window, stride = 96, 40
    llm = LLM(tiny_llama, device="cpu", dtype=torch.float32, enable_prefix_caching=True, max_num_batched_tokens=32)
    spans = sliding_windows(len(ids), window, stride)
    llm.generate([ids[b:e] for b, e, _ in spans], SamplingParams(max_tokens=1), use_tqdm=False)  # warm the cache
    hits = llm.stats()["prefix_cache_hit_tokens"]
    got = token_logprobs(llm, ids, window, stride)
    assert llm.stats()["prefix_cache_hit_tokens"] == hits  # log-prob requests compute every prompt position
    np.testing.assert_allclose(got, hf_token_logprobs(tiny_hf, ids, window, stride), rtol=1e-4, atol=1e-4)


def test_positions_served_from_the_cache_are_an_error_not_a_shift(tiny_llama, monkeypatch):
    """Were the block manager to give log-prob requests cache hits, those positions would go unscored: say so."""
    from minillm.block_manager import BlockManager

    ids = random_ids(100, 300, seed=2)
    llm = LLM(tiny_llama, device="cpu", dtype=torch.float32)
    llm.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)
    hits = BlockManager._prefix_hits
    monkeypatch.setattr(BlockManager, "_prefix_hits",
                        lambda self, seq: hits(self, replace(seq, params=replace(seq.params, prompt_logprobs=None))))
    with pytest.raises(RuntimeError, match="scored 3 of a window's 99 prompt positions"):
        token_logprobs(llm, ids, window=128)


def test_perplexity_is_exp_of_mean_nll(tiny_engine):
    text = "The quick brown fox jumps over the lazy dog. " * 3
    result = perplexity(tiny_engine, text, window=32, stride=8)
    ids = tiny_engine.get_tokenizer()(text).input_ids
    assert isinstance(result, PerplexityResult) and result.num_tokens == len(ids) - 1 == len(result.token_nll)
    np.testing.assert_allclose(result.token_nll, -token_logprobs(tiny_engine, ids, 32, 8))
    assert result.nll == pytest.approx(result.token_nll.mean()) and result.perplexity == pytest.approx(
        math.exp(result.nll))
    assert perplexity(tiny_engine, text, max_tokens=10, window=32, stride=8).num_tokens == 9


@pytest.mark.parametrize("kwargs, match", [
    (dict(window=1), "window"), (dict(window=64.0), "window"), (dict(window=True), "window"),
    (dict(window=64, stride=0), "stride"), (dict(window=64, stride=64), "stride"),
    (dict(window=64, stride=100), "stride"), (dict(window=64, stride=8.5), "stride"),
    (dict(window=300, stride=100), "too long"),  # the tiny model's context is 256 tokens
])
def test_bad_window_or_stride_is_named(tiny_engine, kwargs, match):
    with pytest.raises(ValueError, match=match):
        token_logprobs(tiny_engine, random_ids(280, 100), **kwargs)


def test_bad_text_or_length_is_named(tiny_engine):
    with pytest.raises(ValueError, match="at least 2 tokens"):
        token_logprobs(tiny_engine, [5], window=8)
    with pytest.raises(ValueError, match="max_tokens"):
        perplexity(tiny_engine, "some text", max_tokens=1, window=8, stride=4)
    with pytest.raises(ValueError, match="text"):
        perplexity(tiny_engine, [1, 2, 3], window=8, stride=4)


def test_eval_text_ships_with_the_package():
    text = eval_text()
    assert text.startswith("# ") and text.count("\n## ") >= 8 and "```python" in text


@pytest.mark.slow
@requires_default_model
def test_default_model_perplexity_matches_transformers(default_llm):
    from minillm.weights import resolve_model

    result = perplexity(default_llm, max_tokens=512)
    ids = default_llm.get_tokenizer()(eval_text()).input_ids[:512]
    expected = -hf_token_logprobs(load_hf(resolve_model()), ids, 1024, 512)
    assert result.num_tokens == 511
    assert result.perplexity == pytest.approx(math.exp(expected.mean()), rel=1e-3)
    np.testing.assert_allclose(result.token_nll, expected, rtol=1e-3, atol=1e-3)


def test_change_interval_brackets_the_change_and_narrows_with_length():
    rng = np.random.default_rng(1)
    base = rng.exponential(2.0, 4096)
    worse = base + 0.01 + rng.normal(0, 0.2, base.size)  # about +1 % perplexity, noisy per token
    change, low, high = change_interval(base, worse)
    assert low < change < high and low > 0  # 4096 tokens resolve a 1 % change
    _, short_low, short_high = change_interval(base[:256], worse[:256])
    assert short_high - short_low > 2 * (high - low)
    assert change_interval(base, base) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="equal-length"):
        change_interval(base, base[:100])
