"""Chapter 9's `x-minillm-replica` header, without Ray: the response's start waits for the replica to name
itself, and a message the app sends meanwhile (a stream's keep-alive ping during a cold start) goes after it."""

import asyncio
from types import SimpleNamespace

from minillm.service.replica_header import REPLICAS, IngressHeaders


def test_a_ping_sent_while_the_start_waits_for_its_replica_goes_after_the_start():
    async def run():
        replica = asyncio.get_running_loop().create_future()
        sent = []

        async def app(scope, receive, send):
            REPLICAS.get().append(SimpleNamespace(replica=replica))  # a call, as `RemoteLLM` records it
            start = asyncio.create_task(send({"type": "http.response.start", "status": 200, "headers": []}))
            await asyncio.sleep(0)  # the start now waits for the replica, as during a cold start
            ping = asyncio.create_task(send({"type": "http.response.body", "body": b": ping", "more_body": True}))
            await asyncio.sleep(0.01)
            replica.set_result("replica-1")
            await asyncio.gather(start, ping)
            await send({"type": "http.response.body", "body": b"data", "more_body": False})

        async def record(message):
            sent.append(message)

        await IngressHeaders(app)({"type": "http"}, None, record)
        return sent

    sent = asyncio.run(run())
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert (b"x-minillm-replica", b"replica-1") in sent[0]["headers"]
    assert [m["body"] for m in sent[1:]] == [b": ping", b"data"]
