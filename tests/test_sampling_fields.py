"""vLLM's further sampling fields, each against a reference computed by hand from the model's own logits:
stop_token_ids, min_tokens, min_p, the repetition, frequency and presence penalties,
include_stop_str_in_output, skip_special_tokens, and the masks allowed_token_ids and bad_words."""

import math
from collections import Counter

import pytest
import torch

from conftest import DEVICE
from minillm import LLM, SamplingParams
from minillm.metrics import RequestMetrics
from minillm.sampling import apply_masks, apply_penalties, bad_words_token_ids, filter_logits
from minillm.sequence import Sequence
from tiny_models import build_tiny_model, spelled_word

SENTENCE = "The quick brown fox jumps over the lazy dog. Prefill builds the cache; decode reads it."


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, device=DEVICE, dtype=torch.float32, num_kv_blocks=128, block_size=4)


@pytest.fixture(scope="module")
def eos_llm(tmp_path_factory):
    """The same random weights with token 0 as EOS: after the prompt [2], greedy decoding picks EOS at once."""
    path = build_tiny_model(tmp_path_factory.mktemp("tiny-eos0"), eos_token_id=0)
    return LLM(path, device=DEVICE, dtype=torch.float32, num_kv_blocks=64, block_size=4)


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, **kw)


def run(llm, prompt, params):
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def penalized(logits, prompt, output, repetition=1.0, frequency=0.0, presence=0.0):
    """vLLM's penalties written out token by token."""
    logits = logits.clone()
    for t in set(prompt) | set(output):
        logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
    for t, count in Counter(output).items():
        logits[t] -= frequency * count + presence
    return logits


@pytest.mark.parametrize("bad", [
    dict(stop_token_ids=[-1]), dict(stop_token_ids=[1.5]), dict(stop_token_ids=[True]), dict(stop_token_ids=3),
    dict(min_tokens=-1), dict(min_tokens=17), dict(min_tokens=1.0), dict(min_p=-0.1), dict(min_p=1.5),
    dict(min_p=math.nan), dict(repetition_penalty=0.0), dict(repetition_penalty=-1.0),
    dict(repetition_penalty=math.inf), dict(presence_penalty=2.5), dict(presence_penalty=-3),
    dict(frequency_penalty=math.nan), dict(frequency_penalty="1"), dict(include_stop_str_in_output=1),
    dict(skip_special_tokens="no"), dict(allowed_token_ids=[]), dict(allowed_token_ids=[-1]),
    dict(allowed_token_ids=5), dict(allowed_token_ids=[2.0]), dict(bad_words="word"), dict(bad_words=[""]),
    dict(bad_words=["  "]), dict(bad_words=[3])])
def test_bad_values_are_named(bad):
    (name,) = bad
    with pytest.raises(ValueError, match=f"^{name} "):
        SamplingParams(**bad)


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.stop_token_ids, p.min_tokens, p.min_p, p.repetition_penalty, p.presence_penalty,
            p.frequency_penalty, p.include_stop_str_in_output, p.skip_special_tokens) == ([], 0, 0.0, 1.0, 0.0, 0.0,
                                                                                         False, True)
    assert not p.penalized and SamplingParams(presence_penalty=-2).penalized
    assert SamplingParams(stop_token_ids=(5, 7)).stop_token_ids == [5, 7]
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


