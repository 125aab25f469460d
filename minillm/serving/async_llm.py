"""Chapter 8 — the engine behind an asyncio server: one thread steps the engine, each request reads its own queue.

`LLMEngine.step` is a blocking forward pass, so it runs in a thread of its own (the engine loop), never on
the event loop that serves HTTP. Requests are added and aborted from the event loop (the engine takes
them between steps); each step's outputs are handed back to the loop, which puts each one on its
request's queue. This is the shape of vLLM's `AsyncLLM`.

A server reaches the engine only through this class (see "What a server uses" on `AsyncLLM`), so chapter 9
can put a Ray replica behind the same methods.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from ..engine import LLMEngine
from ..outputs import CompletionOutput, RequestOutput
from ..sampling import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from ..disagg import PDPair

log = logging.getLogger("minillm.serving")
STEP_TIMEOUT_S = 60.0  # a step running longer than this is taken for hung (a CPU step of the default model: ms to s)


def freeze_startup_heap() -> None:
    """Move every object alive now (modules, weights' wrappers, tokenizer) out of the garbage collector's sight.

    A full collection walks every tracked object; with a model loaded that is hundreds of thousands, about
    0.25 s with the GIL held, so each one a busy server triggers stalls the event loop and the engine alike.
    Frozen, the startup heap is skipped and a full collection walks only what requests made. Collecting first
    keeps today's garbage out of the frozen set; `AsyncLLM.stop` unfreezes.
    """
    gc.collect()
    gc.freeze()


class EngineOverloaded(RuntimeError):
    """The waiting queue is full: the caller should try again later (HTTP 429)."""


class EngineUnavailable(RuntimeError):
    """The engine is stopping: no new requests (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """A step failed and the engine loop stopped (vLLM's name): requests in flight and new ones fail (HTTP 500).
    The message says nothing of the cause; the traceback is in the server's log."""

    def __init__(self):
        super().__init__("the engine stopped after an internal error")


class RequestFailed(RuntimeError):
    """The engine ended this request with an error (no finite logits to sample from); the engine and the other
    requests go on (HTTP 500, or an error event in a stream)."""

    def __init__(self, request_id: str):
        super().__init__(f"request {request_id} failed: the model's output had no finite logits to sample from")


class RequestStream:
    """The outputs of one request, in order, as an async iterator; outputs that queued up while the reader
    was busy come merged into one. Closing it before the request finishes aborts the request."""

    def __init__(self, llm: AsyncLLM, request_id: str, kind: RequestOutputKind):
        self.llm, self.request_id, self.kind = llm, request_id, kind
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = self.closed = False
        llm.open_streams += 1

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self.queue.get()
        while not self.queue.empty() and isinstance(out, RequestOutput) and not out.finished:
            nxt = self.queue.get_nowait()
            out = nxt if isinstance(nxt, BaseException) else self._merge(out, nxt)
        if isinstance(out, BaseException):
            self.finished = True
            raise out
        self.finished = out.finished
        if out.finished and any(c.finish_reason == "error" for c in out.outputs):
            raise RequestFailed(self.request_id)
        return out

    def _merge(self, a: RequestOutput, b: RequestOutput) -> RequestOutput:
        if self.kind != RequestOutputKind.DELTA:
            return b  # cumulative: the later output already holds everything
        by_index = {c.index: c for c in a.outputs}
        for c in b.outputs:
            old = by_index.get(c.index)
            by_index[c.index] = c if old is None else _concat(old, c)
        return replace(b, outputs=sorted(by_index.values(), key=lambda c: c.index),
                       prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs)

    async def aclose(self) -> None:
        """Stop reading: an unfinished request is aborted and its KV blocks freed."""
        if not self.finished:
            self.finished = True
            self.llm.abort_nowait(self.request_id)
        if not self.closed:
            self.closed = True
            self.llm.open_streams -= 1
        self.llm.forget(self.request_id)


def _concat(old: CompletionOutput, new: CompletionOutput) -> CompletionOutput:
    return replace(new, text=old.text + new.text, token_ids=old.token_ids + new.token_ids,
                   logprobs=None if new.logprobs is None else (old.logprobs or []) + new.logprobs)


class AsyncLLM:
    """An `LLMEngine` served to asyncio code: `add_request` / `generate` / `abort`, one engine loop thread. A
    prefill/decode pool (chapter 9's `disagg.PDPair`) offers the engine methods used here, and is served the same way.

    What a server uses, and all it uses (a remote replica implements the same):
    requests: `add_request`, `generate`, `abort`, `abort_nowait`, `forget`, `check_room`, `max_waiting_requests`;
    text: `tokenizer`, `encode`, `apply_chat_template`, `validate`, `token_text`;
    facts: `max_model_len`, `vocab_size`; state: `stats()`, `accepting`, `check_accepting`, `error`, `listeners`,
    `failure_listeners`; lifecycle: `start`, `stop`, `stop_accepting`, `abort_all`, `num_unfinished`, `open_streams`.

    `step_timeout_s`: a step that has run this long is taken for hung (a step that raises stops the engine; one
    that never returns would not): new requests are refused and `/health` answers 503 until it returns.
    """

    def __init__(self, engine: LLMEngine | PDPair, max_waiting_requests: int | None = None,
                 step_timeout_s: float | None = STEP_TIMEOUT_S):
        if step_timeout_s is not None and step_timeout_s <= 0:
            raise ValueError(f"step_timeout_s must be positive, got {step_timeout_s}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.step_timeout_s = step_timeout_s
        self.listeners: list[Callable[[list[RequestOutput]], None]] = []  # called on the event loop per step
        # called on the event loop once a step has failed and every reader has been told
        self.failure_listeners: list[Callable[[BaseException], None]] = []
        self.error: BaseException | None = None  # set if a step failed: the engine stops serving
        self.open_streams = 0  # streams handed out and not yet closed by their readers
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = threading.Event()
        self._running = self._accepting = False
        self._thread: threading.Thread | None = None
        self._step_started: float | None = None  # time.monotonic() when the step in progress began

    # --- lifecycle -------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine loop; outputs are delivered on the calling event loop."""
        self._loop = asyncio.get_running_loop()
        freeze_startup_heap()
        self._running = self._accepting = True
        self._thread = threading.Thread(target=self._engine_loop, name="minillm-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the engine loop, then abort what is left: each open stream gets its final output."""
        self._running = False
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
            self._thread = None
        self.abort_all()
        gc.unfreeze()

    @property
    def accepting(self) -> bool:
        return self._running and self._accepting and self.error is None and self.stalled_for() is None

    def stalled_for(self) -> float | None:
        """Seconds the step in progress has run, if that is past `step_timeout_s` (a hung step); else None."""
        started = self._step_started
        if started is None or self.step_timeout_s is None:
            return None
        running = time.monotonic() - started
        return running if running > self.step_timeout_s else None

    def check_accepting(self) -> None:
        """Raise what a new request would meet now: EngineDeadError after a failed step, EngineUnavailable while
        the server stops or a step hangs."""
        if self.error is not None:
            raise EngineDeadError()
        if (stalled := self.stalled_for()) is not None:
            raise EngineUnavailable(f"the engine is stuck: its current step has run for {stalled:.0f} s "
                                    f"(limit {self.step_timeout_s:g} s)")
        if not self.accepting:
            raise EngineUnavailable("the server is shutting down")

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop outputs are delivered on (the server's)."""
        return self._loop

    def stop_accepting(self) -> None:
        """Refuse new requests (EngineUnavailable); those in flight carry on."""
        self._accepting = False

    # --- requests --------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> RequestStream:
        """Queue a request and return its stream; a bad prompt or parameter raises ValueError here, at once."""
        self.check_accepting()
        self.check_room(params.n)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(self, request_id, params.output_kind)
        self.engine.add_request(request_id, prompt, params)  # validates; nothing is queued if it raises
        self._streams[request_id] = stream
        self._wake.set()
        return stream

    def check_room(self, num_seqs: int) -> None:
        """EngineOverloaded unless `num_seqs` more sequences may wait now; a server checks a whole request's
        sequences at once, so a batch is admitted entirely or not at all."""
        waiting = self.engine.num_waiting_seqs()
        if self.max_waiting_requests is not None and waiting + num_seqs > self.max_waiting_requests:
            raise EngineOverloaded(f"{waiting} sequences are waiting (limit {self.max_waiting_requests}); "
                                   "try again shortly")

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as the engine produces them; stopping early aborts the request."""
        stream = self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    async def abort(self, request_id: str) -> None:
        """Abort a request; its reader receives the final output (finish_reason "abort")."""
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        final = self.engine.abort(request_id)  # applied now, or by the step in progress, which reports it
        if final is not None:
            self._dispatch([final])
        self._wake.set()

    def abort_all(self) -> None:
        for request_id in list(self._streams):
            self.abort_nowait(request_id)

    def forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def num_unfinished(self) -> int:
        return len(self._streams)

    # --- the model's facts and text handling ----------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt and output) the engine can hold."""
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to vocab_size - 1."""
        return self.engine.config.vocab_size

    @property
    def tokenizer(self):
        """The Hugging Face tokenizer (its special tokens, chat template, `decode`)."""
        return self.engine.tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt. Blocking: a server runs it in a thread pool, off its event loop."""
        return self.engine.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            chat_template_kwargs: dict | None = None) -> list[int]:
        """Token ids of a conversation (ValueError if the template refuses it). Blocking, like `encode`."""
        return self.engine.apply_chat_template(messages, add_generation_prompt, continue_final_message,
                                               chat_template_kwargs)

    def validate(self, token_ids: list[int]) -> None:
        """ValueError if the engine could not run this prompt (empty, ids outside the vocabulary, too long)."""
        self.engine.validate(token_ids)

    def compile_grammar(self, params: SamplingParams):
        """Compile the request's structured-output grammar now (`LLMEngine.compile_grammar`), so that adding the
        request finds it compiled; hold the result until then. Blocking, like `encode`."""
        return self.engine.compile_grammar(params)

    def token_text(self, token_id: int) -> str:
        """One token's text shown on its own, as log-probs show it."""
        return self.engine.output_processor.token_text(token_id)

    def stats(self) -> dict:
        """The engine's counters and KV pool occupancy (`LLMEngine.stats`)."""
        return self.engine.stats()

    # --- the engine loop (its own thread) and delivery (on the event loop) -----------------------------

    def _engine_loop(self) -> None:
        while self._running:
            if not self.engine.has_unfinished_requests():
                self._wake.wait()
                self._wake.clear()
                continue
            self._step_started = time.monotonic()
            try:
                outputs = self.engine.step()
            except BaseException as e:  # a bug, not bad input: report it to every reader and stop
                log.exception("engine step failed; the engine stops serving")
                self.error = e
                self._loop.call_soon_threadsafe(self._fail_all, e)
                return
            finally:
                self._step_started = None
            if outputs:
                self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for listener in self.listeners:
            listener(outputs)
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.queue.put_nowait(out)
                if out.finished:
                    self._streams.pop(out.request_id, None)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDeadError())
        self._streams.clear()
        for listener in self.failure_listeners:
            listener(error)
