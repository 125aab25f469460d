"""Chapter 9's `x-minillm-replica` header, without Ray: the response's start waits for the replica to name
itself, and a message the app sends meanwhile (a stream's keep-alive ping) goes after it; a replica that does
not name itself soon (a cold start) does not hold the stream's start and pings back."""

import asyncio
from types import SimpleNamespace

from minillm.service import replica_header
from minillm.service.replica_header import REPLICAS, IngressHeaders


def serve(named_after_s: float) -> list[dict]:
    """What a stream's app sends through the middleware when its replica names itself after `named_after_s`."""
    async def run():
        replica = asyncio.get_running_loop().create_future()
        sent = []

        async def app(scope, receive, send):
            REPLICAS.get().append(SimpleNamespace(replica=replica))  # a call, as `RemoteLLM` records it
            start = asyncio.create_task(send({"type": "http.response.start", "status": 200, "headers": []}))
            await asyncio.sleep(0)  # the start now waits for the replica, as during a cold start
            ping = asyncio.create_task(send({"type": "http.response.body", "body": b": ping", "more_body": True}))
            await asyncio.sleep(named_after_s)
            replica.set_result("replica-1")
            await asyncio.gather(start, ping)
            await send({"type": "http.response.body", "body": b"data", "more_body": False})

        async def record(message):
            sent.append(message)

        await IngressHeaders(app)({"type": "http"}, None, record)
        return sent

    return asyncio.run(run())


def test_a_ping_sent_while_the_start_waits_for_its_replica_goes_after_the_start():
    sent = serve(0.01)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert (b"x-minillm-replica", b"replica-1") in sent[0]["headers"]
    assert [m["body"] for m in sent[1:]] == [b": ping", b"data"]


def test_a_cold_start_does_not_hold_the_stream_s_start(monkeypatch):
    monkeypatch.setattr(replica_header, "REPLICA_WAIT_S", 0.05)
    sent = serve(0.5)  # the replica names itself long after the wait
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert not any(k == b"x-minillm-replica" for k, _ in sent[0]["headers"])
    assert sent[1]["body"] == b": ping"
