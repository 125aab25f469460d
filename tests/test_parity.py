"""Truth test: the real default model through minillm equals transformers, token for token (fp32, CPU)."""

import pytest

from conftest import requires_default_model
from hf_reference import hf_greedy, load_hf
from minillm import SamplingParams

pytestmark = [pytest.mark.slow, requires_default_model,
              pytest.mark.xdist_group("parity")]  # one worker computes the transformers reference once

LONG = " ".join(f"Step {i}: the scheduler admits a request, the model prefills its prompt, and decode "
                "appends one token per step while the KV cache grows." for i in range(20))
TEXT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Les grands modèles de langage génèrent du texte",
    "大模型推理的两个阶段是",
    LONG,
]
CHATS = [
    [{"role": "user", "content": "What is a KV cache? Answer in one sentence."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List three prime numbers."}],
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def prompts(default_llm):
    tok = default_llm.get_tokenizer()
    return [tok(p).input_ids for p in TEXT_PROMPTS] + [default_llm.apply_chat_template(c) for c in CHATS]


@pytest.fixture(scope="module")
def reference(default_llm, prompts):
    hf = load_hf(default_llm.engine.path)
    return [hf_greedy(hf, ids, NEW_TOKENS) for ids in prompts]


def test_prompts_cover_the_cases(prompts):
    assert len(prompts) >= 8
    assert max(len(p) for p in prompts) >= 400  # the long prompt


def test_greedy_tokens_equal_transformers(default_llm, prompts, reference):
    outs = default_llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    for out, (expected, _) in zip(outs, reference):
        assert out.outputs[0].token_ids == expected


def test_last_position_logits_within_1e_4(default_llm, prompts, reference):
    for ids, (_, ref) in zip(prompts, reference):
        ours = default_llm.engine.next_token_logits(ids)
        assert (ours - ref).abs().max().item() < 1e-4


def test_chat_answers_sensibly(default_llm):
    out = default_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(max_tokens=20), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"
