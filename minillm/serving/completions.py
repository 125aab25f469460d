"""/v1/completions and /v1/chat/completions: requests into engine requests, outputs into OpenAI JSON.

A streamed response is a sequence of chunks, each one JSON object carrying the new text of one choice;
a non-streamed one is a single object built from each request's final output. Either way the engine
sees the same requests: one per prompt, with n completions each.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..outputs import CompletionOutput, PositionLogprobs, RequestOutput
from ..sampling import RequestOutputKind, SamplingParams
from .async_llm import AsyncLLM, RequestStream
from .protocol import ChatCompletionRequest, CompletionRequest, OpenAIError, SamplingRequest

LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a log-prob of zero probability is sent as this (as vLLM does)


@dataclass
class Served:
    """What the handlers need: the engine, and the name clients use for the model."""

    llm: AsyncLLM
    model_name: str

    @property
    def engine(self):
        return self.llm.engine

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                              status=404, param="model", code="model_not_found")

    def token_text(self, token_id: int) -> str:
        return self.engine.output_processor.token_text(token_id)


def _param(message: str) -> str | None:
    """The field a ValueError from SamplingParams or the engine names first (they start with it)."""
    word = message.split(" ", 1)[0]
    return word if word.isidentifier() else None


def sampling_params(req: SamplingRequest, prompt_len: int, max_tokens: int | None, max_model_len: int,
                    logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
    """The engine's parameters for one prompt of a request; a 400 for anything out of range."""
    if max_tokens is None:
        max_tokens = max(1, max_model_len - prompt_len)
    if prompt_len + max_tokens > max_model_len:
        raise OpenAIError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                          f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                          "completion). Please reduce the prompt or max_tokens.", param="max_tokens",
                          code="context_length_exceeded")
    try:
        return SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, max_tokens=max_tokens,
            ignore_eos=req.ignore_eos, seed=req.seed, stop=req.stop, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY)
    except ValueError as e:
        raise OpenAIError(str(e), param=_param(str(e))) from None


def check_prompt(served: Served, token_ids: list[int], param: str) -> None:
    try:
        served.engine.validate(token_ids)
    except ValueError as e:
        too_long = "context" in str(e)
        raise OpenAIError(str(e), param=param, code="context_length_exceeded" if too_long else None) from None


def start(served: Served, request_id: str, prompts: list[list[int]],
          params: list[SamplingParams]) -> list[RequestStream]:
    """Add one engine request per prompt; if one is refused, the ones already added are aborted."""
    streams: list[RequestStream] = []
    try:
        for i, (ids, p) in enumerate(zip(prompts, params)):
            streams.append(served.llm.add_request(f"{request_id}-{i}", ids, p))
    except BaseException:
        for s in streams:
            served.llm.abort_nowait(s.request_id)
            served.llm.forget(s.request_id)
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


@dataclass
class Stream:
    """A streamed response: its chunks (JSON strings, then "[DONE]") and the engine requests behind them,
    which the server closes when the response ends, even one that never started (the client left first)."""

    chunks: AsyncIterator[str]
    streams: list[RequestStream]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


# --- /v1/completions -------------------------------------------------------------------------------------

@dataclass
class _CompletionLogprobs:
    """The legacy completions log-prob object, built up choice by choice: tokens, their log-probs, top
    alternatives and each token's character offset in the choice's text."""

    tokens: list
    token_logprobs: list
    top_logprobs: list
    text_offset: list

    @classmethod
    def new(cls) -> _CompletionLogprobs:
        return cls([], [], [], [])

    def add(self, served: Served, token_ids: list[int], entries: list[PositionLogprobs | None], offset: int) -> int:
        for token_id, entry in zip(token_ids, entries):
            text = served.token_text(token_id)
            self.tokens.append(text)
            self.token_logprobs.append(None if entry is None else _lp(entry[token_id].logprob))
            self.top_logprobs.append(None if entry is None else
                                     {served.token_text(t): _lp(lp.logprob) for t, lp in entry.items()})
            self.text_offset.append(offset)
            offset += len(text)
        return offset

    def json(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}


def prepare_completion(served: Served,
                       req: CompletionRequest) -> tuple[list[list[int]], list[str], list[SamplingParams]]:
    """Token ids, texts (for echo) and engine parameters of each prompt in the batch."""
    served.check_model(req.model)
    if (field := req.unsupported()) is not None:
        raise OpenAIError(f"{field} is not supported by this server", param=field)
    tokenizer, max_len = served.engine.tokenizer, served.engine.max_model_len
    ids, texts, params = [], [], []
    for prompt in req.prompts():
        token_ids = tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
        check_prompt(served, token_ids, "prompt")
        want_prompt_lps = req.logprobs if req.echo and req.logprobs is not None else None
        params.append(sampling_params(req, len(token_ids), req.max_tokens, max_len, req.logprobs, want_prompt_lps))
        ids.append(token_ids)
        texts.append(prompt if isinstance(prompt, str) else tokenizer.decode(token_ids))
    return ids, texts, params


def completion_choice(served: Served, index: int, c: CompletionOutput, prompt: list[int], prompt_text: str,
                      prompt_logprobs, echo: bool, logprobs: _CompletionLogprobs | None,
                      offset: int) -> tuple[dict, int]:
    """One choice (or one chunk's piece of it); `echo` puts the prompt first. Returns it and the new offset."""
    text = c.text
    if logprobs is not None:
        if echo:
            offset = logprobs.add(served, prompt, prompt_logprobs or [None] * len(prompt), offset)
        offset = logprobs.add(served, c.token_ids, c.logprobs, offset)
    if echo:
        text = prompt_text + text
    return {"index": index, "text": text, "logprobs": None if logprobs is None else logprobs.json(),
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}, offset


