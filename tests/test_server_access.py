"""Who may call the server, on a tiny model: with an API key every route but /health, /metrics and /version
needs `Authorization: Bearer <key>` (a 401 with an OpenAI body otherwise, which the `openai` client raises as
AuthenticationError); CORS only for the origins allowed; the default bind is loopback."""

import httpx
import openai
import pytest

from minillm.__main__ import build_parser
from minillm.service.gateway import RateLimit
from serving_utils import start_server

KEY = "sk-test-123"
ORIGIN = "http://notebook.example"


@pytest.fixture(scope="module")
def server(tiny_llama):
    app_kw = {"api_key": KEY, "allowed_origins": [ORIGIN],
              "auth_failure_limit": RateLimit(100, burst=100)}  # every wrong key below comes from one address
    srv = start_server(tiny_llama, app_kw=app_kw, num_kv_blocks=64, block_size=4)
    yield srv
    srv.stop()


def test_the_openai_client_needs_the_key(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as good:
        done = good.completions.create(model="test-model", prompt="The quick", max_tokens=2)
        assert done.usage.completion_tokens == 2


@pytest.mark.parametrize("method,path", [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                         ("GET", "/v1/models"), ("GET", "/v1/models/test-model"),
                                         ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info"),
                                         ("GET", "/v1/nothing")])
@pytest.mark.parametrize("auth", [None, "Bearer wrong", KEY, f"Bearer {KEY}x"])
def test_guarded_routes_refuse_a_missing_or_wrong_key(server, method, path, auth):
    headers = {} if auth is None else {"Authorization": auth}
    r = httpx.request(method, server.url + path, headers=headers, json={}, timeout=30)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"} and "x-request-id" in r.headers


def test_health_metrics_and_version_stay_open(server):
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.url + path, timeout=30).status_code == 200, path
    ok = httpx.post(server.url + "/tokenize", json={"prompt": "hi"}, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200


def test_cors_for_allowed_origins_only(server, tiny_llama):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(server.url + "/v1/chat/completions", headers=preflight)  # no key: a preflight carries none
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(server.url + "/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    r = httpx.get(server.url + "/health", headers={"Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN and "x-request-id" in r.headers[
        "access-control-expose-headers"].lower()
    with start_server(tiny_llama, num_kv_blocks=64, block_size=4) as default:  # no origins given: no CORS at all
        r = httpx.options(default.url + "/v1/chat/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers
        plain = httpx.get(default.url + "/health", headers={"Origin": ORIGIN})
        assert "access-control-allow-origin" not in plain.headers
        assert httpx.get(default.url + "/v1/models").status_code == 200  # and no key either


def test_serve_flags_default_to_loopback_and_no_key():
    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.api_key is None and args.allowed_origins is None
    assert args.max_prompts_per_request == 64 and args.max_n == 16
