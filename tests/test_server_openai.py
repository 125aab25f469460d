"""The server on the real default model, driven by the official `openai` client and by 200 concurrent
streams: what comes over HTTP is what `LLM.generate` computes, token for token, and load, disconnects
and aborts leave no request or KV block behind."""

import asyncio
import json
import random

import httpx
import openai
import pytest

from conftest import requires_default_model
from minillm import SamplingParams
from serving_utils import scrape, start_server, wait_idle

pytestmark = [pytest.mark.slow, requires_default_model]
MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "Name three primary colors."}]


@pytest.fixture(scope="module")
def server():
    srv = start_server(None, MODEL)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c
        wait_idle(c)


def test_chat_with_the_openai_client_equals_llm_chat(client, http, default_llm):
    want = default_llm.chat(QUESTION, SamplingParams(max_tokens=24), use_tqdm=False)[0]
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    assert full.choices[0].message.content == want.outputs[0].text
    assert full.choices[0].finish_reason == want.outputs[0].finish_reason
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(want.prompt_token_ids),
                                                                        len(want.outputs[0].token_ids))
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.outputs[0].text
    assert chunks[-1].usage.completion_tokens == len(want.outputs[0].token_ids)


def test_streamed_completion_is_token_for_token_llm_generate(client, http, default_llm):
    prompt = "The three laws of thermodynamics are"
    want = default_llm.generate(prompt, SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    token_text = default_llm.engine.output_processor.token_text
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, logprobs=0,
                                       stream=True, extra_body={"ignore_eos": True},
                                       stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    tokens = [t for c in chunks if c.choices for t in c.choices[0].logprobs.tokens]
    assert tokens == [token_text(t) for t in want.token_ids]  # one token at a time, the same tokens
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == 32 and chunks[-1].usage.prompt_tokens == len(
        default_llm.get_tokenizer()(prompt).input_ids)
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.choices[0].text == want.text and full.usage.completion_tokens == 32


def test_n_with_a_seed_gives_reproducible_completions(client, http):
    def three():
        r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0.9, n=3,
                                           seed=1234)
        return [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
    first = three()
    assert len(first) == 3 and len(set(first)) > 1 and three() == first


def test_disconnects_abort_streaming_and_non_streaming_requests(server, http):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    aborted = scrape(http).get('request_success_total{finished_reason="abort"}', 0)
    with httpx.Client(base_url=server.url, timeout=60) as other:
        with other.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            next(line for line in r.iter_lines() if line.startswith("data:"))  # one token, then hang up
    with pytest.raises(httpx.TimeoutException):  # a non-streaming client that gives up waiting
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    wait_idle(http, seconds=5)  # far sooner than 400 tokens would take
    assert scrape(http)['request_success_total{finished_reason="abort"}'] == aborted + 2


def test_200_concurrent_streams_with_disconnects(server, http, default_llm):
    """200 streams at once, 20% of clients hanging up at random points: every stream that completes equals
    its prompt's isolated greedy output, and afterwards nothing is left running, waiting or holding blocks."""
    rng = random.Random(0)
    words = "cache token batch queue page prefill decode model server stream request block".split()
    prompts = [" ".join(rng.choices(words, k=rng.randint(3, 12))) for _ in range(25)]
    lengths = [rng.randint(4, 12) for _ in prompts]
    isolated = [default_llm.generate(p, SamplingParams(max_tokens=m, ignore_eos=True), use_tqdm=False)[0]
                .outputs[0].text for p, m in zip(prompts, lengths)]
    jobs = [(i % len(prompts), rng.random() < 0.2) for i in range(200)]
    rng.shuffle(jobs)

    async def one(client: httpx.AsyncClient, i: int, hang_up: bool):
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": lengths[i], "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        stop_after = rng.randint(0, lengths[i] - 1) if hang_up else None
        text, events = "", []
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if stop_after is not None and len(events) >= stop_after:
                    return i, None  # leaving the block closes the connection mid-stream
                events.append(line[6:])
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        return i, (text, chunks[-1]["usage"]["completion_tokens"])

    async def run_all():
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i, h) for i, h in jobs)), timeout=600)

    results = asyncio.run(run_all())
    done = [(i, r) for i, r in results if r is not None]
    assert len(done) >= 150
    for i, (text, tokens) in done:
        assert text == isolated[i] and tokens == lengths[i]
    after = wait_idle(http)
    assert http.get("/health").status_code == 200
    assert after['request_success_total{finished_reason="length"}'] >= len(done)
