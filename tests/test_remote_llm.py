"""Chapter 9's `RemoteLLM` without Ray, over stand-in replicas in this process: a request whose replica fails
before any output (its engine failed, or the replica died) is sent again and succeeds, counted in /metrics
as `request_retries_total`, and names the replica that served it; a stream that has begun ends with its
error, not a retry; retries are bounded; /metrics answers before any replica has; the waiting bound counts
requests admitted at the ingress until their first output, however long the stats polls take."""

import asyncio

import pytest
from prometheus_client import generate_latest
from ray.exceptions import ActorDiedError

from minillm.sampling import RequestOutputKind, SamplingParams
from minillm.service import remote_llm
from minillm.service.deltas import Slim
from minillm.service.remote_llm import RemoteLLM
from minillm.service.replica_header import REPLICAS
from minillm.serving import AsyncLLM
from minillm.serving.async_llm import EngineDeadError, EngineOverloaded, EngineUnavailable
from minillm.serving.prometheus import ServerMetrics
from serving_utils import slow_steps, tiny_engine

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


class Call:
    """A stand-in for Serve's streamed response: iterated for the replica's items; `cancel` stops it."""

    def __init__(self, items):
        self.items = items

    def __aiter__(self):
        return self.items

    def cancel(self) -> None:
        pass


class Replicas:
    """A stand-in for a Serve handle to `LLMServer` replicas: each call goes to a replica of the kind `plan` names
    next: "dead" refuses as a failed engine does (before naming itself), "killed" names itself and dies before
    any output, "dies" dies after its first output, "queued" names itself and sends nothing (a request queued
in Serve's router), "live" (also once the plan is used up) serves the request
    on a real engine."""

    def __init__(self, llm: AsyncLLM, plan: list[str]):
        self.llm, self.plan, self.sent = llm, list(plan), []
        self.answers: list[dict] = []  # what the replicas answer a stats poll: none by default

    def options(self, stream: bool) -> "Replicas":
        return self

    @property
    def generate(self) -> "Replicas":
        return self

    def remote(self, **request) -> Call:
        kind = self.plan.pop(0) if self.plan else "live"
        self.sent.append(kind)
        return Call(self._serve(kind, f"replica-{len(self.sent)}", request))

    async def _serve(self, kind: str, replica_id: str, request: dict):
        if kind == "dead":
            raise EngineDeadError()
        yield replica_id
        if kind == "killed":
            raise ActorDiedError()
        if kind == "queued":
            await asyncio.Event().wait()
        slim = Slim()  # as `LLMServer.generate` sends its outputs
        async for out in self.llm.generate(request["prompt_token_ids"], request["params"], request["request_id"]):
            yield slim(out)
            if kind == "dies":
                raise ActorDiedError()

    def broadcast(self, method: str) -> "Replicas":
        return self

    async def results_async(self, timeout_s: float, return_exceptions: bool) -> list[dict]:
        return self.answers


def run(model, plan: list[str], read, max_waiting_requests: int = 8):
    """Start a `RemoteLLM` over `Replicas(plan)`, await `read(remote)`, stop both; (result, remote, replicas)."""
    async def main():
        engine = tiny_engine(model, num_kv_blocks=32)
        slow_steps(engine, 0.02)  # a stream's first output is read before its last is made
        engine_llm = AsyncLLM(engine)
        await engine_llm.start()
        replicas = Replicas(engine_llm, plan)
        remote = RemoteLLM(replicas, model, max_waiting_requests=max_waiting_requests, max_model_len=128)
        await remote.start()
        try:
            return await read(remote), remote, replicas
        finally:
            await remote.stop()
            await engine_llm.stop()
    return asyncio.run(main())


async def outputs(remote: RemoteLLM, request_id: str = "r1"):
    return [out async for out in remote.generate([1, 2, 3, 4], PARAMS, request_id)]


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr(remote_llm, "RETRY_DELAYS_S", (0.01, 0.01, 0.01, 0.01))


def test_a_request_whose_replica_failed_before_any_output_is_sent_again(tiny_llama):
    async def read(remote):
        calls = []
        REPLICAS.set(calls)
        outs = await outputs(remote)
        return outs, calls[0].replica.result(), generate_latest(ServerMetrics(remote, "m").registry).decode()

    (outs, served_by, metrics), remote, replicas = run(tiny_llama, ["dead", "killed"], read)
    assert replicas.sent == ["dead", "killed", "live"]
    assert outs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outs) == 4
    assert remote.num_retries == 2 and 'minillm:request_retries_total{model_name="m"} 2.0' in metrics
    assert served_by == "replica-3"  # the replica that served it, not the one that died after naming itself


def test_a_stream_that_has_begun_ends_with_its_error(tiny_llama):
    async def read(remote):
        with pytest.raises(EngineUnavailable, match="stopped"):
            await outputs(remote)

    _, remote, replicas = run(tiny_llama, ["dies"], read)
    assert replicas.sent == ["dies"] and remote.num_retries == 0


def test_retries_are_bounded(tiny_llama):
    async def read(remote):
        with pytest.raises(EngineUnavailable):
            await outputs(remote)

    _, remote, replicas = run(tiny_llama, ["killed"] * 9, read)
    assert len(replicas.sent) == 1 + len(remote_llm.RETRY_DELAYS_S) == 1 + remote.num_retries


def test_metrics_answer_before_any_replica_has(tiny_llama):
    async def read(remote):
        return generate_latest(ServerMetrics(remote, "m").registry).decode()

    metrics, remote, _ = run(tiny_llama, [], read)
    with pytest.raises(EngineUnavailable, match="shutting down"):  # what /health says of it, once stopped
        remote.check_accepting()
    assert 'minillm:num_requests_waiting{model_name="m"} 0.0' in metrics
    assert 'minillm:kv_cache_usage_perc{model_name="m"} 0.0' in metrics


def test_metrics_fall_to_zero_once_no_replica_answers(tiny_llama):
    async def read(remote):
        registry = ServerMetrics(remote, "m").registry
        remote.handle.answers = [{**remote.handle.llm.stats(), "num_running": 3, "num_unfinished": 3,
                                  "replica_id": "replica-1", "pid": 1}]
        await remote.poll()
        busy = generate_latest(registry).decode()
        remote.handle.answers = []  # the replica is gone
        await remote.poll()
        return busy, generate_latest(registry).decode()

    (busy, gone), _, _ = run(tiny_llama, [], read)
    assert 'minillm:num_requests_running{model_name="m"} 3.0' in busy
    assert 'minillm:num_requests_running{model_name="m"} 0.0' in gone


def test_requests_queued_beyond_the_replicas_count_against_the_waiting_bound(tiny_llama):
    """Two requests queued (no output yet, whatever the replicas' stats say) fill a bound of 2, across polls."""
    async def read(remote):
        queued = [remote.add_request(f"q{i}", [1, 2, 3], PARAMS) for i in range(2)]
        await asyncio.sleep(2 * remote_llm.STATS_PERIOD_S)  # polls come and go: the replicas report no one waiting
        with pytest.raises(EngineOverloaded, match="2 sequences are waiting"):
            remote.add_request("q2", [1, 2, 3], PARAMS)
        await queued[0].aclose()  # its client left: it waits no more
        await asyncio.sleep(0)
        return [out async for out in remote.generate([1, 2, 3], PARAMS, "q3")]

    outs, remote, _ = run(tiny_llama, ["queued", "queued"], read, max_waiting_requests=2)
    assert outs[-1].finished and remote.num_waiting == 0
