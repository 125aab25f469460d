"""Chapter 9 — minillm behind Triton Inference Server (PyTriton): the same greedy tokens as `LLM.generate`, for
prompts that Triton's dynamic batcher groups, and a bad prompt refused with a clear error while the server
keeps serving. Skipped without the triton extra, which needs an environment of its own (`make test-extras` makes
one and runs this there)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("pytriton")

from minillm import LLM  # noqa: E402
from minillm.sampling import SamplingParams  # noqa: E402
from minillm.service.triton_model import (  # noqa: E402
    TritonBatching, serve_triton, triton_client, triton_generate)

BATCHING = TritonBatching(max_batch_size=4, max_queue_delay_ms=200, preferred_batch_sizes=(4,), prompt_width=32)
PROMPTS = [[5, 9, 30, 2], [7, 7, 7, 100, 41, 3, 8], [12], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]
MAX_TOKENS = [6, 3, 8, 5]


@pytest.fixture(scope="module")
def triton_llm(tiny_llama):
    llm = LLM(tiny_llama, device="cpu", dtype=torch.float32, num_kv_blocks=64, block_size=4)
    with serve_triton(llm, BATCHING) as server:
        yield llm, server
    llm.shutdown()


def send(url: str, prompt: list[int], max_tokens: int) -> list[int] | str:
    """The answer's token ids, or the server's reason for refusing the prompt."""
    try:
        with triton_client(url, timeout_s=60) as client:
            return triton_generate(client, prompt, max_tokens, BATCHING.prompt_width)
    except ValueError as e:
        return str(e)


def test_triton_matches_generate(triton_llm):
    llm, server = triton_llm
    url = server.url
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # arrive together: Triton batches them
        got = list(pool.map(send, [url] * len(PROMPTS), PROMPTS, MAX_TOKENS))
    want = llm.generate(PROMPTS, [SamplingParams(max_tokens=m) for m in MAX_TOKENS], use_tqdm=False)
    assert got == [list(o.outputs[0].token_ids) for o in want]
    assert all(got)
    assert max(server.batch_sizes) > 1  # Triton ran some of them as one batch


def test_triton_refuses_bad_prompt_and_serves_its_batch(triton_llm):
    llm, server = triton_llm
    url = server.url
    bad = [1, llm.engine.config.vocab_size + 5]
    with ThreadPoolExecutor(4) as pool:  # the bad prompt shares a batch with three good ones
        got = list(pool.map(send, [url] * 4, [bad, *PROMPTS[:3]], [3] * 4))
    assert "outside the vocabulary" in got[0]
    want = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=3), use_tqdm=False)
    assert got[1:] == [list(o.outputs[0].token_ids) for o in want]
    stats = llm.stats()
    assert (stats["num_running"], stats["num_waiting"]) == (0, 0)
