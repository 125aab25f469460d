"""Our forward pass against transformers on tiny random checkpoints of every supported family."""

import pytest
import torch

from conftest import DEVICE
from hf_reference import hf_greedy, load_hf
from minillm import LLM, SamplingParams
from minillm.config import ModelConfig

PROMPTS = ["The quick brown fox", "模型逐个生成词元。", "Prefill builds the cache; decode reads it. " * 6, "1"]


@pytest.fixture(scope="module")
def pair(tiny_any):
    return LLM(tiny_any, device=DEVICE, dtype=torch.float32), load_hf(tiny_any, DEVICE)


def test_logits_match_transformers(pair):
    llm, hf = pair
    for prompt in PROMPTS:
        ids = llm.get_tokenizer()(prompt).input_ids
        _, ref = hf_greedy(hf, ids, 0)
        ours = llm.engine.next_token_logits(ids).cpu()
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_greedy_matches_transformers_token_for_token(pair):
    llm, hf = pair
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        expected, _ = hf_greedy(hf, tok(prompt).input_ids, 24)
        assert out.outputs[0].token_ids == expected, prompt


def test_config_reads_every_family(tiny_any):
    config = ModelConfig.from_dir(tiny_any)
    hf = load_hf(tiny_any)
    assert config.num_params == sum(p.numel() for p in hf.parameters())
    assert config.qkv_bias == (hf.config.model_type == "qwen2")


def test_dummy_weights_have_the_right_shapes(tiny_llama):
    llm = LLM(tiny_llama, device=DEVICE, load_format="dummy")
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="load_format"):
        LLM(tiny_llama, load_format="pt")
