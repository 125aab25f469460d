"""The engine's contract: clear errors at the boundary, stop rules, seeds, and no KV blocks lost."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import DEVICE
from minillm import LLM, SamplingParams, threads
from minillm.weights import resolve_model


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, device=DEVICE, dtype=torch.float32, num_kv_blocks=64, block_size=4)


def all_blocks_free(llm):
    s = llm.stats()
    return s["kv_blocks_free"] == s["kv_blocks_total"]


def test_unknown_model_path_is_named(tmp_path):
    with pytest.raises(ValueError, match="no-such-dir"):
        resolve_model(tmp_path / "no-such-dir")


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        LLM(tmp_path)


def test_bad_prompts_fail_clearly_and_leave_nothing_queued(llm):
    too_long = [5] * llm.stats()["max_model_len"]
    for prompts, match in [([""], "empty"), ([too_long], "prompt has 256 tokens; this model's context is 256"),
                           ([[1, 10**6]], "outside the vocabulary"), ([3.5], "string or a list of token ids")]:
        with pytest.raises(ValueError, match=match):
            llm.generate(["fine prompt"] + prompts, SamplingParams(), use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    assert all_blocks_free(llm)


def test_max_tokens_and_length_finish(llm):
    out = llm.generate("The quick brown fox", SamplingParams(max_tokens=7, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 7 and out.outputs[0].finish_reason == "length" and out.finished


def test_stop_string_truncates_text(llm):
    free = llm.generate("The quick", SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop = free.text[3:5]
    assert stop.strip()
    out = llm.generate("The quick", SamplingParams(max_tokens=20, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == free.text[:free.text.find(stop)]


def test_eos_stops_unless_ignored(llm):
    eos = llm.get_tokenizer().eos_token_id
    # force EOS by looking for a prompt whose greedy continuation contains it; with ignore_eos it must run on
    out = llm.generate([[eos, eos, eos]] * 1, SamplingParams(max_tokens=40), use_tqdm=False)[0].outputs[0]
    if eos in out.token_ids:
        assert out.token_ids[-1] == eos and out.finish_reason == "stop"
    out2 = llm.generate([[eos, eos, eos]], SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    assert len(out2.outputs[0].token_ids) == 40


def test_seed_gives_same_text_and_batching_does_not_change_it(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate("Large language models", p, use_tqdm=False)[0].outputs[0].token_ids
    batched = llm.generate(["Other prompt", "Large language models", "x"], p, use_tqdm=False)[1].outputs[0].token_ids
    again = llm.generate("Large language models", p, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == batched == again


def test_greedy_batched_equals_alone(llm):
    prompts = ["The quick brown fox", "Prefill builds the cache", "模型", "1 2 3 4 5 6 7 8 9 10 11 12"]
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
    alone = [llm.generate(q, p, use_tqdm=False)[0].outputs[0].token_ids for q in prompts]
    assert together == alone
    assert all_blocks_free(llm)


def test_preemption_under_a_tiny_pool_keeps_outputs(tiny_llama):
    small = LLM(tiny_llama, device=DEVICE, dtype=torch.float32, num_kv_blocks=12, block_size=4)
    prompts = ["The quick brown fox jumps", "Prefill builds the cache; decode", "Le modèle lit le cache"]
    p = SamplingParams(max_tokens=10, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in small.generate(prompts, p, use_tqdm=False)]
    assert small.stats()["num_preemptions"] > 0
    alone = [small.generate(q, p, use_tqdm=False)[0].outputs[0].token_ids for q in prompts]
    assert together == alone and all_blocks_free(small)


def test_metrics_have_a_timestamp_per_token(llm):
    m = llm.generate("The quick", SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)[0].metrics
    assert m.output_tokens == len(m.token_times) == 5 and m.token_times[0] == m.first_token_time
    assert m.arrival_time <= m.first_token_time <= m.token_times[-1] <= m.finished_time


def test_stream_yields_every_token_and_abort_frees_blocks(llm):
    p = SamplingParams(max_tokens=6, ignore_eos=True)
    states = list(llm.stream("The quick brown fox", p))
    assert [len(s.outputs[0].token_ids) for s in states] == [1, 2, 3, 4, 5, 6] and states[-1].finished
    gen = llm.stream("The quick brown fox", SamplingParams(max_tokens=50, ignore_eos=True))
    next(gen)
    gen.close()  # a reader that walks away aborts the request
    assert all_blocks_free(llm) and not llm.engine.has_unfinished_requests()


def test_chat_template_and_errors(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out) == 1
    with pytest.raises(ValueError, match="messages"):
        llm.chat([{"content": "no role"}])


def test_a_thread_count_the_program_chose_stays_chosen(tiny_llama, monkeypatch):
    if DEVICE != "cpu":
        pytest.skip("threads are set for CPU engines")
    before = torch.get_num_threads()
    monkeypatch.delenv("MINILLM_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        def build(**kw):
            return LLM(tiny_llama, device=DEVICE, dtype=torch.float32, num_kv_blocks=32, block_size=4, **kw)

        chosen = 3 if threads.default_num_threads() != 3 else 2
        build(num_threads=1)
        assert torch.get_num_threads() == 1  # an engine's own argument wins...
        build()
        assert torch.get_num_threads() == threads.default_num_threads()  # ...for that engine only
        torch.set_num_threads(chosen)
        build()
        assert torch.get_num_threads() == chosen  # the program's torch.set_num_threads is kept
        monkeypatch.setenv("OMP_NUM_THREADS", str(chosen))  # OpenMP's variable is a choice too
        torch.set_num_threads(chosen)
        build()
        assert torch.get_num_threads() == chosen
    finally:
        torch.set_num_threads(before)


def test_the_command_line_sleeps_waiting_threads_and_then_takes_every_core():
    """`python -m minillm` sets OMP_WAIT_POLICY=PASSIVE before PyTorch loads (unless it is set), and where waiting
    threads sleep the default is every core; a program that imports PyTorch with OpenMP spinning keeps one core
    free. Fresh interpreters: OpenMP reads the policy once."""
    probe = ("import os, runpy, sys\n"
             "sys.argv = ['minillm', '--help']\n"
             "try:\n    runpy.run_module('minillm', run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "from minillm import threads\n"
             "print(os.environ.get('OMP_WAIT_POLICY'), threads.passive_wait(), threads.default_num_threads(),"
             " threads.available_cores())")
    plain = "from minillm import threads; print(threads.passive_wait(), threads.default_num_threads())"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", threads.ENV)}

    def run(code, **extra):
        done = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                              timeout=120, check=True)
        return done.stdout.splitlines()[-1].split()  # the last line: after --help's text

    cores = threads.available_cores()
    assert run(probe) == ["PASSIVE", "True", str(cores), str(cores)]
    assert run(probe, OMP_WAIT_POLICY="ACTIVE")[:2] == ["ACTIVE", "False"]  # a policy the user set is kept
    assert run(plain) == ["False", str(max(1, cores - 1))]
    assert run(plain, OMP_WAIT_POLICY="passive") == ["True", str(cores)]


def test_threads_from_the_environment_and_a_clean_warm_up(tiny_llama, monkeypatch):
    if DEVICE != "cpu":
        pytest.skip("threads are set for CPU engines")
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("MINILLM_NUM_THREADS", "1")
        llm = LLM(tiny_llama, device=DEVICE, dtype=torch.float32, num_kv_blocks=32, block_size=4)
        assert torch.get_num_threads() == 1
        s = llm.stats()  # the warm-up ran a throwaway sequence and left nothing behind
        assert llm.engine.warmup_seconds > 0 and all_blocks_free(llm) and s["prefix_cache_query_tokens"] == 0
        for bad in ("0", "two", "-1"):
            monkeypatch.setenv("MINILLM_NUM_THREADS", bad)
            with pytest.raises(ValueError, match="MINILLM_NUM_THREADS"):
                LLM(tiny_llama, device=DEVICE, dtype=torch.float32, num_kv_blocks=32, block_size=4)
    finally:
        torch.set_num_threads(before)
