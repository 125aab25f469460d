"""Chapter 8 — what wraps every request before a route sees it (plain ASGI middleware): a request id on every
response, a 500 that tells the client nothing of the bug, the Host header checked, API keys, and a cap on the
body's size and on the time it takes to arrive.

Outermost first: CORS (Starlette's, when origins are allowed) → `RequestId` → `HostCheck` → `AuthFailureLimit`
(chapter 9's, gateway.py) → `ApiKeyAuth` → `RateLimiter` (gateway.py) → `BodyLimit`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import time
import uuid
from collections.abc import Sequence

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match

from .protocol import OpenAIError

log = logging.getLogger("minillm.serving")
OPEN_PATHS = ("/health", "/metrics", "/version")  # served without an API key, as vLLM does
MAX_REQUEST_ID_CHARS = 128
OPEN_KEY = "minillm.open_route"  # the scope key where `is_open` keeps its answer
CLIENT_KEY = "minillm.client"  # the scope key where `ApiKeyAuth` names the client by its key's index
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")  # the names a loopback server answers to


def answering_route(scope) -> BaseRoute | None:
    """The route the app's router will hand this request to, found before it does: a full match, else one for
    another method (a 405), else the one its trailing-slash redirect leads to; None for a 404."""
    router = scope["app"].router

    def first(s, kinds: tuple[Match, ...]) -> BaseRoute | None:
        return next((r for r in router.routes if r.matches(s)[0] in kinds), None)

    route = first(scope, (Match.FULL,)) or first(scope, (Match.PARTIAL,))
    path = scope["path"]
    if route is None and router.redirect_slashes and path != "/":
        redirect = {**scope, "path": path.rstrip("/") if path.endswith("/") else path + "/"}
        route = first(redirect, (Match.FULL, Match.PARTIAL))
    return route


def is_open(scope) -> bool:
    """Whether a request goes to /health, /metrics or /version, by the route that answers it, not by its spelling:
    `/health/` (redirected to /health) is open and `/v1/models/` (a model named "") is not. Found once per request
    and kept in its scope, for the API key's check and the rate limit alike."""
    if OPEN_KEY not in scope:
        scope[OPEN_KEY] = getattr(answering_route(scope), "path", None) in OPEN_PATHS
    return scope[OPEN_KEY]


def bearer_token(headers: Headers) -> str | None:
    """The token of `Authorization: Bearer <token>`; the scheme's case does not matter (RFC 9110)."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token if scheme.lower() == "bearer" else None


def error_response(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def internal_error() -> OpenAIError:
    """What a client learns of a bug or of a failed engine: nothing but that it happened (details are logged)."""
    return OpenAIError("internal error", status=500, type="internal_error")


class RequestId:
    """Echo the client's `X-Request-Id` (or a new one) on every response, and turn an exception no handler
    took into a generic 500, logged with that id."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = Headers(scope=scope).get("x-request-id", "")
        usable = 0 < len(given) <= MAX_REQUEST_ID_CHARS and given.isascii() and given.isprintable()
        request_id = given if usable else uuid.uuid4().hex  # echoed back, so only what a header may carry
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", request_id.encode("latin-1"))]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("internal error serving %s %s (request id %s)", scope["method"], scope["path"], request_id)
            if not started:
                await error_response(internal_error())(scope, receive, send_with_id)