async def completion(served: Served, req: CompletionRequest, disconnected) -> dict | Stream:
    """The response body (non-streaming) or the chunks of the SSE stream (streaming)."""
    prompts, texts, params = prepare_completion(served, req)
    request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    streams = start(served, request_id, prompts, params)
    head = {"id": request_id, "object": "text_completion", "created": created, "model": served.model_name}
    if req.stream:
        return Stream(_completion_chunks(served, req, streams, prompts, texts, head), streams)
    finals = await _finals(streams, disconnected)
    choices, completion_tokens = [], 0
    for i, out in enumerate(finals):
        for c in out.outputs:
            lps = _CompletionLogprobs.new() if req.logprobs is not None else None
            choice, _ = completion_choice(served, i * req.n + c.index, c, prompts[i], texts[i],
                                          out.prompt_logprobs, req.echo, lps, 0)
            choices.append(choice)
            completion_tokens += len(c.token_ids)
    choices.sort(key=lambda c: c["index"])
    return {**head, "choices": choices, "usage": usage(sum(map(len, prompts)), completion_tokens)}


async def _completion_chunks(served: Served, req: CompletionRequest, streams: list[RequestStream],
                             prompts: list[list[int]], texts: list[str], head: dict) -> AsyncIterator[str]:
    opts = req.stream_options
    include_usage, continuous = bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats)
    prompt_tokens, completion_tokens = sum(map(len, prompts)), 0
    offsets: dict[int, int] = {}  # choice index -> characters sent (for text_offset)
    try:
        async for i, out in merged(streams):
            for c in out.outputs:
                index = i * req.n + c.index
                first = index not in offsets
                completion_tokens += len(c.token_ids)
                if not c.text and not c.finished and not (first and req.echo) and req.logprobs is None:
                    continue  # nothing to show yet (text held back, e.g. a possible stop string)
                lps = _CompletionLogprobs.new() if req.logprobs is not None else None
                choice, offsets[index] = completion_choice(
                    served, index, c, prompts[i], texts[i], out.prompt_logprobs, req.echo and first, lps,
                    offsets.get(index, 0))
                chunk = {**head, "choices": [choice]}
                if include_usage or continuous:
                    chunk["usage"] = usage(prompt_tokens, completion_tokens) if continuous else None
                yield json.dumps(chunk)
        if include_usage:
            yield json.dumps({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
        yield "[DONE]"
    finally:
        await close_all(streams)


async def _finals(streams: list[RequestStream], disconnected) -> list[RequestOutput]:
    """Each request's final output; if the client goes away first, the requests are aborted."""
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
            work.cancel()
            raise asyncio.CancelledError("client disconnected")
        return work.result()
    finally:
        gone.cancel()
        await close_all(streams)


# --- /v1/chat/completions --------------------------------------------------------------------------------

def prepare_chat(served: Served, req: ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
    served.check_model(req.model)
    if (field := req.unsupported()) is not None:
        raise OpenAIError(f"{field} is not supported by this server", param=field)
    if req.top_logprobs is not None and not req.logprobs:
        raise OpenAIError("top_logprobs needs logprobs set to true", param="top_logprobs")
    messages = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(req.messages)]
    try:
        ids = served.engine.apply_chat_template(messages)
    except ValueError as e:
        raise OpenAIError(str(e), param="messages") from None
    check_prompt(served, ids, "messages")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return ids, sampling_params(req, len(ids), max_tokens, served.engine.max_model_len, logprobs, None)


def chat_logprobs(served: Served, c: CompletionOutput, top: int) -> dict:
    content = []
    for token_id, entry in zip(c.token_ids, c.logprobs):
        def item(t: int, lp: float) -> dict:
            text = served.token_text(t)
            return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode())}
        alternatives = sorted(entry.items(), key=lambda kv: kv[1].rank)[:top]
        content.append({**item(token_id, entry[token_id].logprob),
                        "top_logprobs": [item(t, lp.logprob) for t, lp in alternatives]})
    return {"content": content}


async def chat_completion(served: Served, req: ChatCompletionRequest, disconnected) -> dict | Stream:
    ids, params = prepare_chat(served, req)
    request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    streams = start(served, request_id, [ids], [params])
    head = {"id": request_id, "object": "chat.completion", "created": created, "model": served.model_name}
    top = req.top_logprobs or 0
    if req.stream:
        return Stream(_chat_chunks(served, req, streams[0], len(ids), {**head, "object": "chat.completion.chunk"},
                                   top), streams)
    (out,) = await _finals(streams, disconnected)
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(served, c, top) if req.logprobs else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in out.outputs]
    return {**head, "choices": choices, "usage": usage(len(ids), sum(len(c.token_ids) for c in out.outputs))}


async def _chat_chunks(served: Served, req: ChatCompletionRequest, stream: RequestStream, prompt_tokens: int,
                       head: dict, top: int) -> AsyncIterator[str]:
    opts = req.stream_options
    include_usage, continuous = bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats)
    completion_tokens = 0

    def chunk(choice: dict) -> str:
        body = {**head, "choices": [choice]}
        if include_usage or continuous:
            body["usage"] = usage(prompt_tokens, completion_tokens) if continuous else None
        return json.dumps(body)

    try:
        for i in range(req.n):  # the role comes first, before any token
            yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None})
        async for out in stream:
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                if not c.text and not c.finished and not req.logprobs:
                    continue
                yield chunk({"index": c.index, "delta": {"content": c.text} if c.text else {},
                             "logprobs": chat_logprobs(served, c, top) if req.logprobs else None,
                             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        if include_usage:
            yield json.dumps({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
        yield "[DONE]"
    finally:
        await stream.aclose()
