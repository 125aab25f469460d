"""The HTTP server on a tiny model: OpenAI request and response shapes, SSE framing, errors as 4xx with an
OpenAI body, overload, disconnects, and the vLLM extras (/tokenize, /detokenize, /tokenizer_info)."""

import json
import socket

import httpx
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from minillm import LLM, SamplingParams
from serving_utils import start_server, stream_json, wait_idle

MODEL = "test-model"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = start_server(tiny_llama, MODEL, app_kw={"enable_tokenizer_info_endpoint": True}, num_kv_blocks=256,
                       block_size=4)
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
        wait_idle(c)  # whatever a test sent, the engine ends idle with every KV block free


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(tiny_llama, device="cpu", num_kv_blocks=256, block_size=4)


def greedy_tokens(offline, prompt, n):
    return offline.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True), use_tqdm=False)[0].outputs[0]


def test_non_streaming_completion_matches_offline_and_validates(client, offline):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200
    resp = Completion.model_validate(r.json())
    want = greedy_tokens(offline, PROMPT, 12)
    assert resp.choices[0].text == want.text and resp.choices[0].finish_reason == "length"
    prompt_len = len(offline.get_tokenizer()(PROMPT).input_ids)
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (prompt_len, 12)


def test_streamed_chunks_are_openai_chunks_and_add_up(client, offline):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = stream_json(client, "/v1/completions", body)
    for c in chunks:  # the SDK's type has no null finish_reason, which OpenAI's own streams send mid-stream
        Completion.model_validate({**c, "choices": [{**ch, "finish_reason": ch["finish_reason"] or "length"}
                                                    for ch in c["choices"]]})
    *content, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12
    assert "".join(c["choices"][0]["text"] for c in content) == greedy_tokens(offline, PROMPT, 12).text
    counts = [c["usage"]["completion_tokens"] for c in content]
    assert counts == sorted(counts) and content[-1]["choices"][0]["finish_reason"] == "length"


def test_raw_wire_format(client):
    with client.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "stream": True}) as r:
        raw = r.read().decode()
    events = raw.strip("\n").split("\n\n")
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_chat_streaming_and_not(client, offline):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    full = ChatCompletion.model_validate(client.post("/v1/chat/completions", json=body).json())
    chunks = [ChatCompletionChunk.model_validate(c)
              for c in stream_json(client, "/v1/chat/completions", {**body, "stream": True})]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    ids = offline.engine.apply_chat_template([{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Say\nhi"}])
    want = offline.generate(ids, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert full.choices[0].message.content == want.text and full.usage.prompt_tokens == len(ids)


def test_n_with_seed_reproduces_and_batch_prompts(client):
    body = {"prompt": PROMPT, "max_tokens": 8, "n": 3, "seed": 5, "temperature": 1.0, "ignore_eos": True}
    a, b = (client.post("/v1/completions", json=body).json() for _ in range(2))
    assert [c["index"] for c in a["choices"]] == [0, 1, 2] and a["choices"] == b["choices"]
    assert len({c["text"] for c in a["choices"]}) > 1
    batch = client.post("/v1/completions", json={"prompt": [[40, 41, 42], [5, 6, 7]], "n": 2, "max_tokens": 3,
                                                 "temperature": 0}).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3] and batch["usage"]["completion_tokens"] == 12
    chunks = stream_json(client, "/v1/completions", {**body, "stream": True})
    texts = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in range(3)}
    assert [texts[i] for i in range(3)] == [c["text"] for c in a["choices"]]


def test_logprobs_and_echo(client, offline):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True, "ignore_eos": True}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    prompt_len = len(offline.get_tokenizer()(PROMPT).input_ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == prompt_len + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert choice["text"].startswith(PROMPT) and "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    assert all(max(top.values()) == lp["token_logprobs"][prompt_len + i]
               for i, top in enumerate(lp["top_logprobs"][prompt_len:]))  # greedy: the chosen token is the top one
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                     "temperature": 0, "logprobs": True, "top_logprobs": 3}).json()
    ChatCompletion.model_validate(chat)
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"] and all(len(t["top_logprobs"]) == 3 for t in content)
    assert all(t["top_logprobs"][0]["logprob"] == t["logprob"] for t in content)


