"""Chapter 9 — which replica served a response: the `x-minillm-replica` header, added at the ingress (and which
ingress replica handled it: `x-minillm-ingress`).

A response may come from any replica, and a client (or a benchmark of routers) wants to know which. Each
engine call made while one HTTP request is handled puts itself in `REPLICAS`, with a future of its replica's
id; the replica names itself first thing on its stream, so a streamed response, which starts before its
first token, waits only for that, and for at most `REPLICA_WAIT_S`: during a cold start (Serve starting a
replica from zero) the stream's headers and keep-alive pings go out without the header rather than leave
the client without a byte. Whatever else the app sends meanwhile goes out after the response's start.
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar

# The engine calls made while one HTTP request is handled (`remote_llm.RemoteCall`: its `replica` is a future
# of the serving replica's id, None if none answered). Set by `IngressHeaders`, filled by `RemoteLLM.add_request`.
REPLICAS: ContextVar[list | None] = ContextVar("minillm_replicas", default=None)
REPLICA_WAIT_S = 2.0  # a warm replica names itself in milliseconds; a cold start takes seconds to minutes


class IngressHeaders:
    """ASGI middleware at the ingress: `x-minillm-replica` names the replica(s) that served a response's requests
    (none if it reached none, or none had named itself within `REPLICA_WAIT_S` of a stream's start),
    `x-minillm-ingress` the ingress replica (`ingress_id`, if given), and `x-request-id` is left to Serve's proxy,
    which adds one to every response itself (with the same id)."""

    def __init__(self, app, ingress_id: str | None = None):
        self.app, self.ingress = app, None if ingress_id is None else ingress_id.encode("latin-1")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        calls: list = []
        token = REPLICAS.set(calls)
        in_order = asyncio.Lock()  # a message sent while the start waits for its replica goes after it

        async def send_with_replica(message):
            async with in_order:
                if message["type"] == "http.response.start":
                    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                    if calls:
                        await asyncio.wait([c.replica for c in calls], timeout=REPLICA_WAIT_S)
                    ids = [c.replica.result() for c in calls if c.replica.done() and c.replica.result() is not None]
                    if ids:
                        headers.append((b"x-minillm-replica", ",".join(dict.fromkeys(ids)).encode("latin-1")))
                    if self.ingress is not None:
                        headers.append((b"x-minillm-ingress", self.ingress))
                    message = {**message, "headers": headers}
                await send(message)

        try:
            await self.app(scope, receive, send_with_replica)
        finally:
            REPLICAS.reset(token)
