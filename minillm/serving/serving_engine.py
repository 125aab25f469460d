"""Chapter 8 — what /v1/completions and /v1/chat/completions share (vLLM's `OpenAIServing`): the engine
behind them, tokenizing off the event loop (in a bounded pool), engine parameters from a request, admitting a
request's prompts together, waiting for final outputs while watching for the client to leave, and writing a
large response off the event loop too. Chapter 10: a request's structured-output grammar is checked and compiled
in the same pool, never on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from starlette.responses import Response

from ..engine import check_allowed_token_ids, check_stop_token_ids, truncate_prompt
from ..outputs import PositionLogprobs, RequestOutput
from ..sampling import RequestOutputKind, SamplingParams
from ..stop_strings import compile_stops
from ..structured_output import GrammarError, StructuredOutputsParams
from .async_llm import AsyncLLM, EngineOverloaded, RequestStream
from .limits import ServerLimits
from .protocol import OpenAIError, SamplingRequest

LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a log-prob of zero probability is sent as this (as vLLM does)
TOKENIZER_THREADS = 4  # tokenizing and chat templates run here, so a long prompt never stalls the event loop


class ClientDisconnected(Exception):
    """The client left before its (non-streamed) response was ready; its requests were aborted."""


@dataclass
class Served:
    """What the handlers need: the engine, the name clients use for the model, the limits, the tokenizer pool."""

    llm: AsyncLLM
    model_name: str
    limits: ServerLimits = field(default_factory=ServerLimits)
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        TOKENIZER_THREADS, thread_name_prefix="minillm-tokenizer"))
    jobs: threading.Semaphore = field(init=False)  # free places in the pool (`--max-tokenizer-jobs`)

    def __post_init__(self) -> None:
        self.jobs = threading.Semaphore(self.limits.max_tokenizer_jobs)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                              status=404, param="model", code="model_not_found")

    async def off_loop(self, fn: Callable, *args):
        """`fn(*args)` in the tokenizer pool: blocking work (tokenizing, templates) while the loop serves others.
        The pool holds at most `max_tokenizer_jobs`, waiting or running; beyond, EngineOverloaded (a 429) at once.
        A place is freed when its job ends, not when its caller stops waiting for it."""
        if not self.jobs.acquire(blocking=False):
            raise EngineOverloaded(f"the tokenizer pool is full ({self.limits.max_tokenizer_jobs} jobs, "
                                   "--max-tokenizer-jobs); try again shortly")
        try:
            job = self.pool.submit(fn, *args)
        except BaseException:
            self.jobs.release()
            raise
        job.add_done_callback(lambda _: self.jobs.release())
        return await asyncio.wrap_future(job)

    def check_prompt(self, token_ids: list[int], param: str) -> None:
        """A 400 for a prompt over the token limit, or one the engine could not run."""
        self.limits.check_prompt_tokens(len(token_ids), param)
        try:
            self.llm.validate(token_ids)
        except ValueError as e:
            too_long = "context" in str(e)
            raise OpenAIError(str(e), param=param, code="context_length_exceeded" if too_long else None) from None


def _param(message: str) -> str | None:
    """The field a ValueError from SamplingParams or the engine names first (they start with it)."""
    word = message.split(" ", 1)[0]
    return word if word.isidentifier() else None


def _or(value, default):
    return default if value is None else value


def truncate(served: Served, token_ids: list[int], keep: int | None) -> list[int]:
    """The engine's `truncate_prompt` (what `truncate_prompt_tokens` keeps), a 400 naming the field if it cannot."""
    try:
        return truncate_prompt(token_ids, keep, served.llm.max_model_len)
    except ValueError as e:
        raise OpenAIError(str(e), param="truncate_prompt_tokens") from None


def structured_outputs(req: SamplingRequest) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint on its output as the engine's parameters, and the field that gave it (None, None
    without one); a 400 naming that field if the engine cannot use it. Blocking (the grammar is checked): the
    handler runs it in the tokenizer pool."""
    given = req.constraint()
    if given is None:
        return None, None
    param, kwargs = given
    try:
        return StructuredOutputsParams(**kwargs), param
    except ValueError as e:
        raise grammar_error(e, param, req) from None


def grammar_error(e: ValueError, param: str, req: SamplingRequest) -> OpenAIError:
    """A structured-output spec the engine refused, as a 400 naming the request's field that gave it."""
    if not isinstance(e, GrammarError):
        return OpenAIError(str(e), param=param)
    if e.field == "whitespace_pattern":
        so = req.structured_outputs
        param = "structured_outputs.whitespace_pattern" if so is not None and so.whitespace_pattern is not None \
            else "guided_whitespace_pattern"
    return OpenAIError(f"{param} {e.reason}", param=param)


def compile_grammar_ahead(served: Served, req: SamplingRequest, params: SamplingParams, param: str | None):
    """Compile the request's grammar now, in the tokenizer pool (a 400 naming `param` if this model's tokenizer
    cannot serve it); the handler holds the result until the request is added, which then finds it compiled."""
    try:
        return served.llm.compile_grammar(params)
    except ValueError as e:
        raise grammar_error(e, param, req) from None


