"""Chapter 8 — the cap on a request body's size (plain ASGI middleware, so it acts before the body is read)."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from .protocol import OpenAIError


def error_response(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


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
