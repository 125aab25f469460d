"""Hostile requests: random bodies, values and headers on every route. The server answers each with a 200
or a 4xx carrying an OpenAI error body, never a 5xx, and afterwards serves a valid request correctly with
no KV block held."""

import json
import string

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from minillm import LLM, SamplingParams
from serving_utils import sse_events, start_server, wait_idle

ROUTES = {"/v1/completions": {"prompt": "The quick", "max_tokens": 4},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
          "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [40, 41]}, "/v1/models": None, "/health": None,
          "/metrics": None, "/tokenizer_info": None, "/v1/nope": None, "/": None}

scalars = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.integers(-3, 40)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
           | st.sampled_from(["test-model", "The quick", "", "\x00", "é" * 3, "<|im_end|>"]))
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)
content = st.text(max_size=20) | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                                 "text": st.text(max_size=8)}), max_size=2)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"]),
                                 "content": content | junk})
# values that are often right, sometimes out of range, sometimes of the wrong type altogether
FIELDS = {
    "model": st.sampled_from(["test-model", "other", ""]), "prompt": st.text(max_size=30)
    | st.lists(st.integers(-1, 400), max_size=8) | st.lists(st.text(max_size=5), max_size=3),
    "messages": st.lists(message, max_size=3), "max_tokens": st.integers(-1, 12) | st.integers(200, 10 ** 9),
    "max_completion_tokens": st.integers(-1, 12), "temperature": st.floats(-1, 3) | st.floats(allow_nan=True),
    "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-3, 400), "n": st.integers(-1, 4) | st.integers(100, 200),
    "seed": st.integers(-2 ** 65, 2 ** 65), "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries(
        {"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}),
    "logprobs": st.integers(-1, 25) | st.booleans(), "top_logprobs": st.integers(-1, 25), "echo": st.booleans(),
    "ignore_eos": st.booleans(), "tokens": st.lists(st.integers(-1, 10 ** 6), max_size=6),
    "presence_penalty": st.floats(-1, 1), "logit_bias": st.dictionaries(st.text(max_size=3), st.integers()),
    "suffix": st.text(max_size=3), "best_of": st.integers(0, 3), "add_generation_prompt": st.booleans(),
    "unknown_field": junk}
overrides = st.dictionaries(st.sampled_from(sorted(FIELDS)), st.none(), max_size=3).flatmap(
    lambda keys: st.fixed_dictionaries({k: FIELDS[k] | junk if k == "unknown_field" else FIELDS[k] for k in keys}))
drop = st.lists(st.sampled_from(["prompt", "messages", "tokens", "max_tokens"]), max_size=1)
content_types = st.sampled_from([None] * 3 + ["application/json"] * 6 + ["text/plain",
                                 "application/json; charset=latin-1", "multipart/form-data; boundary=x",
                                 "application/x-www-form-urlencoded", "application/vnd.api+json"])
header_text = st.text(string.ascii_letters + string.digits + "-_ .;=/", max_size=20).map(str.strip)


@st.composite
def requests(draw):
    """(method, route, body bytes, headers): mostly a valid request with a few fields changed."""
    route = draw(st.sampled_from(sorted(ROUTES) + ["/v1/completions", "/v1/chat/completions"] * 3))
    base = ROUTES[route]
    method = draw(st.sampled_from(["POST"] * 6 + ["GET", "PUT"]) if base is not None else
                  st.sampled_from(["GET"] * 6 + ["POST", "DELETE"]))
    kind = draw(st.sampled_from(["mutated"] * 8 + ["junk", "bytes"]))
    if kind == "bytes":
        content = draw(st.binary(max_size=40))
    else:
        body = draw(junk) if kind == "junk" else {k: v for k, v in (base or {}).items() if k not in draw(drop)}
        if isinstance(body, dict) and kind == "mutated":
            body.update(draw(overrides))
        content = json.dumps(body).encode()  # json writes NaN and Infinity as the bare words
    ctype = draw(content_types)
    headers = {**draw(st.dictionaries(st.sampled_from(["x-api-key", "authorization", "accept", "x-request-id"]),
                                      header_text, max_size=2)), **({"content-type": ctype} if ctype else {})}
    return method, route, content, headers


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = start_server(tiny_llama, "test-model", num_kv_blocks=128, block_size=4, max_num_seqs=8)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def check(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=requests())
def test_random_requests_never_get_a_5xx(http, request):
    method, route, content, headers = request
    with http.stream(method, route, content=content, headers=headers) as r:
        event(f"{route} {r.status_code}")
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            assert r.status_code == 200 and sse_events(r)[-1] == "[DONE]"
        else:
            r.read()
            check(r)


def test_after_the_fuzz_a_valid_request_is_still_right(server, http, tiny_llama):
    wait_idle(http)
    want = LLM(tiny_llama, device="cpu", num_kv_blocks=64, block_size=4).generate(
        "The quick brown fox", SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    r = http.post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 10, "temperature": 0,
                                           "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
