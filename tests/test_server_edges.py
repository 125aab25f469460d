"""The server's edges, on a tiny model: an API key guards routes by the route that answers (`/health/` stays
open, `/v1/models/` does not) and takes the `Bearer` scheme in any case; the key may come from
$MINILLM_API_KEY; usage in a stream only with `include_usage`; /tokenize takes `add_special_tokens` beside
messages; a client that hangs up leaves no traceback and no work behind; and `X-Forwarded-For` names a
client (its rate-limit bucket) only when it comes from a proxy the operator named."""

import gc
import logging

import httpx
import pytest

from minillm.__main__ import build_parser, main
from minillm.serving import AsyncLLM, ServerThread, build_app
from minillm.service.gateway import RateLimit
from minillm.serving.launch import API_KEY_ENV, app_options, uvicorn_config
from serving_utils import Records, scrape, serve_engine, slow_steps, start_server, stream_json, tiny_engine, wait_idle

KEY = "sk-edges"
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def guarded(tiny_llama):
    with start_server(tiny_llama, app_kw={"api_key": KEY}, num_kv_blocks=64, block_size=4) as srv:
        yield srv


@pytest.fixture(scope="module")
def server(tiny_llama):
    with start_server(tiny_llama, num_kv_blocks=64, block_size=4) as srv:
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
        wait_idle(c)


# --- 1. the API key: by route, any case of `Bearer` --------------------------------------------------------------

@pytest.mark.parametrize("path", ["/health/", "/metrics/", "/version/"])
def test_open_routes_stay_open_with_a_trailing_slash(guarded, path):
    r = httpx.get(guarded.url + path, follow_redirects=True, timeout=30)
    assert r.status_code == 200 and r.history and r.history[0].status_code == 307, r.text


@pytest.mark.parametrize("method,path", [("GET", "/v1/models/"), ("GET", "/v1/models//"), ("GET", "/tokenizer_info/"),
                                         ("POST", "/v1/completions/"), ("POST", "/tokenize/"), ("GET", "/v1/health"),
                                         ("GET", "/health/x")])
