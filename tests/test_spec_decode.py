"""Speculative decoding (chapter 10): prompt lookup proposes what followed the last tokens' latest earlier
occurrence, a draft model (the tiny model quantized, or a perturbed copy) drafts from its own distribution; greedy
output with speculation is the engine's own, token for token, also when stops, length limits, preemption, aborts
and log-probs cut into a step's kept drafts; rejection sampling leaves the sampling distribution exactly the
model's, for a drafter certain of its tokens and for one with a distribution q; a bad `speculative_config` is
refused by name, before anything loads where it can be."""

import json
import math
import shutil

import httpx
import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.engine_args import EngineArgs
from minillm.spec_decode import SpeculativeConfig, accept, propose_ngram, sampling_probs

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
ENGINE = dict(device="cpu", dtype=torch.float32, block_size=4, num_kv_blocks=256)
LOOPY = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]  # a pattern to copy: prompt lookup drafts it
PROMPTS = [LOOPY, list(range(20, 40)), [11, 12, 11, 12, 11], [3]]
GREEDY_CASES = [  # the requests whose greedy output speculation must leave unchanged
    SamplingParams(max_tokens=40, ignore_eos=True),
    SamplingParams(max_tokens=7, ignore_eos=True),  # the length limit falls inside a step's drafts
    SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[232, 110]),  # a stop among kept drafts
    SamplingParams(max_tokens=30, ignore_eos=True, logprobs=2, n=2),
]


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
    ('{"method": "draft_model", "num_speculative_tokens": 2, "quantization": "int3"}',
     "speculative_config quantization 'int3' is not supported"),
    ('{"method": "draft_model", "num_speculative_tokens": 2, "prompt_lookup_max": 3}',
     "speculative_config prompt_lookup_max is only for method 'ngram'"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "/tmp/m"}',
     "speculative_config model is only for method 'draft_model'"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "quantization": "int4"}',
     "speculative_config quantization is only for method 'draft_model'"),
    ('{"method": "draft_model", "num_speculative_tokens": 2, "model": 7}', "speculative_config model must be a path"),
    ('{"method": "draft_model", "num_speculative_tokens": -1}', "num_speculative_tokens must be a positive integer"),
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


def assert_same_outputs(got, want) -> None:
    """Speculation left every completion as the plain engine wrote it: tokens, text, finish reason, and (when asked
    for) the log-probs at each position."""
    assert tokens(got) == tokens(want)
    assert [[(c.text, c.finish_reason) for c in o.outputs] for o in got] == \
        [[(c.text, c.finish_reason) for c in o.outputs] for o in want]
    for a, b in zip(got, want):
        for ca, cb in zip(a.outputs, b.outputs):
            if cb.logprobs is not None:
                assert [sorted(p) for p in ca.logprobs] == [sorted(p) for p in cb.logprobs]
                assert [p[t].logprob for p, t in zip(ca.logprobs, ca.token_ids)] == \
                    pytest.approx([p[t].logprob for p, t in zip(cb.logprobs, cb.token_ids)], abs=1e-4)


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


@pytest.mark.parametrize("params", GREEDY_CASES, ids=["long", "short", "stop-ids", "logprobs-n2"])
def test_greedy_output_is_the_engines_own(engines, params, monkeypatch):
    plain, spec = engines
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    oracle(monkeypatch, PROMPTS, [o.outputs[0].token_ids for o in want])
    got, kept, drafted = generate_counting(spec, PROMPTS, params)
    assert_same_outputs(got, want)
    assert 0 < kept < drafted  # drafts were kept and drafts were rejected
    stats = spec.stats()
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
    p = sampling_probs(logits[:1], params)[0]
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


# ---- a draft model ------------------------------------------------------------------------------------------------


def draft(path, quantization=None) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": 4, "quantization": quantization}


