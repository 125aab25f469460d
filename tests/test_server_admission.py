"""Admission on a tiny model: tokenizing never stalls the event loop, each per-request limit is a 400 naming
its flag, a request that could never be admitted is a 400 (not an endless 429), and a 429 is counted as a
rejection, not as an aborted request."""

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from minillm.serving import ServerLimits
from serving_utils import SlowTokenizer, scrape, serve_engine, slow_steps, start_server, tiny_engine, wait_idle

PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": "a slow prompt", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a slow question"}], "max_tokens": 2}),
])
def test_tokenizing_runs_off_the_event_loop(tiny_llama, route, body):
    engine = tiny_engine(tiny_llama, num_kv_blocks=64, block_size=4)
    slow = engine.tokenizer = SlowTokenizer(engine.tokenizer)
    with serve_engine(engine) as srv, httpx.Client(base_url=srv.url, timeout=8) as c, ThreadPoolExecutor(1) as pool:
        stuck = pool.submit(c.post, route, json=body)
        assert slow.entered.wait(10)
        try:  # while the slow prompt is being tokenized, the server answers others
            assert c.get("/health").status_code == 200
            small = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert small.status_code == 200 and not stuck.done()
        finally:
            slow.release.set()
        assert stuck.result().status_code == 200


LIMITS = ServerLimits(max_prompts_per_request=8, max_prompt_chars=60, max_prompt_tokens=20, max_n=3, max_logprobs=2,
                      max_stops=2, max_stop_chars=4, max_completion_tokens=8, max_messages=2)


@pytest.fixture(scope="module")
def limited(tiny_llama):
    srv = start_server(tiny_llama, max_waiting_requests=6, app_kw={"limits": LIMITS}, num_kv_blocks=64, block_size=4)
    yield srv
    srv.stop()


@pytest.mark.parametrize("route,body,param,flag", [
    ("/v1/completions", {"prompt": ["a"] * 9}, "prompt", "--max-prompts-per-request"),
    ("/v1/completions", {"prompt": "x" * 61}, "prompt", "--max-prompt-chars"),
    ("/v1/completions", {"prompt": "The quick brown fox jumps over the lazy dog. Prefill"}, "prompt",
     "--max-prompt-tokens"),
    ("/v1/completions", {"prompt": [5] * 21}, "prompt", "--max-prompt-tokens"),
    ("/v1/completions", {"prompt": PROMPT, "n": 4}, "n", "--max-n"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 3}, "logprobs", "--max-logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 3}, "prompt_logprobs", "--max-logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "stop": ["a", "b", "c"]}, "stop", "--max-stops"),
    ("/v1/completions", {"prompt": PROMPT, "stop": "abcde"}, "stop", "--max-stop-chars"),
    ("/v1/completions", {"prompt": PROMPT, "stop_token_ids": [1, 2, 3]}, "stop_token_ids", "--max-stops"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 9}, "max_tokens", "--max-completion-tokens"),
    ("/v1/completions", {"prompt": ["a"] * 4, "n": 2}, "prompt", "--max-waiting-requests"),
    ("/v1/chat/completions", {"messages": CHAT * 3}, "messages", "--max-messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 61}]}, "messages", "--max-prompt-chars"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 3}, "top_logprobs",
     "--max-logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 9}, "max_completion_tokens",
     "--max-completion-tokens"),
    ("/tokenize", {"prompt": "z" * 61}, "prompt", "--max-prompt-chars"),
])
def test_each_limit_is_a_400_naming_the_field_and_flag(limited, route, body, param, flag):
    with httpx.Client(base_url=limited.url, timeout=30) as c:
        r = c.post(route, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and flag in error["message"] and error["code"] == "limit_exceeded", error


@pytest.mark.parametrize("prompt", [[5] * 30, "The quick brown fox jumps over the lazy dog. Prefill"])
def test_a_prompt_truncated_under_the_token_limit_is_served(limited, prompt):
    """--max-prompt-tokens counts the tokens truncate_prompt_tokens keeps, for token ids as for text."""
    with httpx.Client(base_url=limited.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 10})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 10, r.text
        wait_idle(c)


def test_requests_within_the_limits_are_served(limited):
    with httpx.Client(base_url=limited.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 8, "logprobs": 2,
                                            "stop": ["ab", "cd"]})
        assert r.status_code == 200 and len(r.json()["choices"]) == 6
        chat = c.post("/v1/chat/completions", json={"messages": CHAT})  # max_tokens: up to the limit
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] <= 8
        wait_idle(c)


def test_a_batch_larger_than_the_waiting_queue_is_a_400_on_an_idle_server(tiny_llama):
    """300 prompts with --max-waiting-requests 256 could never be admitted: a 400 naming the flag (not a 429
    that a client would retry forever)."""
    limits = ServerLimits(max_prompts_per_request=512)
    with start_server(tiny_llama, app_kw={"limits": limits}, num_kv_blocks=64, block_size=4) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": ["a"] * 300, "max_tokens": 1})
        assert r.status_code == 400 and "--max-waiting-requests" in r.json()["error"]["message"], r.text
        whole_queue = c.post("/v1/completions", json={"prompt": ["a"] * 256, "max_tokens": 1})
        assert whole_queue.status_code == 200 and len(whole_queue.json()["choices"]) == 256


def test_a_429_is_a_rejection_and_admits_no_part_of_a_batch(tiny_llama):
    """With one sequence running and one waiting (limit 2), a batch of two prompts is refused whole: a 429,
    counted in request_rejected_total; nothing of it was queued, so no request is counted as aborted."""
    engine = tiny_engine(tiny_llama, max_num_seqs=1, num_kv_blocks=64, block_size=4)
    slow_steps(engine, 0.02)
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with serve_engine(engine, max_waiting_requests=2) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        running = c.send(c.build_request("POST", "/v1/completions", json=body), stream=True)
        events = (line for line in running.iter_lines() if line.startswith("data: "))
        next(events)
        waiting = c.send(c.build_request("POST", "/v1/completions", json=body), stream=True)
        assert scrape(c)["num_requests_waiting"] == 1
        batch = c.post("/v1/completions", json={"prompt": [PROMPT, PROMPT], "max_tokens": 2})
        assert batch.status_code == 429 and batch.headers["retry-after"] == "1"
        tokens = scrape(c)["generation_tokens_total"]
        while scrape(c)["generation_tokens_total"] < tokens + 2:  # two more steps: an abort would be counted by now
            time.sleep(0.01)
        m = scrape(c)
        assert m['request_rejected_total{reason="overloaded"}'] == 1
        assert m.get('request_success_total{finished_reason="abort"}', 0) == 0
        assert m["num_requests_waiting"] == 1
        running.close()
        waiting.close()
        wait_idle(c)
