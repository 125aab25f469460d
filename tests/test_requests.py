"""A request's life through the engine as a server needs it: bad values refused at the boundary, ids,
aborts from other threads, outputs as deltas, n completions, log-probs, and readers that share an engine."""

import math
import random
import threading

import pytest
import torch

from conftest import DEVICE
from minillm import LLM, SamplingParams
from minillm.block_manager import block_hash
from minillm.sampling import RequestOutputKind

DELTA, FINAL = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
WORDS = "the cache block token prefill decode model batch queue step page table share copy write".split()


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, device=DEVICE, dtype=torch.float32, num_kv_blocks=128, block_size=4)


def all_blocks_free(llm):
    s = llm.stats()
    return s["kv_blocks_free"] == s["kv_blocks_total"] and not llm.engine.has_unfinished_requests()


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.mark.parametrize("bad", [dict(temperature=math.nan), dict(temperature=math.inf), dict(top_p=math.nan),
                                 dict(temperature=True), dict(seed=2 ** 64), dict(seed=-2 ** 63 - 1),
                                 dict(n=0), dict(n=129), dict(logprobs=21), dict(prompt_logprobs=-1),
                                 dict(logprobs=1.0), dict(ignore_eos=1), dict(output_kind="delta")])
def test_bad_values_are_refused_and_the_engine_keeps_serving(llm, bad):
    (name,) = bad
    with pytest.raises(ValueError, match=name):
        SamplingParams(**bad)
    assert llm.generate("the cache", greedy(3), use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_seed_bounds_are_accepted():
    for seed in (-2 ** 63, 2 ** 64 - 1):
        SamplingParams(seed=seed, temperature=1.0)


def test_automatic_ids_never_collide_with_given_ones(llm):
    engine = llm.engine
    taken = [engine.add_request(str(i), "the cache", greedy(2)) for i in range(3)]
    auto = engine.add_request(None, "the cache", greedy(2))
    assert auto not in taken
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("1", "the cache", greedy(2))
    while engine.has_unfinished_requests():
        engine.step()
    assert all_blocks_free(llm)


def test_block_hashes_are_chained_sha256():
    a, b = block_hash(None, (1, 2, 3, 4)), block_hash(None, (1, 2, 3, 5))
    assert isinstance(a, bytes) and len(a) == 32 and a != b
    assert block_hash(a, (9, 9, 9, 9)) == block_hash(a, (9, 9, 9, 9)) != block_hash(b, (9, 9, 9, 9))


def test_generate_leaves_other_requests_running_and_their_outputs_kept(llm, reference):
    tok = llm.get_tokenizer()
    long_ids, short_ids = tok("the cache block token").input_ids, tok("prefill decode").input_ids
    reader = llm.stream(long_ids, greedy(20, output_kind=DELTA))
    first = next(reader)
    foreign = llm.engine.add_request("foreign", "batch queue step", greedy(25, output_kind=FINAL))
    out = llm.generate(short_ids, greedy(4), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference(tuple(short_ids), 4)
    assert llm.engine.has_unfinished_requests()  # generate did not drain the stream or the foreign request
    rest = [o.outputs[0].token_ids for o in reader]
    assert first.outputs[0].token_ids + sum(rest, []) == reference(tuple(long_ids), 20)
    outputs = llm.take_outputs(foreign)  # what generate and the stream stepped out for it
    while llm.engine.has_unfinished_requests():
        outputs += [o for o in llm.engine.step() if o.request_id == foreign]
    (final,) = outputs
    assert final.finished and final.outputs[0].token_ids == reference(tuple(tok("batch queue step").input_ids), 25)
    assert all_blocks_free(llm)


def test_deltas_add_up_to_the_cumulative_output(llm):
    prompt = "the cache block"
    # Both runs prefill the whole prompt: a run that reused cached blocks would sum its floats in another order.
    llm.reset_prefix_cache()
    whole = llm.generate(prompt, greedy(15, logprobs=2), use_tqdm=False)[0].outputs[0]
    llm.reset_prefix_cache()
    deltas = [o.outputs[0] for o in llm.stream(prompt, greedy(15, logprobs=2, output_kind=DELTA))]
    assert "".join(d.text for d in deltas) == whole.text
    assert sum((d.token_ids for d in deltas), []) == whole.token_ids
    assert sum((d.logprobs for d in deltas), []) == whole.logprobs
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["length"]
    cumulative = [o.outputs[0].text for o in llm.stream(prompt, greedy(15))]
    assert all(b.startswith(a) for a, b in zip(cumulative, cumulative[1:])) and cumulative[-1] == whole.text


def test_stop_strings_never_retract_streamed_text(llm):
    rng = random.Random(0)
    for _ in range(12):
        prompt = " ".join(rng.choices(WORDS, k=4))
        free = llm.generate(prompt, greedy(24), use_tqdm=False)[0].outputs[0].text
        if len(free) < 6:
            continue
        i = rng.randrange(1, len(free) - 3)
        stops = [free[i:i + rng.randint(2, 4)], "never appears §"]
        deltas = [o.outputs[0] for o in llm.stream(prompt, greedy(24, stop=stops, output_kind=DELTA))]
        text = "".join(d.text for d in deltas)
        cut = min(free.find(s) for s in stops if s in free)
        assert text == free[:cut] and deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stops[0]
    assert all_blocks_free(llm)


def test_abort_of_waiting_and_running_requests_frees_blocks(llm):
    engine = llm.engine
    running = engine.add_request(None, "the cache block token", greedy(30))
    engine.step()
    engine.step()
    waiting = engine.add_request(None, "prefill decode", greedy(30))
    for rid, generated in ((running, 2), (waiting, 0)):
        out = engine.abort(rid)
        assert out.finished and out.outputs[0].finish_reason == "abort"
        assert len(out.outputs[0].token_ids) == generated
    assert engine.abort("no such request") is None
    assert all_blocks_free(llm)


def test_abort_from_another_thread_while_steps_run(llm, reference):
    """A thread aborts requests at random moments; the engine never breaks, and the rest are unaffected."""
    tok = llm.get_tokenizer()
    rng = random.Random(1)
    prompts = [tuple(tok(" ".join(rng.choices(WORDS, k=rng.randint(2, 8)))).input_ids) for _ in range(24)]
    ids = [llm.engine.add_request(None, list(p), greedy(16)) for p in prompts]
    doomed = set(rng.sample(ids, 10))
    finals, errors = {}, []

    def aborter():
        try:
            for rid in doomed:
                threading.Event().wait(rng.uniform(0, 0.01))
                out = llm.engine.abort(rid)
                if out is not None:
                    finals[rid] = out
        except Exception as e:  # pragma: no cover - the test fails below
            errors.append(e)

    thread = threading.Thread(target=aborter)
    thread.start()
    while thread.is_alive() or llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                finals[out.request_id] = out
    thread.join()
    assert not errors and set(finals) == set(ids)
    for rid, prompt in zip(ids, prompts):
        tokens, reason = finals[rid].outputs[0].token_ids, finals[rid].outputs[0].finish_reason
        assert reason == "length" or (reason == "abort" and rid in doomed)
        expect = reference(prompt, 16)
        assert tokens == (expect[:len(tokens)] if reason == "abort" else expect)
    assert all_blocks_free(llm)


def test_n_completions_share_the_prompt_and_match_seeded_single_runs(llm):
    prompt = " ".join(WORDS)  # several full blocks
    p = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    before = llm.stats()["prefix_cache_hit_tokens"]
    out = llm.generate(prompt, p, use_tqdm=False)[0]
    hits = llm.stats()["prefix_cache_hit_tokens"] - before
    prompt_len = len(out.prompt_token_ids)
    assert [c.index for c in out.outputs] == [0, 1, 2] and hits >= 2 * (prompt_len // 4 * 4)
    again = llm.generate(prompt, p, use_tqdm=False)[0]
    single = [llm.generate(prompt, SamplingParams(temperature=1.0, seed=11 + i, max_tokens=10, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids for i in range(3)]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in again.outputs] == single
    assert len({tuple(t) for t in single}) > 1
    greedy3 = llm.generate(prompt, greedy(6, n=3), use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in greedy3.outputs}) == 1
    assert all_blocks_free(llm)


def test_n_streams_deltas_per_completion_and_aborts_all(llm):
    engine = llm.engine
    rid = engine.add_request(None, "the cache", SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=50,
                                                               ignore_eos=True, output_kind=DELTA))
    seen = [engine.step() for _ in range(3)]
    assert {c.index for outs in seen for o in outs for c in o.outputs} == {0, 1}
    final = engine.abort(rid)
    assert final.finished and [c.finish_reason for c in final.outputs] == ["abort", "abort"]
    assert all_blocks_free(llm)


def test_logprobs_are_the_models_log_softmax(llm):
    prompt = "the cache block"
    out = llm.generate(prompt, greedy(3, logprobs=3, prompt_logprobs=2), use_tqdm=False)[0]
    first = out.outputs[0].logprobs[0]
    token = out.outputs[0].token_ids[0]
    expect = torch.log_softmax(llm.engine.next_token_logits(prompt), -1)
    assert first[token].rank == 1 and math.isclose(first[token].logprob, expect[token].item(), abs_tol=1e-5)
    assert len(first) == 3 and [lp.rank for lp in first.values()] == [1, 2, 3]
    assert math.isclose(out.outputs[0].cumulative_logprob,
                        sum(lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)))
    ids = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        want = torch.log_softmax(llm.engine.next_token_logits(ids[:i]), -1)
        entry = out.prompt_logprobs[i]
        assert math.isclose(entry[ids[i]].logprob, want[ids[i]].item(), abs_tol=1e-5)
        assert entry[ids[i]].rank == int((want > want[ids[i]]).sum()) + 1 and len(entry) in (2, 3)


def test_prompt_logprobs_are_whole_under_chunked_prefill_and_a_warm_cache(tiny_llama):
    chunked = LLM(tiny_llama, device=DEVICE, dtype=torch.float32, num_kv_blocks=64, block_size=4,
                  max_num_batched_tokens=5)
    prompt = " ".join(WORDS)
    p = greedy(2, prompt_logprobs=1)
    cold = chunked.generate(prompt, greedy(2), use_tqdm=False)  # leaves the prompt's blocks cached
    a, b = (chunked.generate(prompt, p, use_tqdm=False)[0] for _ in range(2))
    assert len(a.prompt_logprobs) == len(a.prompt_token_ids) and a.prompt_logprobs == b.prompt_logprobs
    assert a.outputs[0].token_ids == cold[0].outputs[0].token_ids
