"""Chapter 9 — one engine replica: a Ray Serve deployment whose every replica is a process with its own engine.

Each replica (one Ray actor, one process) builds an `LLMEngine` from the service's `EngineArgs`, so it has
its own weights, KV cache and threads, and runs it behind chapter 8's `AsyncLLM`. The ingress sends it
prompts that are already token ids; `prompt_token_ids` and `user` are keyword arguments because Serve's
request router reads a request's arguments to choose a replica (prefix and session affinity). The first
item of every stream is the replica's id, so the ingress can name the replica in its response headers
before the first token exists; a replica whose engine failed or hangs refuses a request before that, so the
ingress sends it to another. A replica whose engine failed ends its own process once its streams have their
error: Serve starts another at once, and every router drops it at its next call instead of sending it
requests (it would look idle) until the next health check.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator

import ray
from ray import serve

from ..engine import LLMEngine
from ..engine_args import EngineArgs
from ..outputs import RequestOutput
from ..sampling import SamplingParams
from ..serving.async_llm import STEP_TIMEOUT_S, AsyncLLM
from .deltas import Slim
from .ray_cluster import listen_on_node_ip, require_model_dir

EXIT_AFTER_S = 5.0  # how long a replica whose engine failed waits for its streams to send their errors


@serve.deployment(name="LLMServer")
class LLMServer:
    """An `AsyncLLM` over its own `LLMEngine`; options (replicas, resources, router) are set by `ray_app`."""

    async def __init__(self, engine_args: EngineArgs, step_timeout_s: float | None = STEP_TIMEOUT_S):
        listen_on_node_ip()
        require_model_dir(engine_args.model)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.llm = AsyncLLM(LLMEngine(engine_args), step_timeout_s=step_timeout_s)
        self.llm.failure_listeners.append(lambda error: asyncio.ensure_future(self._exit()))
        await self.llm.start()

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       user: str | None = None) -> AsyncIterator[str | RequestOutput]:
        """This replica's id, then the request's outputs (slimmed: `deltas.Slim`); a failed or stuck engine raises
        before the id. If the caller cancels the stream (its client left), `AsyncLLM.generate` aborts the request
        and frees its KV blocks. `user` is for the router only."""
        self.llm.check_accepting()
        yield self.replica_id
        slim = Slim()
        async for out in self.llm.generate(prompt_token_ids, params, request_id):
            yield slim(out)

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
        """Serve restarts a replica whose check fails: one whose engine step failed (it serves nothing again) or
        has hung past `step_timeout_s`."""
        if self.llm.error is not None or self.llm.stalled_for() is not None:
            self.llm.check_accepting()  # raises, saying which

    async def _exit(self) -> None:
        """The engine failed: once every stream has its error (or after `EXIT_AFTER_S`), end this replica's
        process as a crash would."""
        deadline = time.monotonic() + EXIT_AFTER_S
        while self.llm.open_streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # the last errors on their way to the ingress
        self.llm.engine.shutdown()
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
