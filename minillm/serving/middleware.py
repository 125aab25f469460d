"""Chapter 8 — what wraps every request before a route sees it (plain ASGI middleware): a request id on every
response, a 500 that tells the client nothing of the bug, an API key, and a cap on the body's size.

Outermost first: CORS (Starlette's, when origins are allowed) → `RequestId` → `ApiKeyAuth` → `RateLimiter`
(chapter 9's, gateway.py) → `BodyLimit`.
"""

from __future__ import annotations

import logging
import secrets
import uuid

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match

from .protocol import OpenAIError

log = logging.getLogger("minillm.serving")
OPEN_PATHS = ("/health", "/metrics", "/version")  # served without an API key, as vLLM does
MAX_REQUEST_ID_CHARS = 128
OPEN_KEY = "minillm.open_route"  # the scope key where `is_open` keeps its answer


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


class ApiKeyAuth:
    """Every route but /health, /metrics and /version needs `Authorization: Bearer <key>` (else 401), and so does
    a path no route answers."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or is_open(scope):
            return await self.app(scope, receive, send)
        given = (bearer_token(Headers(scope=scope)) or "").encode("latin-1")  # a header's bytes, as they came
        if not secrets.compare_digest(given, self.expected):  # constant time: the key's prefix is not guessable
            error = OpenAIError("a valid API key is required: send the header `Authorization: Bearer <key>`",
                                status=401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await error_response(error)(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuse bodies over `max_bytes` (413), by their Content-Length or while they arrive."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            error = OpenAIError(f"the request body is larger than {self.max_bytes} bytes", status=413,
                                code="request_too_large")
            return await error_response(error)(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413)
            return message

        await self.app(scope, limited_receive, send)