def test_stop_token_ids_outside_the_vocabulary_are_refused(llm):
    with pytest.raises(ValueError, match="stop_token_ids .* outside the vocabulary"):
        llm.generate(["a", "b"], greedy(3, stop_token_ids=[10 ** 6]), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_min_p_drops_tokens_below_a_share_of_the_top():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert filter_logits(logits, 0, 1.0, min_p=0.35).isfinite().tolist() == [[True, True, False, False]]
    assert filter_logits(logits, 0, 1.0, min_p=0.11).isfinite().tolist() == [[True, True, True, False]]
    assert filter_logits(logits, 0, 1.0, min_p=1.0).isfinite().sum() == 1
    # min_p comes before top_p (vLLM's order): the nucleus is taken over what min_p kept
    assert filter_logits(logits, 0, 0.6).isfinite().sum() == 2
    assert filter_logits(logits, 0, 0.6, min_p=0.35).isfinite().sum() == 1


def test_min_p_end_to_end_samples_only_allowed_tokens(llm):
    prompt = llm.get_tokenizer()(SENTENCE).input_ids
    probs = llm.engine.next_token_logits(prompt).softmax(-1)
    allowed = set((probs >= 0.3 * probs.max()).nonzero().flatten().tolist())

    def draws(min_p):
        out = llm.generate([prompt], SamplingParams(n=48, temperature=1.0, seed=5, max_tokens=1, min_p=min_p),
                           use_tqdm=False)[0]
        return {o.token_ids[0] for o in out.outputs}

    assert draws(0.3) <= allowed and not draws(0.0) <= allowed


@pytest.mark.parametrize("penalties", [dict(repetition=1.3), dict(repetition=0.7), dict(frequency=1.0),
                                       dict(presence=1.5), dict(repetition=1.2, frequency=-0.5, presence=0.5)])
def test_greedy_with_penalties_is_the_argmax_of_the_penalised_logits(llm, penalties):
    prompt = llm.get_tokenizer()(SENTENCE).input_ids
    params = greedy(10, ignore_eos=True, **{f"{k}_penalty": v for k, v in penalties.items()})
    out = run(llm, prompt, params).token_ids
    for i, token in enumerate(out):
        logits = llm.engine.next_token_logits(prompt + out[:i])
        assert token == int(penalized(logits, prompt, out[:i], **penalties).argmax()), f"token {i}"
    assert out != run(llm, prompt, greedy(10, ignore_eos=True)).token_ids  # the penalty did change something
    assert run(llm, prompt, params).token_ids == out


def test_penalties_cost_nothing_when_off_and_batching_does_not_change_them(llm):
    logits = torch.randn(2, 8)
    seqs = [Sequence("r", None, [1, 2], SamplingParams(), RequestMetrics(0.0), stop_token_ids=frozenset({3}))
            for _ in range(2)]
    assert apply_penalties(logits, seqs) is logits
    tok = llm.get_tokenizer()
    prompts = [tok(SENTENCE).input_ids, tok("Large language models").input_ids, tok("模型").input_ids]
    params = [greedy(8, ignore_eos=True, repetition_penalty=1.5), greedy(8, ignore_eos=True),
              greedy(8, ignore_eos=True, frequency_penalty=1.0, presence_penalty=0.5)]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert together == [run(llm, p, q).token_ids for p, q in zip(prompts, params)]


def test_logprobs_stay_the_models_own_under_penalties(llm):
    prompt = llm.get_tokenizer()(SENTENCE).input_ids
    out = run(llm, prompt, greedy(3, ignore_eos=True, repetition_penalty=2.0, logprobs=0))
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        raw = torch.log_softmax(llm.engine.next_token_logits(prompt + out.token_ids[:i]), -1)
        assert entry[token].logprob == pytest.approx(float(raw[token]), abs=1e-4)


def test_min_tokens_masks_stop_tokens_in_the_sampler():
    logits = torch.zeros(2, 6)
    params = SamplingParams(min_tokens=2, max_tokens=4)
    early = Sequence("a", None, [1], params, RequestMetrics(0.0), output_token_ids=[4],
                     stop_token_ids=frozenset({2, 5}))
    late = Sequence("b", None, [1], params, RequestMetrics(0.0), output_token_ids=[4, 4],
                    stop_token_ids=frozenset({2, 5}))
    out = apply_penalties(logits, [early, late])
    assert out[0].isinf().nonzero().flatten().tolist() == [2, 5] and out[1].isfinite().all()
    assert logits.isfinite().all()  # the raw logits are left as they were


def test_min_tokens_keeps_eos_out_until_then(eos_llm):
    first = run(eos_llm, [2], greedy(8))
    assert first.token_ids == [0] and first.finish_reason == "stop" and first.stop_reason is None
    out = run(eos_llm, [2], greedy(8, min_tokens=3))
    assert len(out.token_ids) >= 3 and 0 not in out.token_ids[:3]
    logits = eos_llm.engine.next_token_logits([2]).clone()
    logits[[0, 2]] = -math.inf  # both EOS ids of this model
    assert out.token_ids[0] == int(logits.argmax())
    assert len(run(eos_llm, [2], greedy(8, ignore_eos=True)).token_ids) == 8


def test_stop_token_ids_stop_with_the_id_as_reason(llm):
    prompt = llm.get_tokenizer()(SENTENCE).input_ids
    free = run(llm, prompt, greedy(10, ignore_eos=True))
    k = next(i for i, t in enumerate(free.token_ids) if i > 0 and t not in free.token_ids[:i])
    stop_id, tok = free.token_ids[k], llm.get_tokenizer()
    for n in (1, 2):
        outs = llm.generate([prompt], greedy(10, ignore_eos=True, stop_token_ids=[stop_id], n=n),
                            use_tqdm=False)[0].outputs
        for out in outs:
            assert out.token_ids == free.token_ids[:k + 1]  # the stop token is kept in the tokens ...
            assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
            assert out.text == tok.decode(free.token_ids[:k])  # ... but its text is not shown
    shown = run(llm, prompt, greedy(10, ignore_eos=True, stop_token_ids=[stop_id], include_stop_str_in_output=True))
    assert shown.text == tok.decode(free.token_ids[:k + 1])
    # a special stop token: hidden as EOS is, shown with include_stop_str_in_output and skip_special_tokens=False
    assert run(llm, [2], greedy(5, stop_token_ids=[0])).text == ""
    assert run(llm, [2], greedy(5, stop_token_ids=[0], include_stop_str_in_output=True,
                                skip_special_tokens=False)).text == "<|endoftext|>"


def test_skip_special_tokens_false_shows_their_text(llm):
    skipped, shown = (run(llm, [2], greedy(6, ignore_eos=True, skip_special_tokens=s)) for s in (True, False))
    assert skipped.token_ids[0] == 0 and shown.token_ids == skipped.token_ids
    assert shown.text == "<|endoftext|>" + skipped.text
    assert shown.text == llm.get_tokenizer().decode(shown.token_ids, skip_special_tokens=False)


def test_include_stop_str_in_output_keeps_the_stop_string(llm):
    free = run(llm, "The quick", greedy(20, ignore_eos=True))
    stop = free.text[3:5]
    for include in (False, True):
        out = run(llm, "The quick", greedy(20, ignore_eos=True, stop=[stop], include_stop_str_in_output=include))
        end = free.text.find(stop) + len(stop) * include
        assert (out.text, out.finish_reason, out.stop_reason) == (free.text[:end], "stop", stop)


def test_min_tokens_holds_off_stop_strings(llm):
    free = run(llm, "The quick", greedy(20, ignore_eos=True))
    stop = free.text[3:5]
    out = run(llm, "The quick", greedy(20, ignore_eos=True, stop=[stop], min_tokens=20))
    assert (out.text, out.finish_reason, out.stop_reason) == (free.text, "length", None)


def greedy_by_hand(llm, prompt: list[int], n: int, banned) -> list[int]:
    """Greedy decoding from the model's own logits, with `banned(output so far)` tokens set to -inf each step."""
    out: list[int] = []
    for _ in range(n):
        logits = llm.engine.next_token_logits(prompt + out).clone()
        logits[list(banned(out))] = float("-inf")
        out.append(int(logits.argmax()))
    return out


def test_allowed_token_ids_greedy_is_the_argmax_over_them(llm):
    prompt = llm.get_tokenizer()(SENTENCE).input_ids
    plain = run(llm, prompt, greedy(12, ignore_eos=True)).token_ids
    allowed = sorted(set(range(40, 80)) - set(plain))
    out = run(llm, prompt, greedy(12, ignore_eos=True, allowed_token_ids=allowed)).token_ids
    others = [t for t in range(llm.engine.config.vocab_size) if t not in allowed]
    assert out == greedy_by_hand(llm, prompt, 12, lambda _: others) and set(out) <= set(allowed)


def test_allowed_token_ids_sampled_draw_only_those_and_logprobs_stay_the_models_own(llm):
    prompt = llm.get_tokenizer()(SENTENCE).input_ids
    allowed = [5, 60, 61, 200]
    out = llm.generate([prompt], SamplingParams(n=16, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True,
                                                allowed_token_ids=allowed, logprobs=2), use_tqdm=False)[0]
    drawn = {t for o in out.outputs for t in o.token_ids}
    assert drawn <= set(allowed) and len(drawn) > 1
    first = out.outputs[0]
    raw = torch.log_softmax(llm.engine.next_token_logits(prompt), -1)
    # vLLM's "raw_logprobs": the mask shapes the draw, the log-probs are those of the unmasked distribution
    assert first.logprobs[0][first.token_ids[0]].logprob == pytest.approx(float(raw[first.token_ids[0]]), abs=1e-4)
    top2 = raw.topk(2).indices.tolist()
    assert set(top2) <= set(first.logprobs[0]) and not set(top2) <= set(allowed)


def test_allowed_token_ids_outside_the_vocabulary_are_refused(llm):
    vocab = llm.engine.config.vocab_size
    for bad, match in [([vocab], "allowed_token_ids .* outside the vocabulary"),
                       ([1] * (vocab + 1), "allowed_token_ids has .* entries")]:
        with pytest.raises(ValueError, match=match):
            llm.generate(["a"], greedy(3, allowed_token_ids=bad), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_bad_words_spellings_follow_vllm():
    vocab = {"ab": [1, 2], " ab": [3, 2], "c": [4], " c": [5, 6], "d": [7], " d": [7]}
    spelled = bad_words_token_ids([" ab", "c", "d"], lambda text: vocab[text])
    # the leading space dropped; the spaced spelling kept when it starts differently and is as long
    assert spelled == ((1, 2), (3, 2), (4,), (7,))


def test_a_one_token_bad_word_never_appears(llm):
    tok = llm.get_tokenizer()
    prompt = tok(SENTENCE).input_ids
    plain = run(llm, prompt, greedy(16, ignore_eos=True)).token_ids
    i, word = spelled_word(llm.get_tokenizer(), plain, 1)
    banned = {t for spelling in bad_words_token_ids([word], lambda s: tok(s, add_special_tokens=False).input_ids)
              for t in spelling}
    out = run(llm, prompt, greedy(16, ignore_eos=True, bad_words=[word])).token_ids
    assert out[:i] == plain[:i] and out[i] != plain[i] and not banned & set(out)
    assert out == greedy_by_hand(llm, prompt, 16, lambda _: banned)


def test_a_longer_bad_word_bans_its_last_token_only_after_the_others(llm):
    tok = llm.get_tokenizer()
    prompt = tok("Large language models").input_ids
    plain = run(llm, prompt, greedy(30, ignore_eos=True)).token_ids
    i, word = spelled_word(llm.get_tokenizer(), plain, 2)
    spellings = bad_words_token_ids([word], lambda s: tok(s, add_special_tokens=False).input_ids)

    def banned(out):
        return [w[-1] for w in spellings if tuple(out[len(out) - len(w) + 1:]) == w[:-1]]

    out = run(llm, prompt, greedy(30, ignore_eos=True, bad_words=[word])).token_ids
    assert out[:i + 1] == plain[:i + 1] and out[i + 1] != plain[i + 1]  # its first token is still free
    assert out == greedy_by_hand(llm, prompt, 30, banned)
    assert not any(tuple(out[j:j + len(w)]) == w for w in spellings for j in range(len(out)))


def test_masks_cost_nothing_when_off_and_batched_rows_match_their_runs_alone(llm):
    logits = torch.randn(2, 8)
    seqs = [Sequence("r", None, [1, 2], SamplingParams(), RequestMetrics(0.0)) for _ in range(2)]
    assert apply_masks(logits, seqs) is logits
    tok = llm.get_tokenizer()
    prompts = [tok(SENTENCE).input_ids, tok("Large language models").input_ids, tok("模型").input_ids,
               tok("Prefill builds").input_ids]
    _, word = spelled_word(llm.get_tokenizer(), run(llm, prompts[1], greedy(30, ignore_eos=True)).token_ids, 2)
    params = [greedy(8, ignore_eos=True, allowed_token_ids=list(range(50, 90))), greedy(8, ignore_eos=True),
              greedy(8, ignore_eos=True, bad_words=[word]),
              SamplingParams(temperature=1.0, seed=4, max_tokens=8, ignore_eos=True, allowed_token_ids=[7, 8, 9])]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert together == [run(llm, p, q).token_ids for p, q in zip(prompts, params)]
    assert together[2] != run(llm, prompts[1], greedy(8, ignore_eos=True)).token_ids


def test_bad_words_hold_with_prefix_caching_and_n(llm):
    """The second run finds the prompt's blocks in the cache; the masks read each sequence's own output."""
    assert llm.engine.block_manager.enable_prefix_caching
    tok = llm.get_tokenizer()
    prompt = tok(SENTENCE + " Large language models").input_ids
    plain = run(llm, prompt, greedy(20, ignore_eos=True)).token_ids
    i, word = spelled_word(llm.get_tokenizer(), plain, 1)
    params = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=6, ignore_eos=True, bad_words=[word],
                            allowed_token_ids=sorted(set(range(120)) | {plain[i]}))
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    hits = llm.engine.block_manager.hit_tokens
    second = llm.generate([prompt], params, use_tqdm=False)[0]
    assert llm.engine.block_manager.hit_tokens - hits >= 3 * (len(prompt) // 4 * 4 - 4)  # the prompt came cached
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
    assert all(plain[i] not in o.token_ids and max(o.token_ids) < 120 for o in first.outputs)
