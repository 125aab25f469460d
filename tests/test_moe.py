"""Mixture-of-Experts models (tiny random Mixtral and Qwen2-MoE) against transformers, token for token; their experts
split over 2 ranks by channels (tensor parallel) or whole (expert parallel) give the one-process tokens; the expert
load is counted."""

import multiprocessing
import shutil

import pytest
import torch
from safetensors.torch import save_file

from conftest import DEVICE
from hf_reference import hf_greedy, load_hf
from minillm import LLM, SamplingParams
from minillm.config import ModelConfig
from minillm.model import load_model
from minillm.moe import SparseMoeBlock, expert_load, record_expert_load
from minillm.parallel.comm import run_group
from minillm.parallel.config import ParallelConfig
from minillm.parallel.state import ParallelContext
from tiny_models import build_tiny_model

PROMPTS = ["The quick brown fox", "模型逐个生成词元。", "Prefill builds the cache; decode reads it. " * 6, "1"]
NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def tiny_moe(request, tmp_path_factory):
    """Mixtral (4 experts, top-2, renormalized) and Qwen2-MoE (8 experts, top-2, not renormalized, shared expert)."""
    return build_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param)


@pytest.fixture(scope="module")
def llm(tiny_moe):
    return LLM(tiny_moe, device=DEVICE, dtype=torch.float32)


@pytest.fixture(scope="module")
def single_cpu(tiny_moe):
    """One process's greedy tokens on a CPU: what the 2-rank layouts must reproduce."""
    return _tokens(LLM(tiny_moe, device="cpu", dtype=torch.float32))


def _tokens(llm, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_config_reads_the_experts(tiny_moe):
    config, hf = ModelConfig.from_dir(tiny_moe), load_hf(tiny_moe)
    assert config.num_params == sum(p.numel() for p in hf.parameters())  # every expert counted
    assert config.num_experts == (4 if hf.config.model_type == "mixtral" else 8) and config.num_experts_per_tok == 2
    assert config.qkv_bias == (hf.config.model_type == "qwen2_moe")
    assert config.norm_topk_prob == (hf.config.model_type == "mixtral")


def test_greedy_matches_transformers_token_for_token(llm, tiny_moe):
    hf, tok = load_hf(tiny_moe, DEVICE), llm.get_tokenizer()
    for prompt, tokens in zip(PROMPTS, _tokens(llm)):
        ids = tok(prompt).input_ids
        expected, ref = hf_greedy(hf, ids, NEW_TOKENS)
        assert tokens == expected, prompt
        torch.testing.assert_close(llm.engine.next_token_logits(ids).cpu(), ref, atol=1e-4, rtol=0)


def test_fused_expert_checkpoint_loads_the_same(llm, tiny_moe, tmp_path):
    """transformers' in-memory names (`experts.gate_up_proj` `[experts, 2 I, hidden]`) load as the per-expert ones."""
    fused = tmp_path / "fused"
    shutil.copytree(tiny_moe, fused)
    state = {k: v.detach().clone().contiguous() for k, v in load_hf(tiny_moe).state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(fused / "model.safetensors"))
    assert _tokens(LLM(fused, device=DEVICE, dtype=torch.float32)) == _tokens(llm)


def test_expert_counts_sum_to_tokens_times_top_k(tiny_moe):
    llm = LLM(tiny_moe, device=DEVICE, dtype=torch.float32, enable_prefix_caching=False)
    record_expert_load(llm.engine.model)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    tokens = sum(len(o.prompt_token_ids) + 2 for o in outs)  # each prompt, then 2 decode steps
    counts = expert_load(llm.engine.model)
    assert sorted(counts) == [0, 1] and all(c.sum() == 2 * tokens for c in counts.values())
    assert all((c > 0).sum() > 1 for c in counts.values())  # the router spreads the tokens
    record_expert_load(llm.engine.model, enable=False)
    assert expert_load(llm.engine.model) == {}


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_two_ranks_equal_one_process(tiny_moe, single_cpu, expert_parallel):
    before = set(multiprocessing.active_children())
    with LLM(tiny_moe, device="cpu", dtype=torch.float32, tensor_parallel_size=2, enable_prefix_caching=False,
             enable_expert_parallel=expert_parallel) as llm:
        record_expert_load(llm.engine.model)
        tokens = _tokens(llm)
        counts = expert_load(llm.engine.model)
        tp = llm.engine.executor.collect()[0]["tp"]
    assert set(multiprocessing.active_children()) <= before
    assert tokens == single_cpu
    run = sum(len(ids) for ids in llm.get_tokenizer()(PROMPTS).input_ids) + len(PROMPTS) * (NEW_TOKENS - 1)
    assert all(c.sum() == 2 * run for c in counts.values())  # rank 0's counts cover every rank's tokens
    if expert_parallel:
        assert tp["all_to_all"].calls > 0 and tp["all_to_all"].bytes > 0
        assert all((c.view(2, -1).sum(1) > 0).all() for c in counts.values())  # both ranks' experts had work
    else:
        assert "all_to_all" not in tp


def _block_outputs(comm, path, sizes):
    """Layer 0's MoE block on this rank, tensor- then expert-parallel, on random hidden states of each size."""
    config, outs = ModelConfig.from_dir(path), []
    for expert_parallel in (False, True):
        ctx = ParallelContext(ParallelConfig(comm.world_size, 1, expert_parallel), comm.rank, comm, comm, comm)
        block = load_model(path, config, torch.float32, torch.device("cpu"), ctx=ctx).layers[0].mlp
        assert isinstance(block, SparseMoeBlock)
        outs.append([block(torch.randn(n, config.hidden_size, generator=torch.Generator().manual_seed(n)))
                     for n in sizes])
    return outs


def test_block_splits_equal_one_process_for_any_token_count(tiny_moe):
    """Fewer tokens than ranks (a decode step of one sequence) and counts the ranks do not divide."""
    sizes = [1, 2, 3, 7]
    config = ModelConfig.from_dir(tiny_moe)
    block = load_model(tiny_moe, config, torch.float32, torch.device("cpu")).layers[0].mlp
    want = [block(torch.randn(n, config.hidden_size, generator=torch.Generator().manual_seed(n))) for n in sizes]
    for rank_outs in run_group(_block_outputs, 2, tiny_moe, sizes):
        for outs in rank_outs:  # tensor parallel, expert parallel
            for got, expected in zip(outs, want):
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_impossible_expert_layouts_are_named(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="needs a Mixture-of-Experts model"):
        LLM(tiny_llama, tensor_parallel_size=2, enable_expert_parallel=True)
    three = build_tiny_model(tmp_path / "three", arch="mixtral", num_local_experts=3)
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="3 experts cannot be spread evenly over tensor_parallel_size=2"):
        LLM(three, tensor_parallel_size=2, enable_expert_parallel=True)
    assert set(multiprocessing.active_children()) <= before
