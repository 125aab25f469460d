"""The gateway cannot be dodged, and the server is not a web page's proxy, on a tiny model: rate-limit buckets per
client (its address, or its key when the server holds several), a bounded map of them, failed keys throttled per
address, the Host header checked against DNS rebinding, /tokenizer_info off unless enabled, and bounded
connections (a 503 beyond `limit_concurrency`, idle keep-alives closed, a header cap, a 408 for a trickled body)."""

import socket
import time

import httpx
import pytest

from minillm.__main__ import build_parser, main
from minillm.serving import AsyncLLM, ServerThread, build_app
from minillm.service.gateway import AUTH_FAILURE_LIMIT, Buckets, RateLimit, RateLimiter
from minillm.serving.launch import API_KEY_ENV, app_options, connection_options
from minillm.serving.middleware import bind_hosts
from serving_utils import client, serve_engine, slow_steps, start_server, stream_json, tiny_engine, wait_for

KEY = "sk-gateway"


def statuses(c: httpx.Client, n: int) -> list[int]:
    return [c.get("/v1/models").status_code for _ in range(n)]


def middleware(srv: ServerThread, kind: type):
    """The app's middleware of this kind, once the server has built its stack."""
    layer = srv.server.config.app.middleware_stack
    while not isinstance(layer, kind):
        layer = layer.app
    return layer


# --- 1. a bucket per client: its address, or its key among several -------------------------------------------

def test_with_one_key_each_address_has_its_own_bucket(tiny_llama):
    app_kw = {"api_key": KEY, "rate_limit": RateLimit(0.1, burst=1)}
    with start_server(tiny_llama, app_kw=app_kw, num_kv_blocks=16) as srv:
        with client(srv.url, "127.0.0.1", KEY) as one, client(srv.url, "127.0.0.2", KEY) as two:
            assert statuses(one, 2) + statuses(two, 1) == [200, 429, 200]  # one client spends only its own


def test_with_several_keys_each_key_is_a_client(tiny_llama):
    app_kw = {"api_key": "k-one, k-two", "rate_limit": RateLimit(0.1, burst=1)}
    with start_server(tiny_llama, app_kw=app_kw, num_kv_blocks=16) as srv:
        with client(srv.url, "127.0.0.1", "k-one") as one, client(srv.url, "127.0.0.1", "k-two") as two:
            assert statuses(one, 2) + statuses(two, 1) == [200, 429, 200]  # one address, two clients
        with client(srv.url, "127.0.0.2", "k-one") as moved:
            assert statuses(moved, 1) == [429]  # the key, not the address
        with client(srv.url, "127.0.0.3", "k-three") as stranger:
            assert statuses(stranger, 2) == [401, 401]  # no bucket for a wrong key
        clients = sorted(middleware(srv, RateLimiter).buckets.map.buckets)
        assert clients == ["key 0", "key 1"] and not any("k-" in c for c in clients)  # the keys are kept nowhere


def test_several_keys_from_the_flag_or_the_environment(monkeypatch):
    parse = build_parser().parse_args
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert app_options(parse(["serve", "--api-key", "a", "--api-key", "b"]))["api_key"] == "a,b"
    monkeypatch.setenv(API_KEY_ENV, "a, b")
    assert app_options(parse(["serve"]))["api_key"] == "a, b"
    monkeypatch.setenv(API_KEY_ENV, " , ")
    with pytest.raises(ValueError, match="holds no key"):
        app_options(parse(["serve"]))


# --- 2. a bounded map of buckets ------------------------------------------------------------------------------

def test_many_clients_do_not_grow_the_buckets_past_the_bound():
    buckets = Buckets(RateLimit(1, burst=2), max_clients=100)
    for i in range(1000):
        assert buckets.take(f"address 10.0.{i // 256}.{i % 256}", now=0.0) == 0.0
        assert len(buckets) <= 100
    assert [buckets.take("address 10.0.0.1", now=0.0) for _ in range(3)] == [0.0, 0.0, 1.0]  # kept and spent
    buckets.take("address 10.9.9.9", now=10.0)  # every bucket has refilled: the quiet ones are dropped
    assert len(buckets) == 1


# --- 3. failed keys throttled per address ---------------------------------------------------------------------

def test_failed_keys_are_throttled_per_address_without_a_rate_limit(tiny_llama):
    with start_server(tiny_llama, app_kw={"api_key": KEY}, num_kv_blocks=16) as srv:
        with client(srv.url, "127.0.0.3", "guess") as guesser:
            assert statuses(guesser, AUTH_FAILURE_LIMIT.capacity) == [401] * AUTH_FAILURE_LIMIT.capacity
            refused = guesser.get("/v1/models")
            assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
            right = guesser.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            assert right.status_code == 429  # refused before the key is compared
            assert guesser.get("/health").status_code == 200
        with client(srv.url, "127.0.0.4", KEY) as other:
            assert statuses(other, 1) == [200]  # another address is not held back


