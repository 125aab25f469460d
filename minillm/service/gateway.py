"""Chapter 9 — the gateway's rate limit: each client may send `requests_per_second`, in bursts of `burst`.

A shared service must stop one client from taking every replica. The gateway gives each client a token
bucket (the algorithm behind most API rate limits): it holds at most `burst` tokens, refills at
`requests_per_second`, and every request takes one; a request that finds it empty gets a 429 with
`Retry-After` (the seconds until a token is back) and an OpenAI error body, before any work is done.
A client is its API key when the server checks one (chapter 8's `--api-key`), else its address: keying by
an unchecked bearer token would let a client escape its limit by inventing new ones, and so would believing
any `X-Forwarded-For` (the server takes it only from the proxies `--forwarded-allow-ips` names).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from starlette.datastructures import Headers

from ..serving.middleware import bearer_token, error_response, is_open
from ..serving.protocol import OpenAIError

MAX_BUCKETS = 10_000  # beyond this, buckets that have refilled (idle clients) are dropped


@dataclass(frozen=True)
class RateLimit:
    """`--rate-limit RPS` and `--rate-limit-burst N`; the burst defaults to one second's worth (at least 1)."""

    requests_per_second: float
    burst: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.requests_per_second, (int, float)) and math.isfinite(self.requests_per_second)
                and self.requests_per_second > 0):
            raise ValueError(f"rate_limit must be a positive number of requests per second, "
                             f"got {self.requests_per_second!r}")
        if self.burst is not None and (not isinstance(self.burst, int) or isinstance(self.burst, bool)
                                       or self.burst < 1):
            raise ValueError(f"rate_limit_burst must be an integer >= 1, got {self.burst!r}")

    @property
    def capacity(self) -> int:
        return self.burst if self.burst is not None else max(1, math.ceil(self.requests_per_second))


class TokenBucket:
    """`capacity` tokens, refilled at `rate` per second; `take` spends one or says how long until one is back."""

    def __init__(self, capacity: int, rate: float, now: float):
        self.capacity, self.rate = capacity, rate
        self.tokens, self.updated = float(capacity), now

    def refill(self, now: float) -> None:
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
        self.updated = now

    def take(self, now: float) -> float:
        """0 if a token was taken, else the seconds until one will be there."""
        self.refill(now)
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


class RateLimiter:
    """ASGI middleware: one `TokenBucket` per client; /health, /metrics and /version are not limited."""

    def __init__(self, app, limit: RateLimit, by_api_key: bool):
        self.app, self.limit, self.by_api_key = app, limit, by_api_key
        self.buckets: dict[str, TokenBucket] = {}

    def client(self, scope) -> str:
        """The bucket's key: the API key (already checked by `ApiKeyAuth`), else the client's address."""
        if self.by_api_key:  # the token, not the header: `bearer K` and `Bearer K` are one client
            return "key " + (bearer_token(Headers(scope=scope)) or "")
        host = scope.get("client")
        return "address " + (host[0] if host else "unknown")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or is_open(scope):
            return await self.app(scope, receive, send)
        now, key = time.monotonic(), self.client(scope)
        bucket = self.buckets.get(key)
        if bucket is None:
            if len(self.buckets) >= MAX_BUCKETS:
                self.forget_idle(now)
            bucket = self.buckets[key] = TokenBucket(self.limit.capacity, self.limit.requests_per_second, now)
        wait = bucket.take(now)
        if wait > 0:
            error = OpenAIError(f"rate limit exceeded: {self.limit.requests_per_second:g} requests per second "
                                f"in bursts of {self.limit.capacity}; retry in {wait:.2f} s", status=429,
                                type="rate_limit_error", code="rate_limit_exceeded",
                                headers={"Retry-After": str(math.ceil(wait))})
            return await error_response(error)(scope, receive, send)
        await self.app(scope, receive, send)

    def forget_idle(self, now: float) -> None:
        """Drop the buckets that are full again: their clients have been quiet for a whole burst."""
        for key, bucket in list(self.buckets.items()):
            bucket.refill(now)
            if bucket.tokens >= bucket.capacity:
                del self.buckets[key]
