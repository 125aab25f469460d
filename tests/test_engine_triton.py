"""The engine with its attention on minillm's Triton kernels (interpreted on a CPU) gives the same greedy tokens."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from conftest import DEVICE, requires_default_model
from hf_reference import hf_greedy, load_hf
from minillm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

PROMPTS = ["The quick brown fox jumps over the lazy dog", "模型逐个生成词元。", "1",
           "Prefill builds the cache; decode reads it. " * 3]


def run(path, backend, monkeypatch, **kwargs):
    monkeypatch.setenv("MINILLM_ATTENTION", backend)
    llm = LLM(path, device=DEVICE, dtype=torch.float32, **kwargs)
    assert llm.engine.runner.use_triton == (backend == "triton")
    p = SamplingParams(max_tokens=6, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS + PROMPTS[:2], p, use_tqdm=False)]


def test_triton_path_keeps_greedy_outputs(tiny_llama, monkeypatch):
    """Mixed steps: chunked prefills (budget 16), prefix-cache hits (repeated prompts), decodes, block size 4."""
    kwargs = dict(block_size=4, num_kv_blocks=128, max_num_batched_tokens=16)
    assert run(tiny_llama, "triton", monkeypatch, **kwargs) == run(tiny_llama, "torch", monkeypatch, **kwargs)


@pytest.mark.slow
@requires_default_model
def test_default_model_parity_with_triton_forced(monkeypatch):
    monkeypatch.setenv("MINILLM_ATTENTION", "triton")
    llm = LLM(device=DEVICE, dtype=torch.float32)
    assert llm.engine.runner.use_triton
    tok = llm.get_tokenizer()
    prompts = [tok("The capital of France is").input_ids,
               llm.apply_chat_template([{"role": "user", "content": "Name a prime number."}])]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    hf = load_hf(llm.engine.path, DEVICE)
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 8)[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is for machines without CUDA")
def test_triton_imported_before_minillm_is_a_clear_error():
    """TRITON_INTERPRET must be set before triton's first import; transformers' model classes import it."""
    code = ("import os; os.environ['MINILLM_ATTENTION'] = 'triton'\n"
            "from transformers import AutoModelForCausalLM\n"
            "from minillm.kernels import use_triton\n"
            "use_triton('cpu')")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0 and "import minillm before transformers" in done.stderr
