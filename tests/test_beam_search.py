"""Beam search through the engine equals a plain beam search over full forward passes of transformers."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from minillm import LLM, SamplingParams
from minillm.beam_search import BeamSearchParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, device="cpu", dtype=torch.float32, num_kv_blocks=256, block_size=4)


def reference_beams(model, prompt: list[int], width: int, steps: int) -> list[tuple[list[int], float]]:
    """Keep the `width` best (tokens, summed log-prob) of every one-token extension, recomputing from scratch."""
    beams = [([], 0.0)]
    with torch.no_grad():
        for _ in range(steps):
            grown = []
            for tokens, score in beams:
                logp = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0, -1].float(), -1)
                top = torch.topk(logp, 2 * width)
                grown += [(tokens + [t], score + v) for t, v in zip(top.indices.tolist(), top.values.tolist())]
            beams = sorted(grown, key=lambda b: b[1], reverse=True)[:width]
    return beams


@pytest.mark.parametrize("width", [1, 3])
def test_beams_match_a_reference_search(llm, tiny_llama, width):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prompts = ["The quick brown fox", "Prefill builds"]
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=5, ignore_eos=True,
                                                     length_penalty=0.0))
    for prompt, out in zip(prompts, outs):
        want = reference_beams(model, llm.get_tokenizer()(prompt).input_ids, width, 5)
        assert [s.tokens for s in out.sequences] == [t for t, _ in want]
        assert [s.cum_logprob for s in out.sequences] == pytest.approx([v for _, v in want], abs=1e-4)


def test_width_one_is_greedy_and_wider_beams_come_ranked(llm):
    prompt = "Large language models"
    greedy = llm.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0), use_tqdm=False)[0]
    one = llm.beam_search(prompt, BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))[0].sequences[0]
    assert one.tokens == greedy.outputs[0].token_ids
    ids = llm.get_tokenizer()(prompt).input_ids  # one prompt given as token ids, not a batch of ints
    (by_ids,) = llm.beam_search(ids, BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))
    assert by_ids.sequences[0].tokens == one.tokens
    assert one.cum_logprob == pytest.approx(greedy.outputs[0].cumulative_logprob, abs=1e-4)
    four = llm.beam_search(prompt, BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True))[0].sequences
    assert len({tuple(b.tokens) for b in four}) == 4
    assert [b.score(1.0) for b in four] == sorted((b.score(1.0) for b in four), reverse=True)
    s = llm.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"]


def test_bad_beam_parameters_are_named():
    for bad in (dict(beam_width=0, max_tokens=3), dict(beam_width=11, max_tokens=3), dict(beam_width=2, max_tokens=0)):
        with pytest.raises(ValueError, match="beam_width|max_tokens"):
            BeamSearchParams(**bad)
