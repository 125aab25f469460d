"""Chapter 9 — chapter 8's engine interface with the engines elsewhere: `RemoteLLM` forwards it to replicas.

The OpenAI app reaches its engine only through `AsyncLLM`'s narrow interface, so `RemoteLLM` implements the
same methods at the ingress and the same app fronts any number of replicas unchanged. Text stays here: the
ingress tokenizes and applies the chat template with its own tokenizer (the engine's own code, run on it),
so a replica receives token ids and the router can look at them. Each request is one streamed call through
a Serve `DeploymentHandle` (`handle.options(stream=True)`); its outputs land in chapter 8's `RequestStream`,
so a handler reads them exactly as it would a local engine's. A call that fails before its first output
(its replica died, or refused it: its engine failed, hangs, or is stopping) is sent again after a short
wait, to whichever replica the router picks then, so a failed replica costs its requests a retry, not an
error; a stream that has begun ends with an error event. Twice a second every replica is asked for its
stats (`handle.broadcast`): `/metrics` shows their sum, and when no replica answers, requests get a 503.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

from transformers import AutoTokenizer

from ..config import ModelConfig
from ..engine import LLMEngine
from ..output_processor import OutputProcessor
from ..outputs import RequestOutput
from ..sampling import SamplingParams
from ..serving.api_server import REQUEST_USER
from ..serving.async_llm import (AsyncLLM, EngineDeadError, EngineOverloaded, EngineUnavailable, RequestFailed,
                                 RequestStream)
from ..serving.protocol import OpenAIError
from .deltas import Widen
from .replica_header import REPLICAS

log = logging.getLogger("minillm.serving")
STATS_PERIOD_S = 0.5  # how often the replicas' stats are polled
STATS_TIMEOUT_S = 5.0  # a poll not answered by then is skipped: the last answers stand
RETRY_DELAYS_S = (0.25, 0.5, 1.0, 2.0)  # before each new attempt; a replica whose engine failed leaves within a second
ADDITIVE = ("kv_blocks_total", "kv_blocks_free", "kv_cache_bytes", "num_waiting", "num_running", "num_preemptions",
            "prefix_cache_hit_tokens", "prefix_cache_query_tokens", "num_unfinished")


@dataclass(eq=False)
class RemoteCall:
    """One request in flight on a replica: the stream its reader holds, the Serve call feeding it (its latest
    attempt), the replica's id once it has announced itself (None if no attempt got that far), and the last
    output passed on."""

    stream: RequestStream
    response: object  # ray.serve.handle.DeploymentResponseGenerator
    replica: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    pump: asyncio.Task | None = None
    last: RequestOutput | None = None
    waiting: int = 0  # its sequences still counted in `RemoteLLM.num_waiting`
    widen: Widen = field(default_factory=Widen)  # the replica's slimmed outputs, whole again

    def settle(self, replica_id: str | None) -> None:
        if not self.replica.done():
            self.replica.set_result(replica_id)

    def resend(self, response) -> None:
        """A new attempt: its replica will announce itself afresh (a response not yet started names that one)."""
        if self.replica.done():
            self.replica = asyncio.get_running_loop().create_future()
        self.response = response


class RemoteLLM:
    """`AsyncLLM`'s interface (see its docstring) over the replicas of a Serve deployment (`replica.LLMServer`).

    A sequence counts as waiting from its admission here until its request's first output arrives (or the
    request ends): queued in Serve's router or in a replica's engine alike. `max_waiting_requests` bounds that
    count, as it bounds one engine's waiting queue; it is kept here, where requests are admitted, so it never
    lags behind the replicas' stats.
    `max_model_len` given (a service that may scale to zero) means no replica need be up: requests are sent
    anyway and Serve starts one for them, and an idle service is not polled, so that its replicas see no
    traffic at all and can be removed; otherwise the context length is learned from the first replica.
    """

    def __init__(self, handle, model: str | Path, max_waiting_requests: int | None = None,
                 max_model_len: int | None = None):
        self.handle = handle  # a DeploymentHandle to the replicas
        self.tokenizer = AutoTokenizer.from_pretrained(str(model))
        self.config = ModelConfig.from_dir(Path(model))
        self.max_waiting_requests = max_waiting_requests
        self.listeners: list = []  # called with each output as it arrives (the app's Prometheus metrics)
        self.failure_listeners: list = []  # never called: a failed replica is restarted by Serve, not fatal here
        self.error: BaseException | None = None
        self.open_streams = 0
        self.scales_to_zero = max_model_len is not None
        self.max_model_len = max_model_len or 0
        self.replicas: dict[str, dict] = {}  # replica id -> its stats, for those that answered the last poll
        self._stats: dict = dict.fromkeys(ADDITIVE, 0)  # what /metrics shows before any replica has answered
        self._text: OutputProcessor | None = None  # the engine's token display, once max_model_len is known
        self._calls: dict[str, RemoteCall] = {}
        self.num_waiting = 0  # sequences admitted whose request has had no output yet
        self.num_retries = 0  # attempts sent again after a replica failed before a request's first output
        self._accepting = False
        self._poller: asyncio.Task | None = None

    # --- lifecycle -------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Unless the context length is known, wait until a replica answers (its stats give it); then poll."""
        if not self.scales_to_zero:
            while not self.replicas:
                await self.poll()
                if not self.replicas:
                    await asyncio.sleep(STATS_PERIOD_S)
            self.max_model_len = min(s["max_model_len"] for s in self.replicas.values())
        self._text = OutputProcessor(self.tokenizer, set(), self.max_model_len)
        self._accepting = True
        self._poller = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        self._accepting = False
        if self._poller is not None:
            self._poller.cancel()
        self.abort_all()

    @property
    def accepting(self) -> bool:
        return self._accepting and (self.scales_to_zero or bool(self.replicas))

    def stop_accepting(self) -> None:
        self._accepting = False

    def check_accepting(self) -> None:
        """EngineUnavailable while the server stops, or while no replica answers (unless one can be started)."""
        if not self.accepting:
            raise EngineUnavailable("no engine replica is answering; try again shortly" if self._accepting
                                    else "the server is shutting down")

    # --- requests --------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> RequestStream:
        """Send a request to a replica (the router picks it) and return its stream; checks raise here, at once."""
        self.check_accepting()
        self.check_room(params.n)
        if request_id in self._calls:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate(token_ids)
        request = dict(prompt_token_ids=token_ids, params=params, request_id=request_id, user=REQUEST_USER.get())
        call = RemoteCall(RequestStream(self, request_id, params.output_kind), self._send(request), waiting=params.n)
        call.pump = asyncio.create_task(self._pump(request, call))
        self._calls[request_id] = call
        self.num_waiting += params.n
        if (calls := REPLICAS.get()) is not None:
            calls.append(call)
        return call.stream

    def _send(self, request: dict):
        """One attempt: a streamed call of `LLMServer.generate` on the replica the router picks."""
        return self.handle.options(stream=True).generate.remote(**request)

    async def _pump(self, request: dict, call: RemoteCall) -> None:
        """Move the replica's outputs into the request's stream. A retryable failure before the first output
        sends the request again (up to `len(RETRY_DELAYS_S)` times); any other becomes the stream's error."""
        request_id = request["request_id"]
        try:
            for delay in (*RETRY_DELAYS_S, None):
                try:
                    await self._relay(call)
                    return
                except Exception as e:
                    error = replica_error(e)
                    if call.last is not None or delay is None or not isinstance(error, RETRYABLE):
                        call.stream.queue.put_nowait(error)
                        return
                    log.warning("request %s: its replica failed before any output (%s); sending it again",
                                request_id, error)
                self.num_retries += 1
                await asyncio.sleep(delay)
                call.resend(self._send(request))
        finally:
            self._started(call)
            call.settle(None)
            if call.last is not None and not call.last.finished:  # cancelled or failed: listeners see it end
                self._notify(aborted(call.last))
            if self._calls.get(request_id) is call:
                del self._calls[request_id]

    async def _relay(self, call: RemoteCall) -> None:
        """One attempt's outputs into the stream, until the request finishes (else EngineUnavailable)."""
        async for item in call.response:
            if isinstance(item, str):  # the replica's id comes first
                call.settle(item)
                continue
            item = call.widen(item)
            self._notify(item)
            self._started(call)
            call.last = item
            call.stream.queue.put_nowait(item)
        if call.last is None or not call.last.finished:
            raise EngineUnavailable("the replica ended the stream before the request finished")

    def _started(self, call: RemoteCall) -> None:
        """The call's sequences wait no longer (its first output came, or it ended)."""
        self.num_waiting -= call.waiting
        call.waiting = 0

    def _notify(self, out: RequestOutput) -> None:
        for listener in self.listeners:
            listener([out])

    def check_room(self, num_seqs: int) -> None:
        """EngineOverloaded unless `num_seqs` more sequences may wait (admitted here, no output yet)."""
        if self.max_waiting_requests is not None and self.num_waiting + num_seqs > self.max_waiting_requests:
            raise EngineOverloaded(f"{self.num_waiting} sequences are waiting (limit {self.max_waiting_requests}); "
                                   "try again shortly")

    generate = AsyncLLM.generate  # the same loop: add the request, yield its outputs, close its stream

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        """Cancel the call (the replica aborts the request and frees its blocks); a reader still there gets a 503."""
        call = self._calls.pop(request_id, None)
        if call is None:
            return
        call.response.cancel()
        call.pump.cancel()
        call.settle(None)
        call.stream.queue.put_nowait(EngineUnavailable("the request was aborted"))

    def abort_all(self) -> None:
        for request_id in list(self._calls):
            self.abort_nowait(request_id)

    def forget(self, request_id: str) -> None:
        self._calls.pop(request_id, None)

    def num_unfinished(self) -> int:
        return len(self._calls)

    # --- the model's facts and text handling, here at the ingress ------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            chat_template_kwargs: dict | None = None) -> list[int]:
        """The engine's own template code (`LLMEngine.apply_chat_template` reads only the tokenizer)."""
        return LLMEngine.apply_chat_template(self, messages, add_generation_prompt, continue_final_message,
                                             chat_template_kwargs)

    def validate(self, token_ids: list[int]) -> None:
        """The engine's own check (`LLMEngine.validate` reads `config.vocab_size` and `max_model_len`)."""
        LLMEngine.validate(self, token_ids)

    def compile_grammar(self, params: SamplingParams) -> None:
        """Nothing to compile here: the replica compiles a request's grammar when it takes the request
        (`SamplingParams` has already checked the spec)."""

    def token_text(self, token_id: int) -> str:
        return self._text.token_text(token_id)

    # --- the replicas' stats ---------------------------------------------------------------------------

    def stats(self) -> dict:
        """The replicas' counters summed as of the last poll (zeros while none answers), each one's under
        "replicas", and the retries made here."""
        return {**self._stats, "num_replicas": len(self.replicas), "replicas": dict(self.replicas),
                "num_retries": self.num_retries}

    async def poll(self) -> None:
        """Ask every replica for its stats; one that fails (it died) is left out until it answers again."""
        from ray.serve.exceptions import DeploymentUnavailableError

        try:
            results = await self.handle.broadcast("stats").results_async(timeout_s=STATS_TIMEOUT_S,
                                                                          return_exceptions=True)
        except TimeoutError:  # some replica is stuck: keep the last answers rather than drop every replica
            return
        except DeploymentUnavailableError:  # Serve has no replica up (all starting or restarting)
            results = []
        self.replicas = {s["replica_id"]: s for s in results if isinstance(s, dict)}
        first = next(iter(self.replicas.values()), {})  # the engine's facts, kept from the last replica seen
        self._stats = {**self._stats, **first, **{k: sum(s[k] for s in self.replicas.values()) for k in ADDITIVE}}

    async def _poll_forever(self) -> None:
        was_busy = True
        while True:
            await asyncio.sleep(STATS_PERIOD_S)
            busy = bool(self._calls)
            if self.scales_to_zero and not (busy or was_busy):
                continue  # idle (polled once since the last request ended): leave the replicas alone
            was_busy = busy
            try:
                await self.poll()
            except Exception:  # keep polling: the next answer may come
                log.exception("polling the replicas' stats failed")


