"""Batching never changes a greedy output: random workloads, tiny pools, chunked prefill, shared prefixes, aborts."""

import random

import pytest
import torch

from conftest import DEVICE
from minillm import LLM, SamplingParams
from minillm.block_manager import BlockManager
from minillm.metrics import RequestMetrics
from minillm.sequence import Sequence

WORDS = "the cache block token prefill decode model batch queue step page table share copy write".split()


def random_workload(rng: random.Random, tokenizer, n: int) -> list[tuple[list[int], int]]:
    system = tokenizer(" ".join(rng.choices(WORDS, k=rng.randint(8, 30)))).input_ids
    work = []
    for _ in range(n):
        own = tokenizer(" ".join(rng.choices(WORDS, k=rng.randint(1, 25)))).input_ids
        prompt = system + own if rng.random() < 0.6 else own  # most requests share a prefix
        work.append((prompt, rng.randint(1, 20)))
    return work


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_match_isolated_runs(tiny_llama, reference, seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    num_blocks = rng.choice([24, 48, 512]) * (16 // block_size if block_size < 16 else 1)
    llm = LLM(tiny_llama, device=DEVICE, dtype=torch.float32, block_size=block_size, num_kv_blocks=num_blocks,
              max_num_seqs=rng.choice([2, 5, 64]), max_num_batched_tokens=rng.choice([7, 32, 2048]),
              enable_prefix_caching=rng.random() < 0.8)
    work = random_workload(rng, llm.get_tokenizer(), rng.randint(4, 12))
    work = [(p[: llm.stats()["max_model_len"] - m - 1], m) for p, m in work]
    outs = llm.generate([p for p, _ in work], [SamplingParams(max_tokens=m, ignore_eos=True) for _, m in work],
                        use_tqdm=False)
    for (prompt, m), out in zip(work, outs):
        assert out.outputs[0].token_ids == reference(tuple(prompt), m)
        assert out.outputs[0].finish_reason == "length"
    s = llm.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"] and s["num_running"] == s["num_waiting"] == 0


def test_tiny_pool_preempts_and_still_matches(tiny_llama, reference):
    llm = LLM(tiny_llama, device=DEVICE, dtype=torch.float32, block_size=2, num_kv_blocks=40)
    work = [(p[:40], m) for p, m in random_workload(random.Random(99), llm.get_tokenizer(), 8)]
    outs = llm.generate([p for p, _ in work], [SamplingParams(max_tokens=20, ignore_eos=True)] * len(work),
                        use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == [reference(tuple(p), 20) for p, _ in work]
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_shared_prefix_hits_the_cache_and_copy_on_write_keeps_outputs(tiny_llama, reference):
    llm = LLM(tiny_llama, device=DEVICE, dtype=torch.float32, block_size=4, num_kv_blocks=64)
    tok = llm.get_tokenizer()
    prompt = tok(" ".join(WORDS))["input_ids"]
    prompt = prompt[: len(prompt) // 4 * 4]  # whole blocks, so a repeat is a full hit and needs copy-on-write
    p = SamplingParams(max_tokens=8, ignore_eos=True)
    first = llm.generate([prompt], p, use_tqdm=False)[0]
    both = llm.generate([prompt, prompt + tok(" extra words")["input_ids"]], p, use_tqdm=False)
    s = llm.stats()
    assert s["prefix_cache_hit_tokens"] >= 2 * (len(prompt) - 4)
    assert both[0].outputs[0].token_ids == first.outputs[0].token_ids == reference(tuple(prompt), 8)
    assert both[1].outputs[0].token_ids == reference(tuple(both[1].prompt_token_ids), 8)
    assert s["kv_blocks_free"] == s["kv_blocks_total"]


def test_reset_prefix_cache_forgets_finished_prompts(tiny_llama, reference):
    llm = LLM(tiny_llama, device=DEVICE, dtype=torch.float32, block_size=4, num_kv_blocks=64)
    prompt = llm.get_tokenizer()(" ".join(WORDS))["input_ids"]
    p = SamplingParams(max_tokens=4, ignore_eos=True)
    llm.generate([prompt], p, use_tqdm=False)
    llm.reset_prefix_cache()
    again = llm.generate([prompt], p, use_tqdm=False)[0]
    assert llm.stats()["prefix_cache_hit_tokens"] == 0
    assert again.outputs[0].token_ids == reference(tuple(prompt), 4)
    llm.generate([prompt], p, use_tqdm=False)  # cached again from the run after the reset
    assert llm.stats()["prefix_cache_hit_tokens"] > 0


def test_abort_mid_flight_frees_blocks_and_spares_others(tiny_llama, reference):
    llm = LLM(tiny_llama, device=DEVICE, dtype=torch.float32, block_size=4, num_kv_blocks=64)
    engine = llm.engine
    prompts = [engine.tokenize(t)[1] for t in ["the cache block", "prefill decode model", "batch queue step"]]
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    ids = [engine.add_request(None, q, p) for q in prompts]
    finished = {}
    for step in range(40):
        if step == 3:
            free = llm.stats()["kv_blocks_free"]
            aborted = engine.abort(ids[1])  # between steps: applied at once, its final output returned
            assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
            assert len(aborted.outputs[0].token_ids) == 3 and llm.stats()["kv_blocks_free"] > free
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert set(finished) == {ids[0], ids[2]}
    for i in (0, 2):
        assert finished[ids[i]].outputs[0].token_ids == reference(tuple(prompts[i]), 12)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_block_manager_reference_counts():
    bm = BlockManager(num_blocks=6, block_size=2)
    make = lambda ids: Sequence("r", None, ids, SamplingParams(), RequestMetrics(0.0))
    a = make([1, 2, 3, 4, 5])
    assert bm.allocate(a) and len(a.block_table) == 3 and bm.num_free_blocks == 3
    a.num_cached_tokens = 5
    bm.commit(a)  # two full blocks hashed
    b = make([1, 2, 3, 4, 9])
    assert bm.allocate(b) and b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 4
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.free(a)
    assert bm.num_free_blocks == 3  # a's private tail block only
    bm.free(b)
    assert bm.num_free_blocks == 6
    c = make([1, 2, 3, 4])  # a full hit: the last token is recomputed, into a block nobody else holds
    assert bm.allocate(c) and c.num_cached_tokens == 3
    d = make([1, 2, 3, 4])
    assert bm.allocate(d) and bm.blocks[d.block_table[1]].ref_count == 2
    copies = bm.grow(d, 4)
    assert copies == [(c.block_table[1], d.block_table[1])] and bm.blocks[c.block_table[1]].ref_count == 1
    too_big = make(list(range(100, 120)))
    assert not bm.allocate(too_big) and too_big.block_table == []
