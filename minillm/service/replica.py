"""Chapter 9 — one engine replica: a Ray Serve deployment whose every replica is a process with its own engine.

Each replica (one Ray actor, one process) builds an `LLMEngine` from the service's `EngineArgs`, so it has
its own weights, KV cache and threads, and runs it behind chapter 8's `AsyncLLM`. The ingress sends it
prompts that are already token ids; `prompt_token_ids` and `user` are keyword arguments because Serve's
request router reads a request's arguments to choose a replica (prefix and session affinity). The first
item of every stream is the replica's id, so the ingress can name the replica in its response headers
before the first token exists.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

from ray import serve

from ..engine import LLMEngine
from ..engine_args import EngineArgs
from ..outputs import RequestOutput
from ..sampling import SamplingParams
from ..serving.async_llm import AsyncLLM
from .ray_cluster import listen_on_node_ip


@serve.deployment(name="LLMServer")
class LLMServer:
    """An `AsyncLLM` over its own `LLMEngine`; options (replicas, resources, router) are set by `ray_app`."""

    async def __init__(self, engine_args: EngineArgs):
        listen_on_node_ip()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.llm = AsyncLLM(LLMEngine(engine_args))
        await self.llm.start()

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       user: str | None = None) -> AsyncIterator[str | RequestOutput]:
        """This replica's id, then the request's outputs. If the caller cancels the stream (its client left),
        `AsyncLLM.generate` aborts the request and frees its KV blocks. `user` is for the router only."""
        yield self.replica_id
        async for out in self.llm.generate(prompt_token_ids, params, request_id):
            yield out

    async def stats(self) -> dict:
        """The engine's stats (`LLMEngine.stats`), with who answers (replica id, process id) and the requests in
        flight here."""
        return {**self.llm.stats(), "replica_id": self.replica_id, "pid": os.getpid(),
                "num_unfinished": self.llm.num_unfinished()}

    async def __del__(self) -> None:
        """Serve calls this when it stops the replica: the engine loop ends, then any worker processes."""
        await self.llm.stop()
        self.llm.engine.shutdown()

    async def check_health(self) -> None:
        """Serve restarts a replica whose check fails: one whose engine step failed serves nothing again."""
        if self.llm.error is not None:
            raise RuntimeError("the engine stopped after an internal error")
