"""The engine on several processes: tensor, pipeline and combined layouts give the single-process greedy tokens
(tiny models, and the default model at TP = 3); worker processes talk over loopback only, and never outlive the
LLM, whether it is shut down, fails to build, loses a worker, or dies itself."""

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import requires_default_model
from minillm import LLM, SamplingParams
from tiny_models import build_tiny_model

PROMPTS = ["The quick brown fox", "Large language models generate", "Le modèle lit le cache", "1234567890 + 1"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    """4 query and 4 key/value heads, 3 layers: splits over 2 and 4 ranks and into 2 or 3 uneven stages."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny4"), num_attention_heads=4, num_key_value_heads=4,
                                num_hidden_layers=3, tie=False))


def _tokens(llm, prompts=PROMPTS, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def single(tiny4):
    return _tokens(LLM(tiny4, device="cpu"))


@pytest.mark.parametrize("tp,pp", [(2, 1), (4, 1), (1, 2), (1, 3), (2, 2)])
def test_layouts_equal_one_process(tiny4, single, tp, pp):
    before = set(multiprocessing.active_children())
    with LLM(tiny4, device="cpu", tensor_parallel_size=tp, pipeline_parallel_size=pp) as llm:
        assert _tokens(llm) == single
        reports = llm.engine.executor.collect()
    assert len(reports) == tp * pp
    if tp > 1:  # two all-reduces per layer (attention, MLP) and one for the embedding, per step and stage
        assert all(r["tp"]["all_reduce"].calls > 0 and r["tp"]["all_reduce"].bytes > 0 for r in reports)
    if pp > 1:  # activations cross every stage boundary; logits come back to rank 0
        assert reports[0]["world"]["send"].calls > 0 and reports[tp * (pp - 1)]["world"]["send"].calls > 0
    assert set(multiprocessing.active_children()) <= before


def test_micro_batches_chunked_prefill_and_prompt_logprobs(tiny4):
    """More micro-batches than stages, prompts split over steps, and prompt log-probs (logits at many rows)."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=1, logprobs=2)
    prompts = PROMPTS * 2
    kwargs = dict(max_num_batched_tokens=12, block_size=4)

    def run(llm):
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [None if p is None else sorted(p) for p in o.prompt_logprobs],
                 [round(lp[t].logprob, 4) for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in outs]

    want = run(LLM(tiny4, device="cpu", **kwargs))
    with LLM(tiny4, device="cpu", pipeline_parallel_size=2, **kwargs) as llm:
        llm.engine.executor.num_micro_batches = 3
        llm.engine.executor.tracing = True
        assert run(llm) == want
        events = [e for r in llm.engine.executor.collect() for e in r["trace"]]
    assert {e.micro_batch for e in events} == {0, 1, 2} and {e.stage for e in events} == {0, 1}
    assert all(e.end >= e.start for e in events)


def test_impossible_layouts_are_named(tiny4):
    with pytest.raises(ValueError, match="must divide the model's 4 query heads"):
        LLM(tiny4, device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="exceeds the model's 3 layers"):
        LLM(tiny4, device="cpu", pipeline_parallel_size=4)
    with pytest.raises(ValueError, match="positive integer"):
        LLM(tiny4, device="cpu", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="needs a Mixture-of-Experts model"):
        LLM(tiny4, device="cpu", enable_expert_parallel=True)
    with pytest.raises(ValueError, match="quantization is not supported"):
        LLM(tiny4, device="cpu", tensor_parallel_size=2, quantization="int8")


def test_a_failed_build_leaves_no_process(tiny4):
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="load_format 'bogus'"):
        LLM(tiny4, device="cpu", tensor_parallel_size=2, load_format="bogus")
    assert set(multiprocessing.active_children()) <= before


def test_a_lost_worker_is_an_error_not_a_hang(tiny4):
    before = set(multiprocessing.active_children())
    llm = LLM(tiny4, device="cpu", tensor_parallel_size=2)
    try:
        (worker,) = llm.engine.executor._procs
        os.kill(worker.pid, signal.SIGKILL)
        worker.join()
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 30
    finally:
        llm.shutdown()
    assert set(multiprocessing.active_children()) <= before


CRASH = """
import os, sys
from minillm import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], device="cpu", tensor_parallel_size=2)
    print(*[p.pid for p in llm.engine.executor._procs], flush=True)
    os._exit(3)  # dies without shutting anything down
"""


def test_workers_die_with_their_parent(tiny4, tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(CRASH)
    done = subprocess.run([sys.executable, str(script), tiny4], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    pids = [int(p) for p in done.stdout.split()]
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_ranks_talk_over_loopback_only(tiny4):
    if shutil.which("ss") is None:
        pytest.skip("needs the ss command (iproute2)")
    with LLM(tiny4, device="cpu", tensor_parallel_size=2, pipeline_parallel_size=2) as llm:
        _tokens(llm, PROMPTS[:1])
        pids = {os.getpid()} | {p.pid for p in llm.engine.executor._procs}
        lines = subprocess.run(["ss", "-tanp"], capture_output=True, text=True, check=True).stdout.splitlines()
    sockets = [line.split()[3:5] for line in lines if any(f"pid={pid}," in line for pid in pids)]
    assert len(sockets) >= 4, "ss showed too few of the group's sockets"
    for local, peer in sockets:
        for address in (local, peer):
            host = address.rsplit(":", 1)[0].strip("[]")
            assert host in ("127.0.0.1", "::ffff:127.0.0.1", "::1") or address in ("0.0.0.0:*", "*:*"), address


@requires_default_model
@pytest.mark.slow
def test_default_model_at_tp3_equals_one_process(default_llm):
    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "Explain the KV cache."]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = _tokens(default_llm, prompts, params)
    with LLM(device="cpu", tensor_parallel_size=3) as llm:
        assert _tokens(llm, prompts, params) == want
        tp = llm.engine.executor.collect()[0]["tp"]
    assert tp["all_reduce"].calls > 0 and tp["gather"].calls > 0