@pytest.fixture(scope="module")
def perturbed(tiny_llama, tmp_path_factory):
    """The tiny model with noise on every weight, same tokenizer: a draft that agrees with it about half the time."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("perturbed")
    for f in tiny_llama.iterdir():
        shutil.copy(f, out)
    generator = torch.Generator().manual_seed(1)
    weights = load_file(out / "model.safetensors")
    save_file({name: w + 0.03 * w.std() * torch.randn(w.shape, generator=generator) if w.dim() > 1 else w
               for name, w in weights.items()}, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def drafted(tiny_llama, perturbed):
    """Engines whose drafts come from the tiny model in int4 and from its perturbed copy (float32)."""
    return {"int4-self": LLM(tiny_llama, speculative_config=draft(tiny_llama, "int4"), **ENGINE),
            "perturbed": LLM(tiny_llama, speculative_config=draft(perturbed), **ENGINE)}


def assert_all_blocks_free(llm) -> None:
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["draft_kv_blocks_free"] == stats["draft_kv_blocks_total"] > 0


def generate_counting(llm, prompts, params) -> tuple[list, int, int]:
    """The outputs, and how many draft tokens were kept and drafted while generating them."""
    before = llm.stats()
    outs = llm.generate(prompts, params, use_tqdm=False)
    after = llm.stats()
    keys = ("spec_decode_num_accepted_tokens", "spec_decode_num_draft_tokens")
    return outs, *(after[key] - before[key] for key in keys)


@pytest.mark.parametrize("variant", ["int4-self", "perturbed"])
@pytest.mark.parametrize("params", GREEDY_CASES, ids=["long", "short", "stop-ids", "logprobs-n2"])
def test_draft_model_greedy_output_is_the_engines_own(engines, drafted, variant, params):
    plain, spec = engines[0], drafted[variant]
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    got, kept, proposed = generate_counting(spec, PROMPTS, params)
    assert_same_outputs(got, want)
    assert kept > 0
    if variant == "perturbed":
        assert kept < proposed  # drafts were rejected too
    assert_all_blocks_free(spec)


def test_draft_model_stop_strings_keep_the_output(engines, drafted):
    plain, spec = engines[0], drafted["perturbed"]
    text = plain.generate(PROMPTS[1:2], SamplingParams(max_tokens=40, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].text
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop=[text[len(text) // 2:len(text) // 2 + 2]])
    want, got = (llm.generate(PROMPTS, params, use_tqdm=False) for llm in (plain, spec))
    assert want[1].outputs[0].finish_reason == "stop"
    assert [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in got] == \
        [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in want]
    assert_all_blocks_free(spec)


def recording_drafts(llm) -> list[tuple[list[int], list[int]]]:
    """Make the engine's draft model note each sequence's tokens and the drafts it proposed after them."""
    drafter, records = llm.engine.drafter, []

    def propose(seqs, ks):
        propose_all(seqs, ks)
        records.extend((list(seq.token_ids), list(seq.draft_token_ids)) for seq in seqs if seq.draft_token_ids)
    propose_all, drafter.propose = drafter.propose, propose
    return records


def assert_own_continuations(records: list[tuple[list[int], list[int]]], draft_path, **draft_args) -> None:
    """Each round's drafts are what the draft model, run on its own from the same tokens, writes greedily: its
    cache held exactly those tokens' K/V, however often it was rolled back, chunked, freed and caught up."""
    assert records
    alone = LLM(draft_path, **ENGINE, **draft_args).generate(
        [context for context, _ in records], [SamplingParams(max_tokens=len(d), ignore_eos=True) for _, d in records],
        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == [d for _, d in records]


def test_draft_model_drafts_its_own_continuations(tiny_llama, perturbed):
    """Drafts rejected (the cache rolled back), prompts caught up on in chunks of 12 tokens, sequences preempted
    (the drafter's blocks freed, the whole sequence caught up on again): the output stays the engine's own, and
    every draft is the draft model's own greedy continuation."""
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    prompts = [LOOPY + [k] for k in range(8)]
    small = dict(ENGINE, num_kv_blocks=40, max_num_batched_tokens=12)  # too few blocks for all eight, in either pool
    want = LLM(tiny_llama, **small).generate(prompts, params, use_tqdm=False)
    spec = LLM(tiny_llama, speculative_config=draft(perturbed), **small)
    records = recording_drafts(spec)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert tokens(got) == tokens(want) and spec.stats()["num_preemptions"] > 0
    assert 0 < spec.stats()["spec_decode_num_accepted_tokens"] < spec.stats()["spec_decode_num_draft_tokens"]
    assert_all_blocks_free(spec)
    assert_own_continuations(records, perturbed)


def test_an_int4_draft_drafts_its_own_continuations(tiny_llama):
    """The int4 draft (its decode passes one fused C call on a CPU), prompts caught up on in chunks: every draft is
    what the int4 model writes on its own."""
    small = dict(ENGINE, max_num_batched_tokens=12)
    spec = LLM(tiny_llama, speculative_config=draft(tiny_llama, "int4"), **small)
    records = recording_drafts(spec)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    assert tokens(spec.generate(PROMPTS, params, use_tqdm=False)) == tokens(
        LLM(tiny_llama, **small).generate(PROMPTS, params, use_tqdm=False))
    assert_own_continuations(records, tiny_llama, quantization="int4")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_every_attention_path_checks_drafts_as_decode_rows(engines, tiny_llama, perturbed, backend, monkeypatch):
    """Verify steps, and the draft model's catch-ups past the prompt, attend as decode rows, one per token: through
    PyTorch's attention and minillm's Triton kernels (interpreted on a CPU) as through the C kernel, the output is
    the engine's own and every draft the draft model's own."""
    if backend == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("MINILLM_ATTENTION", backend)
    spec = LLM(tiny_llama, speculative_config=draft(perturbed), **ENGINE)
    assert spec.engine.runner.use_triton == spec.engine.drafter.runner.use_triton == (backend == "triton")
    records = recording_drafts(spec)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    got, kept, proposed = generate_counting(spec, PROMPTS[:2], params)
    assert tokens(got) == tokens(engines[0].generate(PROMPTS[:2], params, use_tqdm=False))
    assert 0 < kept < proposed
    assert_own_continuations(records, perturbed)


def test_a_model_drafting_for_itself_is_always_right(tiny_llama):
    """The tiny model unquantized as its own draft: every greedy draft is kept."""
    spec = LLM(tiny_llama, speculative_config=draft(tiny_llama), **ENGINE)
    _, kept, proposed = generate_counting(spec, PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True, n=2))
    assert kept == proposed > 0


