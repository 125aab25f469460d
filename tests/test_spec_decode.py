"""Speculative decoding (chapter 10): prompt lookup proposes what followed the last tokens' latest earlier
occurrence; greedy output with speculation is the engine's own, token for token, also when stops, length limits,
preemption and log-probs cut into a step's kept drafts; rejection sampling leaves the sampling distribution
exactly the model's; a bad `speculative_config` is refused by name before anything loads."""

import json

import httpx
import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.engine_args import EngineArgs
from minillm.spec_decode import SpeculativeConfig, accept, propose_ngram, target_probs

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
ENGINE = dict(device="cpu", dtype=torch.float32, block_size=4, num_kv_blocks=256)
LOOPY = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]  # a pattern to copy: prompt lookup drafts it
PROMPTS = [LOOPY, list(range(20, 40)), [11, 12, 11, 12, 11], [3]]


def test_prompt_lookup_takes_the_longest_latest_match():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 2, 1, 3) == [8, 1]  # the latest "1 2 3" came before 8
    assert propose_ngram([1, 2, 3, 4, 5, 9, 4, 5], 3, 1, 3) == [9, 4, 5]  # "4 5" last came before "9 4 5"
    assert propose_ngram([7, 1, 2, 5, 1, 2], 4, 2, 2) == [5, 1, 2]  # fewer than k when the sequence ends first
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []  # nothing repeats
    assert propose_ngram([4], 3, 1, 3) == []


@pytest.mark.parametrize("value,says", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method 'eagle' is not supported"),
    ('{"method": "ngram"}', "needs ['num_speculative_tokens']"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be a positive integer"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookup": 3}', "unknown keys ['lookup']"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}', "prompt_lookup_min (5) is above"),
    ("{method: ngram}", "not valid JSON"),
])
def test_bad_configs_are_refused_by_name(value, says):
    with pytest.raises(ValueError) as e:
        EngineArgs(speculative_config=value)
    assert says in str(e.value)


@pytest.fixture(scope="module")
def engines(tiny_llama):
    return LLM(tiny_llama, **ENGINE), LLM(tiny_llama, speculative_config=NGRAM, **ENGINE)


def tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def oracle(monkeypatch, prompts: list[list[int]], outputs: list[list[int]], wrong_at: int | None = 2) -> None:
    """Make the drafter propose the engine's own next tokens (known from a run without speculation), with the draft
    at `wrong_at` replaced by another token on every other step: every step keeps drafts and some reject one. A
    random tiny model rarely repeats itself, so prompt lookup alone would leave the acceptance path unexercised."""
    import minillm.engine

    futures = [p + o for p, o in zip(prompts, outputs)]
    calls = iter(range(10 ** 9))

    def propose(seen: list[int], k: int, n_min: int, n_max: int) -> list[int]:
        full = next((f for f in futures if f[:len(seen)] == seen), seen)  # an unknown sequence: no drafts
        drafts = full[len(seen):len(seen) + k]
        if wrong_at is not None and len(drafts) > wrong_at and next(calls) % 2:
            drafts[wrong_at] = (drafts[wrong_at] + 1) % 300
        return drafts
    monkeypatch.setattr(minillm.engine, "propose_ngram", propose)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=40, ignore_eos=True),
    SamplingParams(max_tokens=7, ignore_eos=True),  # the length limit falls inside a step's drafts
    SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[232, 110]),  # a stop among kept drafts
    SamplingParams(max_tokens=30, ignore_eos=True, logprobs=2, n=2),
], ids=["long", "short", "stop-ids", "logprobs-n2"])
def test_greedy_output_is_the_engines_own(engines, params, monkeypatch):
    plain, spec = engines
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    oracle(monkeypatch, PROMPTS, [o.outputs[0].token_ids for o in want])
    before = spec.stats()
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    assert tokens(got) == tokens(want)
    assert [[c.text for c in o.outputs] for o in got] == [[c.text for c in o.outputs] for o in want]
    assert [[c.finish_reason for c in o.outputs] for o in got] == [[c.finish_reason for c in o.outputs] for o in want]
    if params.logprobs:
        for a, b in zip(got, want):
            for ca, cb in zip(a.outputs, b.outputs):
                assert [sorted(p) for p in ca.logprobs] == [sorted(p) for p in cb.logprobs]
                assert [p[t].logprob for p, t in zip(ca.logprobs, ca.token_ids)] == \
                    pytest.approx([p[t].logprob for p, t in zip(cb.logprobs, cb.token_ids)], abs=1e-4)
    stats = spec.stats()
    kept = stats["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    drafted = stats["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    assert 0 < kept < drafted  # drafts were kept and drafts were rejected
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_prompt_lookup_in_the_engine_keeps_the_output(engines):
    plain, spec = engines
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [*PROMPTS, [7] * 12]
    assert tokens(spec.generate(prompts, params, use_tqdm=False)) == tokens(plain.generate(prompts, params,
                                                                                            use_tqdm=False))


def test_preempted_and_prefix_cached_sequences_stay_exact(tiny_llama, monkeypatch):
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    prompts = [LOOPY + [k] for k in range(8)]
    small = dict(ENGINE, num_kv_blocks=40)  # too few blocks for all eight at once: some are preempted
    want = LLM(tiny_llama, **small).generate(prompts, params, use_tqdm=False)
    oracle(monkeypatch, prompts, [o.outputs[0].token_ids for o in want])
    spec = LLM(tiny_llama, speculative_config=NGRAM, **small)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert tokens(got) == tokens(want) and spec.stats()["num_preemptions"] > 0
    # a prompt that runs on into a finished request's output finds as many of its blocks cached as without
    # speculation: the blocks hashed with kept drafts hold exactly those tokens
    longer = [prompts[0] + want[0].outputs[0].token_ids[:20]]
    hits = []
    for llm in (LLM(tiny_llama, **ENGINE), LLM(tiny_llama, speculative_config=NGRAM, **ENGINE)):
        llm.generate(prompts[:1], params, use_tqdm=False)
        before = llm.stats()["prefix_cache_hit_tokens"]
        assert tokens(llm.generate(longer, params, use_tqdm=False)) == tokens(
            LLM(tiny_llama, **ENGINE).generate(longer, params, use_tqdm=False))
        hits.append(llm.stats()["prefix_cache_hit_tokens"] - before)
    assert hits[0] == hits[1] == 32  # 34 tokens: 8 full blocks of 4, some written by steps that kept drafts


def test_rejection_sampling_keeps_the_models_distribution():
    """Draw the first emitted token many times, drafts fixed: its frequencies match p, not the drafts'."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.3, 0.2, 0.1, 0.0, -0.2], [0.0] * 5])
    params = SamplingParams(temperature=0.8, top_p=0.95)
    p = target_probs(logits[:1], params)[0]
    generator, draws = torch.Generator().manual_seed(0), 20_000
    counts = torch.zeros(5)
    second = 0
    for _ in range(draws):
        out = accept([1, 1], logits, params, generator)
        counts[out[0]] += 1
        second += len(out) > 1 and out[0] == 1
    freq = counts / draws
    sigma = (p * (1 - p) / draws).sqrt()
    assert ((freq - p).abs() <= 5 * sigma + 1e-4).all(), (freq, p)  # an "accept every draft" rule gives freq[1] = 1
    assert second == counts[1]  # after a kept draft the step goes on to the next position
    greedy = SamplingParams(temperature=0)
    assert accept([0, 3], logits, greedy, None) == [0, 0]  # the first draft kept, the second replaced by the argmax
    assert accept([1], logits, greedy, None) == [0]


def test_served_with_speculation_the_text_is_the_same_and_metrics_count_drafts(tiny_llama, engines):
    from minillm import LLMEngine
    from serving_utils import scrape, serve_engine

    plain, _ = engines
    want = plain.generate([LOOPY], SamplingParams(max_tokens=30, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    engine = LLMEngine(tiny_llama, speculative_config=NGRAM, **ENGINE)
    with serve_engine(engine) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        body = {"prompt": LOOPY, "max_tokens": 30, "ignore_eos": True, "temperature": 0, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            pieces = [json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert "".join(pieces) == want.text
        metrics = scrape(c)
    assert metrics["spec_decode_num_accepted_tokens_total"] > 0
    assert metrics["spec_decode_num_draft_tokens_total"] >= metrics["spec_decode_num_accepted_tokens_total"]


def test_serve_refuses_a_bad_speculative_config_before_loading(capsys):
    from minillm.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "/nonexistent", "--speculative-config", '{"method": "medusa", '
              '"num_speculative_tokens": 2}'])
    assert e.value.code == 2 and "method 'medusa' is not supported" in capsys.readouterr().err
