"""Chapter 9's gateway without Ray, on a tiny model: the token bucket's arithmetic, the rate limit on chapter 8's
server (a 429 with Retry-After and an OpenAI body, keyed by client address, health checks never limited; keys as
clients in test_server_gateway.py), and the `serve` flags that are refused before any model loads."""

import httpx
import pytest

from minillm.__main__ import main
from minillm.service.gateway import RateLimit, TokenBucket
from serving_utils import client, start_server

def test_the_bucket_holds_a_burst_and_refills_at_the_rate():
    bucket = TokenBucket(capacity=3, rate=2.0, now=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(0.0) == pytest.approx(0.5)  # one token comes back every half second
    assert bucket.take(0.25) == pytest.approx(0.25) and bucket.take(0.5) == 0.0
    assert [bucket.take(100.0) for _ in range(4)] == [0.0, 0.0, 0.0, 0.5]  # never more than the burst


@pytest.mark.parametrize("rps,burst", [(0, None), (-1, None), (float("inf"), None), (1, 0), (1, 1.5)])
def test_bad_limits_are_refused(rps, burst):
    with pytest.raises(ValueError):
        RateLimit(rps, burst)


def statuses(c: httpx.Client, n: int) -> list[int]:
    return [c.post("/tokenize", json={"prompt": "hi"}).status_code for _ in range(n)]


def test_each_address_gets_a_bucket_and_a_429_says_when_to_retry(tiny_llama):
    with start_server(tiny_llama, app_kw={"rate_limit": RateLimit(0.5, burst=3)}, num_kv_blocks=16) as srv:
        with client(srv.url, "127.0.0.1") as one, client(srv.url, "127.0.0.2") as two:
            assert statuses(one, 4) == [200, 200, 200, 429]
            refused = one.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            assert refused.status_code == 429 and refused.headers["retry-after"] == "2"
            error = refused.json()["error"]
            assert (error["type"], error["code"], error["param"]) == ("rate_limit_error", "rate_limit_exceeded", None)
            assert "x-request-id" in refused.headers
            assert [one.get(path).status_code for path in ("/health", "/metrics", "/version")] == [200] * 3
            assert statuses(two, 4) == [200, 200, 200, 429]  # another client, its own bucket


@pytest.mark.parametrize("flags,message", [
    (["--rate-limit-burst", "5"], "--rate-limit-burst needs --rate-limit"),
    (["--rate-limit", "0"], "rate_limit must be a positive number"),
    (["--router", "prefix"], "--router chooses among replicas"),
    (["--min-replicas", "2"], "autoscaling needs --max-replicas"),
    (["--replicas", "0"], "--replicas must be at least 1"),
    (["--min-replicas", "0", "--max-replicas", "2"], "scale to zero) needs num_kv_blocks"),
])
def test_serve_refuses_bad_gateway_and_replica_flags_before_loading(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "/nonexistent", *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err