def test_abort_frees_the_drafters_blocks_and_the_rest_runs_on(tiny_llama, perturbed, engines):
    from minillm import LLMEngine

    params = SamplingParams(max_tokens=30, ignore_eos=True)
    want = engines[0].generate(PROMPTS[1:2], params, use_tqdm=False)[0].outputs[0].token_ids
    engine = LLMEngine(tiny_llama, speculative_config=draft(perturbed), **ENGINE)
    doomed = engine.add_request(None, LOOPY, SamplingParams(max_tokens=100, ignore_eos=True))
    other = engine.add_request(None, PROMPTS[1], params)
    for _ in range(3):
        engine.step()
    stats = engine.stats()
    in_use = stats["draft_kv_blocks_total"] - stats["draft_kv_blocks_free"]
    assert stats["spec_decode_num_draft_tokens"] > 0 and in_use > 0
    out = engine.abort(doomed)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.stats()["draft_kv_blocks_total"] - engine.stats()["draft_kv_blocks_free"] < in_use
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.request_id == other and o.finished), final)
    assert final.outputs[0].token_ids == want
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["draft_kv_blocks_free"] == stats["draft_kv_blocks_total"]


def test_a_draft_with_another_vocabulary_is_refused_by_name(tiny_llama, tmp_path):
    import tiny_models

    bigger = tiny_models.build_tiny_model(tmp_path / "bigger", vocab_size=400)
    with pytest.raises(ValueError, match="speculative_config model .* has vocab_size 400"):
        LLM(tiny_llama, speculative_config=draft(bigger), **ENGINE)
    swapped = tmp_path / "swapped"  # the same model and vocabulary size, two tokens' ids swapped
    shutil.copytree(tiny_llama, swapped)
    spec = json.loads((swapped / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="speculative_config model .* has another tokenizer: 'a' is id"):
        LLM(tiny_llama, speculative_config=draft(swapped), **ENGINE)
    with pytest.raises(ValueError, match="speculative_config model: model '/nonexistent' is not"):
        LLM(tiny_llama, speculative_config=draft("/nonexistent"), **ENGINE)


def within_five_sigma(counts: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether every frequency in `counts` lies within 5 standard deviations of its probability in `p`."""
    draws = counts.sum()
    sigma = (p * (1 - p) / draws).sqrt()
    return bool(((counts / draws - p).abs() <= 5 * sigma + 1e-4).all())


def test_rejection_sampling_with_a_draft_distribution_keeps_the_models():
    """Draws x from q, passes it with q's row to `accept`: the token emitted is distributed as p, q far from p and
    nonzero where p is 0. The check has the power to tell: accepting with probability p(x) instead of p(x) / q(x),
    or replacing a rejected draft by a draw from p instead of max(0, p - q), each fails it. And a draft is kept as
    often as any exact rule can keep it, sum(min(p, q)), not sum(p q) as when q is ignored (exact too, but wasteful:
    each draw then counts as certain)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -3.0, 0.0], [0.0] * 5])
    params = SamplingParams(temperature=0.8, top_p=0.95)
    p = sampling_probs(logits[:1], params)[0]
    q = torch.tensor([0.05, 0.15, 0.2, 0.3, 0.3])
    assert p[3] == 0  # top-p drops token 3, which q proposes often: such a draft is always rejected

    kept = []

    def rule(x: int, generator: torch.Generator) -> int:
        emitted = accept([x], logits, params, generator, q[None])
        kept.append(len(emitted) == 2)  # the draft, then the model's token after it
        return emitted[0]

    def keep_with_p(x: int, generator: torch.Generator) -> int:  # as if q were 1 on x
        if torch.rand(1, generator=generator).item() < p[x]:
            return x
        return int(torch.multinomial((p - q).clamp_min(0), 1, generator=generator))

    def redraw_from_p(x: int, generator: torch.Generator) -> int:
        if torch.rand(1, generator=generator).item() * q[x] < p[x]:
            return x
        return int(torch.multinomial(p, 1, generator=generator))

    def counts(emit) -> torch.Tensor:
        generator, out = torch.Generator().manual_seed(0), torch.zeros(5)
        for _ in range(20_000):
            out[emit(int(torch.multinomial(q, 1, generator=generator)), generator)] += 1
        return out

    assert within_five_sigma(counts(rule), p)
    best = torch.minimum(p, q).sum()
    assert within_five_sigma(torch.tensor([sum(kept), len(kept) - sum(kept)]), torch.stack([best, 1 - best]))
    assert best - (p * q).sum() > 0.1
    assert not within_five_sigma(counts(keep_with_p), p)
    assert not within_five_sigma(counts(redraw_from_p), p)


