"""`serve --pd`: a prefill/decode pool behind the OpenAI server (chapter 9). The official client's streams come
from the decode instances token by token, with one engine's text; two prefill instances share the prompts and one
decode instance pulls from both; a client that hangs up frees every block on every instance; a killed instance
ends the requests in flight with an error and stops the server, never a hang."""

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest

from minillm import LLMEngine
from minillm.disagg import PDPair
from minillm.serving import AsyncLLM, ServerThread, build_app
from serving_utils import Served, serve_engine, wait_for

pytestmark = pytest.mark.slow
ENGINE = dict(device="cpu", block_size=4, num_kv_blocks=128, max_num_batched_tokens=64)
CHATS = ["Tell me about the sea.", "Name three colours.", "What is a cache?", "Count to five."]


def serve_pool(model, **pool_kw) -> ServerThread:
    return ServerThread(build_app(AsyncLLM(PDPair(model, **ENGINE, **pool_kw), max_waiting_requests=64),
                                  "test-model")).start()


def chat_stream(url: str, text: str, max_tokens: int = 24) -> tuple[str, int]:
    """The streamed reply's text and how many chunks carried it."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    stream = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": text}],
                                            max_tokens=max_tokens, temperature=0, stream=True)
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    return "".join(pieces), len(pieces)


def sampled(url: str) -> list[tuple[str, list[int] | None]]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    r = client.completions.create(model="test-model", prompt="Once upon a time", max_tokens=8, n=2, seed=3,
                                  temperature=0.8, logprobs=2)
    return [(c.text, c.logprobs.tokens) for c in r.choices]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """What one engine's server answers."""
    with serve_engine(LLMEngine(tiny_llama, **ENGINE)) as srv:  # the pool's dtype: the default
        yield {text: chat_stream(srv.url, text)[0] for text in CHATS}, sampled(srv.url)


def test_two_prefill_instances_feed_one_decoder_with_one_engines_text(tiny_llama, reference):
    chats, want_sampled = reference
    srv = serve_pool(tiny_llama, num_prefill=2, num_decode=1)
    pool = srv.llm.engine
    try:
        with ThreadPoolExecutor(len(CHATS)) as ex:  # at once: the two prefill instances share them
            got = dict(zip(CHATS, ex.map(lambda t: chat_stream(srv.url, t), CHATS)))
        assert {t: text for t, (text, _) in got.items()} == chats
        assert all(chunks > 1 for _, chunks in got.values())  # streamed as decoded, not in one piece
        assert sampled(srv.url) == want_sampled  # n = 2, seeded: the decode side goes on from the prefill's state
        stats = pool.instance_stats()
        assert all(len(p["transfers"]) >= 1 for p in stats["prefill"])  # both prefill instances were used
        (decode,) = stats["decode"]
        assert len(decode["transfers"]) == sum(len(p["transfers"]) for p in stats["prefill"])
        # a client that hangs up mid-stream: its blocks come back on every instance
        with httpx.Client(base_url=srv.url, timeout=60) as c, c.stream(
                "POST", "/v1/completions", json={"prompt": "Once", "max_tokens": 240, "ignore_eos": True,
                                                 "stream": True}) as r:  # 240: the tiny model's context is 256
            assert r.status_code == 200
            next(line for line in r.iter_lines() if line.startswith("data: "))
        wait_for(lambda: pool.stats()["num_running"] == 0 and
                 pool.stats()["kv_blocks_free"] == pool.stats()["kv_blocks_total"], 20, "every block freed")
        assert httpx.get(srv.url + "/metrics").text.count("minillm:kv_cache_usage_perc") >= 1
    finally:
        srv.stop()
        pool.shutdown()
    assert not any(p.is_alive() for p in (i.process for i in pool._all()))


def test_a_killed_decode_instance_ends_the_stream_with_an_error_and_stops_the_server(tiny_llama):
    srv = serve_pool(tiny_llama)
    pool = srv.llm.engine
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c, c.stream(
                "POST", "/v1/completions", json={"prompt": "Once", "max_tokens": 240, "ignore_eos": True,
                                                 "stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            start = time.monotonic()
            os.kill(pool._instances["decode"][0].process.pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert time.monotonic() - start < 30
        assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2], rest[-3:]
        wait_for(lambda: not srv.thread.is_alive(), 30, "the server to stop")
        assert srv.failed  # exit status 1, as `serve` exits after an engine failure: a supervisor restarts it
    finally:
        srv.stop()
        pool.shutdown()
    assert not any(p.is_alive() for p in (i.process for i in pool._all()))


def test_serve_pd_streams_through_the_openai_client(tiny_llama, reference):
    chats, _ = reference
    srv = None
    try:
        srv = Served("--model", str(tiny_llama), "--threads", "2", "--pd", "1:1", "--block-size", "4",
                     "--num-kv-blocks", "128", "--served-model-name", "test-model")
        assert "(1 prefill + 1 decode instances)" in srv.ready, srv.ready
        instances = psutil.Process(srv.proc.pid).children()
        assert len(instances) >= 2
        text, chunks = chat_stream(srv.url.removesuffix("/v1"), CHATS[0])
        assert text == chats[CHATS[0]] and chunks > 1
        assert srv.stop(signal.SIGTERM) == 0
        psutil.wait_procs(instances, timeout=15)
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in instances)
    finally:
        if srv is not None:
            srv.close()


def test_pd_flag_is_checked_before_anything_loads():
    for value, says in [("2", "P:D"), ("0:1", "at least 1"), ("a:b", "P:D")]:
        r = subprocess.run([sys.executable, "-m", "minillm", "serve", "--pd", value], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "minillm", "serve", "--pd", "1:1", "--replicas", "2"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "without Ray" in r.stderr and "Traceback" not in r.stderr, r.stderr
