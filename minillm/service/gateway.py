"""Chapter 9 — the gateway's rate limits: each client may send `requests_per_second`, in bursts of `burst`, and
each address may fail the API key only a few times a minute.

A shared service must stop one client from taking every replica. The gateway gives each client a token
bucket (the algorithm behind most API rate limits): it holds at most `burst` tokens, refills at
`requests_per_second`, and every request takes one; a request that finds it empty gets a 429 with
`Retry-After` (the seconds until a token is back) and an OpenAI error body, before any work is done.
A client is its address, or its API key when the server holds several (one per client, chapter 8's
`--api-key`): keying by an unchecked bearer token would let a client escape its limit by inventing new ones,
and so would believing any `X-Forwarded-For` (the server takes it only from the proxies `--forwarded-allow-ips`
names). A refilled bucket is the same as a new one, so the map keeps only buckets still spending, and at most
`MAX_CLIENTS` of them. Failed keys are counted the same way, per address, so that guessing is slow.

The middlewares reach their buckets through `take` and `wait` coroutines: a map in this process (`LocalBuckets`),
or one map that several ingress replicas share (`ray_app.GatewayBuckets`), so a client's budget is the same
whichever replica its requests reach.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass

from ..serving.middleware import CLIENT_KEY, error_response, is_open
from ..serving.protocol import OpenAIError

MAX_CLIENTS = 10_000  # buckets kept at most; beyond this the least recently used client starts afresh


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


# Failed API keys per address: 20 at once, then one every 3 s; beyond, a 429 before the key is compared.
AUTH_FAILURE_LIMIT = RateLimit(requests_per_second=1 / 3, burst=20)


class TokenBucket:
    """`capacity` tokens, refilled at `rate` per second; `take` spends one or says how long until one is back."""

    def __init__(self, capacity: int, rate: float, now: float):
        self.capacity, self.rate = capacity, rate
        self.tokens, self.updated = float(capacity), now

    def refill(self, now: float) -> None:
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
        self.updated = now

    def wait(self, now: float) -> float:
        """0 if a token is there, else the seconds until one will be."""
        self.refill(now)
        return 0.0 if self.tokens >= 1 else (1 - self.tokens) / self.rate

    def take(self, now: float) -> float:
        """0 if a token was taken, else the seconds until one will be there."""
        wait = self.wait(now)
        if wait == 0:
            self.tokens -= 1
        return wait


class Buckets:
    """One `TokenBucket` per client, least recently used first: a bucket that has refilled is dropped (a new
    one would be the same), and beyond `max_clients` the least recently used goes, so many clients (an IPv6
    range, say) cannot grow the map."""

    def __init__(self, limit: RateLimit, max_clients: int = MAX_CLIENTS):
        self.limit, self.max_clients = limit, max_clients
        self.buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def __len__(self) -> int:
        return len(self.buckets)

    def wait(self, client: str, now: float) -> float:
        """The seconds until `client` may spend a token (0: now), without spending one or keeping a bucket."""
        bucket = self.buckets.get(client)
        return 0.0 if bucket is None else bucket.wait(now)

    def take(self, client: str, now: float) -> float:
        """Spend one of `client`'s tokens: 0, else the seconds until one is back."""
        bucket = self.buckets.pop(client, None) or TokenBucket(self.limit.capacity, self.limit.requests_per_second,
                                                               now)
        self.buckets[client] = bucket  # the most recently used last
        wait = bucket.take(now)
        self.forget(now)
        return wait

    def forget(self, now: float) -> None:
        """Drop the least recently used buckets beyond `max_clients`, then those at the old end that are full."""
        while len(self.buckets) > self.max_clients:
            self.buckets.popitem(last=False)
        while self.buckets:  # from the old end: stop at the first bucket still short of tokens
            client, bucket = next(iter(self.buckets.items()))
            bucket.refill(now)
            if bucket.tokens < bucket.capacity:
                break
            del self.buckets[client]


class LocalBuckets:
    """A `Buckets` map kept in this process, behind the coroutines a shared map offers too."""

    def __init__(self, limit: RateLimit, max_clients: int = MAX_CLIENTS):
        self.map = Buckets(limit, max_clients)

    async def take(self, client: str) -> float:
        return self.map.take(client, time.monotonic())

    async def wait(self, client: str) -> float:
        return self.map.wait(client, time.monotonic())


def client_address(scope) -> str:
    """The client's address: the socket's, or the one a proxy named (only one of `--forwarded-allow-ips`)."""
    client = scope.get("client")
    return client[0] if client else "unknown"


def too_many(message: str, wait: float) -> OpenAIError:
    """A 429 that says when to come back (`Retry-After`, whole seconds, at least the `wait`)."""
    return OpenAIError(message, status=429, type="rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": str(math.ceil(wait))})


class RateLimiter:
    """ASGI middleware: one `TokenBucket` per client, in `buckets` (default: a map here); /health, /metrics and
    /version are not limited."""

    def __init__(self, app, limit: RateLimit, buckets=None, max_clients: int = MAX_CLIENTS):
        self.app, self.limit = app, limit
        self.buckets = buckets or LocalBuckets(limit, max_clients)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or is_open(scope):
            return await self.app(scope, receive, send)
        # the key `ApiKeyAuth` matched when it holds several (its index: the key itself is kept nowhere)
        client = scope.get(CLIENT_KEY) or "address " + client_address(scope)
        wait = await self.buckets.take(client)
        if wait > 0:
            error = too_many(f"rate limit exceeded: {self.limit.requests_per_second:g} requests per second "
                             f"in bursts of {self.limit.capacity}; retry in {wait:.2f} s", wait)
            return await error_response(error)(scope, receive, send)
        await self.app(scope, receive, send)


class AuthFailureLimit:
    """ASGI middleware around `ApiKeyAuth`: each 401 takes a token from its address's bucket, and an address
    with none left gets a 429 with Retry-After before its key is compared. `failures`: where the buckets are
    (default: a map here)."""

    def __init__(self, app, limit: RateLimit = AUTH_FAILURE_LIMIT, failures=None, max_clients: int = MAX_CLIENTS):
        self.app, self.limit = app, limit
        self.failures = failures or LocalBuckets(limit, max_clients)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or is_open(scope):
            return await self.app(scope, receive, send)
        address = client_address(scope)
        if (wait := await self.failures.wait(address)) > 0:
            error = too_many(f"too many failed API keys from this address: {self.limit.capacity} at most, then "
                             f"one every {1 / self.limit.requests_per_second:g} s; retry in {wait:.2f} s", wait)
            return await error_response(error)(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start" and message["status"] == 401:
                await self.failures.take(address)
            await send(message)

        await self.app(scope, receive, counting_send)