# --- 4. the Host header ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_llama):
    with start_server(tiny_llama, app_kw={"body_timeout_s": 1.0}, num_kv_blocks=16) as srv:
        yield srv


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost.evil"])
def test_a_foreign_host_header_is_refused(server, host):
    r = httpx.get(server.url + "/v1/models", headers={"Host": host}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", r.text
    assert "--allowed-hosts" in r.json()["error"]["message"]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost:1234", "LocalHost", "[::1]:8000"])
def test_the_loopback_names_are_answered(server, host):
    assert httpx.get(server.url + "/v1/models", headers={"Host": host}, timeout=30).status_code == 200


def test_allowed_hosts_widen_the_check(tiny_llama):
    with start_server(tiny_llama, app_kw={"allowed_hosts": ["llm.example", "*.corp.example"]},
                      num_kv_blocks=16) as srv:
        codes = [httpx.get(srv.url + "/health", headers={"Host": h}, timeout=30).status_code
                 for h in ("llm.example:443", "a.corp.example", "corp.example", "localhost")]
        assert codes == [200, 200, 400, 400]


def test_the_allowed_hosts_follow_the_bind():
    assert bind_hosts("0.0.0.0") == bind_hosts("::") == ("*",)
    assert bind_hosts("127.0.0.1") == bind_hosts("localhost") == ("127.0.0.1", "localhost", "::1")
    assert bind_hosts("192.168.1.7") == ("192.168.1.7",)
    parse = build_parser().parse_args
    assert app_options(parse(["serve"]))["allowed_hosts"] == ("127.0.0.1", "localhost", "::1")
    assert app_options(parse(["serve", "--host", "0.0.0.0"]))["allowed_hosts"] == ("*",)
    assert app_options(parse(["serve", "--allowed-hosts", "a.example", "b"]))["allowed_hosts"] == ["a.example", "b"]


# --- 5. /tokenizer_info only when enabled ---------------------------------------------------------------------

def test_tokenizer_info_is_off_unless_enabled(server, tiny_llama):
    r = httpx.get(server.url + "/tokenizer_info", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["message"] == "no route /tokenizer_info"
    with start_server(tiny_llama, app_kw={"enable_tokenizer_info_endpoint": True}, num_kv_blocks=16) as srv:
        assert httpx.get(srv.url + "/tokenizer_info", timeout=30).json()["vocab_size"] > 0
    assert build_parser().parse_args(["serve", "--enable-tokenizer-info-endpoint"]).enable_tokenizer_info_endpoint


# --- 6. bounded connections -----------------------------------------------------------------------------------

def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.settimeout(0.2)
    return sock


def read_status(sock: socket.socket, seconds: float, trickle: bytes = b"") -> int | None:
    """The status of the response on `sock` within `seconds` (None: none came), sending a byte of `trickle`
    every 0.2 s meanwhile."""
    data, deadline = b"", time.monotonic() + seconds
    while b"\r\n" not in data and time.monotonic() < deadline:
        if trickle:
            sock.sendall(trickle[:1])
            trickle = trickle[1:]
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            continue
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ")[1]) if b"\r\n" in data else None


def test_a_trickled_body_is_cut_with_a_408(server):
    with connect(server.url) as sock:
        sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 40\r\n\r\n{")
        started = time.monotonic()
        assert read_status(sock, 6, trickle=b'"prompt": "' + b"a" * 40) == 408
        assert time.monotonic() - started < 4
    r = httpx.post(server.url + "/tokenize", json={"prompt": "hi"}, timeout=30)
    assert r.status_code == 200  # the server goes on


def test_a_slow_response_is_no_slow_body(tiny_llama):
    engine = tiny_engine(tiny_llama, num_kv_blocks=16)
    slow_steps(engine, 0.05)  # a stream that runs well past the body's timeout, listening for a hang-up
    with serve_engine(engine, body_timeout_s=0.5) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        chunks = stream_json(c, "/v1/completions", {"prompt": "hi", "max_tokens": 30, "ignore_eos": True,
                                                    "stream": True})
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.fixture(scope="module")
def bounded(tiny_llama):
    app = build_app(AsyncLLM(tiny_engine(tiny_llama, num_kv_blocks=16)), "test-model")
    with ServerThread(app, limit_concurrency=2, timeout_keep_alive=1, max_header_bytes=4096) as srv:
        yield srv


def test_headers_past_the_cap_get_a_400(bounded):
    for pad, end, status in ((1000, b"\r\n\r\n", 200), (8000, b"", 400)):  # headers that never end are cut
        with connect(bounded.url) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * pad + end)
            assert read_status(sock, 5) == status, pad


def test_an_idle_keep_alive_connection_is_closed(bounded):
    with connect(bounded.url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_status(sock, 5) == 200
        sock.settimeout(4)
        started = time.monotonic()
        while sock.recv(4096):  # the rest of the response, then the server's close
            pass
        assert time.monotonic() - started < 3


def test_connections_beyond_the_limit_get_a_503(bounded):
    with connect(bounded.url) as held:
        held.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_status(held, 5) == 200
        assert httpx.get(bounded.url + "/health", timeout=30).status_code == 503
    wait_for(lambda: httpx.get(bounded.url + "/health", timeout=30).status_code == 200, 10, "a free connection")


@pytest.mark.parametrize("flags,message", [
    (["--limit-concurrency", "0"], "--limit-concurrency must be positive"),
    (["--body-timeout", "0"], "--body-timeout must be a positive number"),
    (["--allowed-hosts", "*example.com"], "'*example.com' is not a host name"),
    (["--allowed-hosts", "http://llm.example"], "is not a host name"),
    (["--api-key", ","], "api_key holds no key"),
])
def test_serve_refuses_bad_gateway_flags_before_loading(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "/nonexistent", *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert connection_options(build_parser().parse_args(["serve"]))["limit_concurrency"] > 0