def sampling_params(served: Served, req: SamplingRequest, prompt_len: int, max_tokens: int | None,
                    logprobs: int | None, prompt_logprobs: int | None,
                    structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """The engine's parameters for one prompt of a request (`structured`: its constraint, from
    `structured_outputs`); a 400 for anything out of range."""
    max_model_len, limit = served.llm.max_model_len, served.limits.max_completion_tokens
    if max_tokens is None:
        max_tokens = max(1, max_model_len - prompt_len)
    if limit is not None:  # a default never goes past the limit (a value the client set was checked against it)
        max_tokens = min(max_tokens, limit)
    if prompt_len + max_tokens > max_model_len:
        raise OpenAIError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                          f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                          "completion). Please reduce the prompt or max_tokens.", param="max_tokens",
                          code="context_length_exceeded")
    try:
        check_stop_token_ids(req.stop_token_ids or [], served.llm.vocab_size)
        check_allowed_token_ids(req.allowed_token_ids, served.llm.vocab_size)
        return SamplingParams(
            n=req.n, temperature=_or(req.temperature, 1.0), top_p=_or(req.top_p, 1.0), top_k=req.top_k or 0,
            min_p=_or(req.min_p, 0.0), max_tokens=max_tokens, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
            seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            repetition_penalty=_or(req.repetition_penalty, 1.0), presence_penalty=_or(req.presence_penalty, 0.0),
            frequency_penalty=_or(req.frequency_penalty, 0.0), skip_special_tokens=req.skip_special_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words,  # the prompt comes truncated (`truncate`): the engine need not again
            structured_outputs=structured,
            output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY)
    except ValueError as e:
        raise OpenAIError(str(e), param=_param(str(e))) from None


def compile_stops_ahead(params: SamplingParams) -> SamplingParams:
    """Build the automaton of the request's stop strings now, in the tokenizer pool: adding the request on the
    event loop then finds it in `compile_stops`'s cache, and every prompt of a batch shares it."""
    compile_stops(tuple(params.stop))
    return params


def start(served: Served, request_id: str, prompts: list[list[int]],
          params: list[SamplingParams]) -> list[RequestStream]:
    """Add one engine request per prompt, all or none: the waiting queue must have room for every sequence."""
    served.llm.check_room(sum(p.n for p in params))
    streams: list[RequestStream] = []
    try:
        for i, (ids, p) in enumerate(zip(prompts, params)):
            streams.append(served.llm.add_request(f"{request_id}-{i}", ids, p))
    except BaseException as e:
        for s in streams:
            served.llm.abort_nowait(s.request_id)
            served.llm.forget(s.request_id)
        if isinstance(e, ValueError):  # a parameter the engine refused (a bad word outside its vocabulary)
            raise OpenAIError(str(e), param=_param(str(e))) from None
        raise
    return streams


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several requests as they come, tagged with the request's position."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as e:
            await queue.put((i, e))
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def close_all(streams: list[RequestStream]) -> None:
    for s in streams:
        await s.aclose()


async def finals(streams: list[RequestStream], disconnected: Callable) -> list[RequestOutput]:
    """Each request's final output; if the client goes away first, the requests are aborted and
    ClientDisconnected is raised (a quiet end, not an error of the server)."""
    async def last(stream: RequestStream) -> RequestOutput:
        out = None
        async for out in stream:
            pass
        return out

    work = asyncio.ensure_future(asyncio.gather(*(last(s) for s in streams)))
    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise ClientDisconnected()
        return work.result()
    finally:
        await close_all(streams)  # aborts in the engine each request still running
        work.cancel()
        gone.cancel()
        # wait for both to end and take their outcome: a cancelled gather ends with a CancelledError that,
        # left unread, asyncio logs when the future is collected ("exception was never retrieved")
        await asyncio.gather(work, gone, return_exceptions=True)


@dataclass
class Stream:
    """A streamed response: its chunks (JSON strings, then "[DONE]") and the engine requests behind them,
    which the server closes when the response ends, even one that never started (the client left first)."""

    chunks: AsyncIterator[str]
    streams: list[RequestStream]


def json_bytes(body: dict) -> bytes:
    """`body` as compact JSON, each top-level value, or each item of a top-level list or iterator, serialized by
    a call of its own: between calls the GIL passes to the event loop, and items an iterator makes are let go
    as soon as they are written, so a large body never lives whole as Python objects (nor costs the
    garbage collector long pauses)."""
    def dumps(value) -> str:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))

    def value(v) -> str:
        return "[" + ",".join(map(dumps, v)) + "]" if isinstance(v, (list, Iterator)) else dumps(v)
    return ("{" + ",".join(f"{dumps(k)}:{value(v)}" for k, v in body.items()) + "}").encode()


async def json_response(build: Callable[..., dict], *args) -> Response:
    """A non-streamed response, `build(*args)`, built and serialized in a thread: thousands of choices with
    log-probs take a while, and meanwhile the event loop keeps serving the other requests' streams."""
    return Response(await asyncio.to_thread(lambda: json_bytes(build(*args))), media_type="application/json")


def stream_usage(req: SamplingRequest) -> tuple[bool, bool]:
    """(`include_usage`, usage in every chunk): as vLLM, `continuous_usage_stats` counts only with `include_usage`."""
    opts = req.stream_options
    include = bool(opts and opts.include_usage)
    return include, include and opts.continuous_usage_stats


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def top(entry: PositionLogprobs, token_id: int, k: int) -> PositionLogprobs:
    """A position's entry cut to the token there and the `k` most likely (the engine may have kept more)."""
    return {t: x for t, x in entry.items() if t == token_id or x.rank <= k}


def prompt_logprobs_json(entries: list[PositionLogprobs | None] | None, token_ids: list[int], k: int) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": lp(x.logprob), "rank": x.rank, "decoded_token": x.decoded_token}
                                    for t, x in top(e, token_id, k).items()}
            for e, token_id in zip(entries, token_ids)]