def test_sampling_with_a_draft_model_keeps_the_models_distribution(tiny_llama, perturbed, engines):
    """Tokens sampled (top-k 2) from one prompt, the second and third drafted by the perturbed copy and checked in one
    step: the joint frequencies of the first three over many seeded requests match the model's own probabilities."""
    plain = engines[0].engine
    params = [SamplingParams(temperature=1.0, top_k=2, max_tokens=4, ignore_eos=True, seed=i) for i in range(3000)]
    prompt = PROMPTS[1]
    spec = LLM(tiny_llama, speculative_config=draft(perturbed), **ENGINE)
    outs, kept, proposed = generate_counting(spec, [prompt] * len(params), params)
    assert 0 < kept < proposed
    assert spec.stats()["spec_decode_num_drafts"] > 0

    def probs(context: list[int]) -> torch.Tensor:
        return sampling_probs(plain.next_token_logits(context)[None], params[0])[0]

    first = probs(prompt)
    joint = {}
    for a in first.nonzero().flatten().tolist():
        second = probs(prompt + [a])
        for b in second.nonzero().flatten().tolist():
            third = probs(prompt + [a, b])
            for c in third.nonzero().flatten().tolist():
                joint[(a, b, c)] = (first[a] * second[b] * third[c]).item()
    cells = sorted(joint)
    seen = [tuple(o.outputs[0].token_ids[:3]) for o in outs]
    assert set(seen) <= set(cells)
    counts = torch.tensor([seen.count(cell) for cell in cells], dtype=torch.float64)
    assert within_five_sigma(counts, torch.tensor([joint[cell] for cell in cells], dtype=torch.float64))
    assert math.isclose(sum(joint.values()), 1.0, rel_tol=1e-5)