def test_a_trailing_slash_never_unguards_a_route(guarded, method, path):
    r = httpx.request(method, guarded.url + path, json={}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_bearer_scheme_is_case_insensitive(guarded, scheme):
    r = httpx.get(guarded.url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"}, timeout=30)
    assert r.status_code == 200


@pytest.mark.parametrize("auth", [f"Basic {KEY}", f"Bearer  {KEY}", f"Bearer{KEY}", "Bearer"])
def test_another_scheme_or_spelling_is_refused(guarded, auth):
    r = httpx.get(guarded.url + "/v1/models", headers={"Authorization": auth}, timeout=30)
    assert r.status_code == 401


def test_a_keyed_rate_limit_counts_the_key_not_its_spelling(tiny_llama):
    app_kw = {"api_key": KEY, "rate_limit": RateLimit(0.1, burst=1)}
    with start_server(tiny_llama, app_kw=app_kw, num_kv_blocks=16) as srv:
        codes = [httpx.get(srv.url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"}).status_code
                 for scheme in ("Bearer", "bearer")]
        assert codes == [200, 429]
        health = [httpx.get(srv.url + "/health/", follow_redirects=True).status_code for _ in range(3)]
        assert health == [200] * 3  # an open route, however spelled, takes no token


# --- 2. the key from the environment ------------------------------------------------------------------------------

def test_the_api_key_comes_from_the_environment_unless_a_flag_gives_one(monkeypatch, capsys):
    parse = build_parser().parse_args
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert app_options(parse(["serve"]))["api_key"] is None
    monkeypatch.setenv(API_KEY_ENV, "k-env")
    assert app_options(parse(["serve"]))["api_key"] == "k-env"
    assert app_options(parse(["serve", "--api-key", "k-flag"]))["api_key"] == "k-flag"
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0 and f"prefer ${API_KEY_ENV}" in text and "process list" in text


# --- 3. usage in a stream only with include_usage ---------------------------------------------------------------

@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": [PROMPT, PROMPT]}),
                                       ("/v1/chat/completions", {"messages": MESSAGES, "n": 2})])
def test_continuous_usage_needs_include_usage(client, path, body):
    opts = {"continuous_usage_stats": True, "include_usage": False}
    chunks = stream_json(client, path, {**body, "max_tokens": 4, "ignore_eos": True, "stream": True,
                                        "stream_options": opts})
    assert chunks and all(c.get("usage") is None for c in chunks)
    assert all(c["choices"] for c in chunks)  # and no usage chunk at the end
    both = stream_json(client, path, {**body, "max_tokens": 4, "ignore_eos": True, "stream": True,
                                      "stream_options": {**opts, "include_usage": True}})
    assert all(c["usage"]["completion_tokens"] >= 0 for c in both) and both[-1]["usage"]["completion_tokens"] == 8


# --- 4. /tokenize: add_special_tokens beside messages ------------------------------------------------------------

def test_tokenize_takes_add_special_tokens_with_messages(client):
    r = client.post("/tokenize", json={"messages": MESSAGES, "add_special_tokens": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0
    plain = client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    specials = client.post("/tokenize", json={"prompt": ""}).json()["tokens"]  # what the tokenizer adds to any text
    assert body["tokens"] == specials + plain


# --- 5. a client that hangs up -------------------------------------------------------------------------------------

def test_a_client_that_hangs_up_leaves_no_traceback_and_no_work(tiny_llama):
    engine = tiny_engine(tiny_llama, num_kv_blocks=64, block_size=4)
    slow_steps(engine, 0.05)
    records = Records()
    loggers = [logging.getLogger(name) for name in ("asyncio", "uvicorn.error", "minillm")]
    with serve_engine(engine) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        for logger in loggers:  # after uvicorn configured its loggers
            logger.addHandler(records)
        try:
            for path, body in (("/v1/completions", {"prompt": [PROMPT, PROMPT]}),
                               ("/v1/chat/completions", {"messages": MESSAGES})):
                with pytest.raises(httpx.TimeoutException):
                    httpx.post(srv.url + path, json={**body, "max_tokens": 150, "ignore_eos": True}, timeout=1.0)
                wait_idle(c)  # the requests were aborted in the engine: nothing runs, no KV block is held
            assert scrape(c)['request_success_total{finished_reason="abort"}'] == 3
            gc.collect()  # an unread future's complaint is logged when it is collected
        finally:
            for logger in loggers:
                logger.removeHandler(records)
    assert not any("never retrieved" in r.getMessage() or r.exc_info for r in records.records), \
        [r.getMessage() for r in records.records]


# --- 6. X-Forwarded-For only from a named proxy --------------------------------------------------------------------

def forwarded_statuses(srv: ServerThread) -> list[int]:
    """Two requests from 127.0.0.1, each claiming another client in X-Forwarded-For."""
    return [httpx.get(srv.url + "/v1/models", headers={"X-Forwarded-For": f"10.0.0.{i}"}, timeout=30).status_code
            for i in (1, 2)]


def test_a_forwarded_address_counts_only_from_a_named_proxy(tiny_llama):
    def app():
        engine = tiny_engine(tiny_llama, num_kv_blocks=16)
        return build_app(AsyncLLM(engine), "test-model", rate_limit=RateLimit(0.1, burst=1))

    with ServerThread(app()) as srv:  # the default: no proxy is believed, the client is its socket's address
        assert forwarded_statuses(srv) == [200, 429]
    with ServerThread(app(), forwarded_allow_ips="127.0.0.1") as srv:  # behind a proxy the operator named
        assert forwarded_statuses(srv) == [200, 200]


def test_serve_believes_forwarded_headers_only_when_told():
    assert build_parser().parse_args(["serve"]).forwarded_allow_ips is None
    default = uvicorn_config(None, None, log_level="warning")
    assert default.proxy_headers is False
    named = uvicorn_config(None, "10.0.0.0/8,192.168.1.7", log_level="warning")
    assert named.proxy_headers is True and named.forwarded_allow_ips == "10.0.0.0/8,192.168.1.7"