def host_name(header: str) -> str:
    """The name in a Host header, without its port: `[::1]:8000` -> `::1`, `LocalHost:80` -> `localhost`."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    name, _, port = header.partition(":")
    return name if port.isdigit() else header  # `::1` unbracketed (no port) stays whole


def bind_hosts(host: str) -> tuple[str, ...]:
    """The Host names a server bound to `host` answers to: any for 0.0.0.0 or ::, the loopback names for a
    loopback address, else that address or name."""
    if host in ("", "0.0.0.0", "::"):
        return ("*",)
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    return tuple(dict.fromkeys([*LOOPBACK_HOSTS, host] if loopback else [host]))


def host_patterns(allowed: Sequence[str]) -> frozenset[str]:
    """`--allowed-hosts`, checked and in lower case: names or addresses (no port), `*.example.com`, or `*`."""
    patterns = frozenset(h.strip().lower() for h in allowed)
    for p in patterns:
        wildcard = p.startswith("*.") and "*" not in p[1:]
        if not p or "/" in p or "*" in p and p != "*" and not wildcard:
            raise ValueError(f"allowed_hosts: {p!r} is not a host name, an address, *.domain or *")
    return patterns


class HostCheck:
    """Answer only requests whose Host header names this server (else a 400): a web page whose name an attacker
    points at 127.0.0.1 (DNS rebinding) reaches the port, but its requests still carry the attacker's name.
    `allowed`: `host_patterns`' names (any port), `*.example.com` for its subdomains, or `*` for any host.
    Starlette's TrustedHostMiddleware does the same, but answers in plain text, not with an OpenAI error."""

    def __init__(self, app, allowed: frozenset[str]):
        self.app, self.allowed, self.any = app, allowed, "*" in allowed

    def allows(self, name: str) -> bool:
        return name in self.allowed or any(h.startswith("*.") and name.endswith(h[1:]) for h in self.allowed)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.any:
            return await self.app(scope, receive, send)
        name = host_name(Headers(scope=scope).get("host", ""))
        if not self.allows(name):
            error = OpenAIError(f"this server does not answer to the host {name[:64]!r}: allow it with "
                                "--allowed-hosts", status=400, code="invalid_host")
            return await error_response(error)(scope, receive, send)
        await self.app(scope, receive, send)


def api_keys(api_key: str | Sequence[str]) -> tuple[str, ...]:
    """The keys in `--api-key` or $MINILLM_API_KEY: one, several comma-separated, or a list of either."""
    given = [api_key] if isinstance(api_key, str) else list(api_key)
    keys = tuple(dict.fromkeys(k.strip() for value in given for k in value.split(",") if k.strip()))
    if not keys:
        raise ValueError("api_key holds no key: give one, or several separated by commas")
    return keys


class ApiKeyAuth:
    """Every route but /health, /metrics and /version needs `Authorization: Bearer <key>` (else 401), and so does
    a path no route answers. With several keys (one per client), the one given names its client for the rate
    limit (in the scope, by its index: the key itself is kept nowhere else)."""

    def __init__(self, app, keys: Sequence[str]):
        self.app, self.expected = app, [k.encode() for k in keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or is_open(scope):
            return await self.app(scope, receive, send)
        given = (bearer_token(Headers(scope=scope)) or "").encode("latin-1")  # a header's bytes, as they came
        # constant time, and every key compared: neither a key's prefix nor its position is guessable
        matches = [secrets.compare_digest(given, key) for key in self.expected]
        if not any(matches):
            error = OpenAIError("a valid API key is required: send the header `Authorization: Bearer <key>`",
                                status=401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await error_response(error)(scope, receive, send)
        if len(self.expected) > 1:
            scope[CLIENT_KEY] = f"key {matches.index(True)}"
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuse bodies over `max_bytes` (413), by their Content-Length or while they arrive, and bodies still
    arriving `timeout_s` after the request began (408: a client trickling its body would hold its connection
    and task for ever; uvicorn has no such timeout)."""

    def __init__(self, app, max_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            error = OpenAIError(f"the request body is larger than {self.max_bytes} bytes", status=413,
                                code="request_too_large")
            return await error_response(error)(scope, receive, send)
        received, more, deadline = 0, True, time.monotonic() + self.timeout_s

        async def limited_receive():
            nonlocal received, more
            if not more:  # the body is in: what is left to hear is the client hanging up, whenever it does
                return await receive()
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    message = await receive()
            except TimeoutError:
                raise HTTPException(408) from None
            received += len(message.get("body", b""))
            more = message["type"] == "http.request" and message.get("more_body", False)
            if received > self.max_bytes:
                raise HTTPException(413)
            return message

        await self.app(scope, limited_receive, send)