def test_stop_strings_in_a_stream_are_held_back_and_removed(client, offline):
    free = greedy_tokens(offline, PROMPT, 20).text
    stop = free[5:8]
    chunks = stream_json(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 20, "temperature": 0,
                                                     "stop": [stop], "stream": True, "ignore_eos": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == free[:free.find(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["choices"][0]["stop_reason"] == stop


BAD = [
    ({"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, 400, "top_p"),
    ({"prompt": PROMPT, "n": 0}, 400, "n"),
    ({"prompt": PROMPT, "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": PROMPT, "seed": 2 ** 64}, 400, "seed"),
    ({"prompt": PROMPT, "logprobs": 21}, 400, "logprobs"),
    ({"prompt": PROMPT, "max_tokens": 10 ** 6}, 400, "max_tokens"),
    ({"prompt": [1] * 300}, 400, "prompt"),
    ({"prompt": [10 ** 6]}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": PROMPT, "model": "gpt-4"}, 404, "model"),
    ({"prompt": PROMPT, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"prompt": PROMPT, "suffix": "x"}, 400, "suffix"),
    ({"prompt": PROMPT, "stream_options": {"include_usage": "yes"}}, 400, "stream_options.include_usage"),
    ({"max_tokens": 3}, 400, "prompt"),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_bad_completion_requests_name_the_problem(client, body, status, param):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param and error["message"]


@pytest.mark.parametrize("body,param", [
    ({}, "messages"), ({"messages": []}, "messages"), ({"messages": [{"content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools.0.function"),
    ({"messages": [{"role": "user", "content": "hi " * 300}]}, "messages"),
])
def test_bad_chat_requests_name_the_problem(client, body, param):
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("content,headers", [
    (b'{"prompt": "hi", ', {"content-type": "application/json"}),
    (b'["prompt"]', {"content-type": "application/json"}),
    (b'prompt=hi', {"content-type": "application/x-www-form-urlencoded"}),
    (b'{"prompt": "hi", "temperature": NaN}', {"content-type": "application/json"}),
    (b'\xff\xfe', {"content-type": "application/json"}),
    (b"", {}),
])
def test_malformed_bodies_are_400(client, content, headers):
    r = client.post("/v1/completions", content=content, headers=headers)
    assert r.status_code == 400 and "error" in r.json(), r.text


def test_http_errors_have_openai_bodies(server, client):
    for r, status in [(client.get("/v1/nothing"), 404), (client.get("/v1/completions"), 405),
                      (client.post("/v1/completions", content=b"x" * (5 << 20)), 413)]:
        assert r.status_code == status and r.json()["error"]["message"], (status, r.text)
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:  # a body that claims to be huge
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 99999999999\r\n\r\n{}")
        reply = b""
        while b'"error"' not in reply and (data := sock.recv(4096)):
            reply += data
    assert reply.startswith(b"HTTP/1.1 413") and b'"error"' in reply


def test_unknown_fields_are_tolerated(client):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "some_future_field": {"a": 1},
                                             "stop_token_ids": [1]})
    assert r.status_code == 200


def test_models_health_tokenizer_endpoints(client, offline):
    assert client.get("/health").status_code == 200
    assert client.get("/v1/models").json()["data"][0]["id"] == MODEL
    tok = offline.get_tokenizer()
    ids = client.post("/tokenize", json={"prompt": PROMPT}).json()
    assert ids["tokens"] == tok(PROMPT).input_ids and ids["count"] == len(ids["tokens"])
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == offline.apply_chat_template([{"role": "user", "content": "hi"}])
    assert client.post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"] == tok.decode(ids["tokens"])
    assert client.post("/detokenize", json={"tokens": [10 ** 7]}).status_code == 400
    assert client.post("/tokenize", json={}).status_code == 400
    assert client.get("/tokenizer_info").json()["vocab_size"] == len(tok)


def test_overload_is_429_with_retry_after(tiny_llama):
    with start_server(tiny_llama, MODEL, max_waiting_requests=1, max_num_seqs=1, num_kv_blocks=64,
                      block_size=4) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
        streams = [c.stream("POST", "/v1/completions", json=body) for _ in range(4)]
        first = streams[0].__enter__()
        next(first.iter_lines())  # running: the batch (max_num_seqs=1) is full
        rest = [s.__enter__() for s in streams[1:]]  # one may wait; the queue then holds its limit
        statuses = [r.status_code for r in [first, *rest]]
        for r in rest:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1" and json.loads(r.read())["error"]["type"] == "rate_limit_error"
        for s in streams:
            s.__exit__(None, None, None)
        assert statuses[:2] == [200, 200] and 429 in statuses, statuses
        wait_idle(c)
        assert c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200