def aborted(out: RequestOutput) -> RequestOutput:
    """The final output of a request that ended without one (its client left, or its replica died): its last
    output marked finished, with finish reason "abort" and its last token's time as the end, as an abort in
    the engine would report it."""
    end = out.metrics.token_times[-1] if out.metrics.token_times else out.metrics.arrival_time
    return replace(out, finished=True, outputs=[replace(c, finish_reason="abort") for c in out.outputs],
                   metrics=replace(out.metrics, finished_time=end))


RETRYABLE = (EngineDeadError, EngineUnavailable)  # the replica's fault (see `replica_error`), not the request's


def replica_error(e: Exception) -> Exception:
    """What a reader sees when a replica call fails: the engine's own errors keep their meaning, and a replica
    that died or cannot be reached is a 503 (the client may retry; Serve restarts the replica)."""
    from ray.exceptions import RayError, RayTaskError
    from ray.serve.exceptions import RayServeException

    cause = e.cause if isinstance(e, RayTaskError) else e
    if isinstance(cause, (EngineDeadError, EngineUnavailable, EngineOverloaded, OpenAIError, RequestFailed)):
        return cause
    if isinstance(cause, ValueError):
        return OpenAIError(str(cause))
    if isinstance(e, (RayError, RayServeException)):
        return EngineUnavailable("the replica serving this request stopped; try again")
    return e
