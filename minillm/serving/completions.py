"""Chapter 8 — /v1/completions: prompts into engine requests, outputs into OpenAI JSON.

A streamed response is a sequence of chunks, each one JSON object carrying the new text of one choice;
a non-streamed one is a single object built from each request's final output. Either way the engine
sees the same requests: one per prompt, with n completions each.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from starlette.responses import Response

from ..outputs import CompletionOutput, PositionLogprobs, RequestOutput
from ..sampling import SamplingParams
from .async_llm import RequestStream
from .protocol import CompletionRequest
from .serving_engine import (Served, Stream, close_all, compile_grammar_ahead, compile_stops_ahead, finals,
                             json_response, lp, merged, prompt_logprobs_json, sampling_params, start, stream_usage,
                             structured_outputs, top, truncate, usage)


@dataclass
class _CompletionLogprobs:
    """The legacy completions log-prob object, built up choice by choice: tokens, their log-probs, the top `k`
    alternatives and each token's character offset in the choice's text."""

    k: int
    tokens: list
    token_logprobs: list
    top_logprobs: list
    text_offset: list

    @classmethod
    def new(cls, k: int) -> _CompletionLogprobs:
        return cls(k, [], [], [], [])

    def add(self, served: Served, token_ids: list[int], entries: list[PositionLogprobs | None], offset: int) -> int:
        for token_id, entry in zip(token_ids, entries):
            text = served.llm.token_text(token_id)
            self.tokens.append(text)
            self.token_logprobs.append(None if entry is None else lp(entry[token_id].logprob))
            self.top_logprobs.append(None if entry is None else {served.llm.token_text(t): lp(x.logprob)
                                                                 for t, x in top(entry, token_id, self.k).items()})
            self.text_offset.append(offset)
            offset += len(text)
        return offset

    def json(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}


def prepare_completion(served: Served,
                       req: CompletionRequest) -> tuple[list[list[int]], list[str], list[SamplingParams], object]:
    """Token ids, texts (for echo) and engine parameters of each prompt in the batch, and the compiled grammar
    they share if the output is constrained (held until the requests are added). Blocking (it tokenizes, checks
    the grammar): the handler runs it in the tokenizer pool."""
    echo_k = req.logprobs if req.echo else None  # echoed prompt tokens come with their log-probs
    prompt_k = max((k for k in (echo_k, req.prompt_logprobs) if k is not None), default=None)
    structured, param = structured_outputs(req)
    ids, texts, params = [], [], []
    for prompt in req.prompts():
        given = served.llm.encode(prompt, req.add_special_tokens) if isinstance(prompt, str) else list(prompt)
        token_ids = truncate(served, given, req.truncate_prompt_tokens)
        served.check_prompt(token_ids, "prompt")
        params.append(sampling_params(served, req, len(token_ids), req.max_tokens, req.logprobs, prompt_k, structured))
        ids.append(token_ids)
        whole = isinstance(prompt, str) and len(token_ids) == len(given)
        texts.append(prompt if whole else served.llm.tokenizer.decode(token_ids))
    compile_stops_ahead(params[0])  # the same stop strings and grammar for every prompt
    return ids, texts, params, compile_grammar_ahead(served, req, params[0], param)


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


async def completion(served: Served, req: CompletionRequest, disconnected) -> Response | Stream:
    """The response (non-streaming) or the chunks of the SSE stream (streaming)."""
    served.check_model(req.model)
    req.check()
    served.limits.check_completion(req, served.llm.max_waiting_requests)
    served.llm.check_room(len(req.prompts()) * req.n)  # a 429 before tokenizing, if the engine is full now
    prompts, texts, params, grammar = await served.off_loop(prepare_completion, served, req)
    request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    streams = start(served, request_id, prompts, params)
    del grammar  # held until here, so that adding the requests found it compiled
    head = {"id": request_id, "object": "text_completion", "created": created, "model": served.model_name}
    if req.stream:
        return Stream(_completion_chunks(served, req, streams, prompts, texts, head), streams)
    return await json_response(completion_body, served, req, await finals(streams, disconnected), prompts, texts, head)


def completion_body(served: Served, req: CompletionRequest, outs: list[RequestOutput], prompts: list[list[int]],
                    texts: list[str], head: dict) -> dict:
    """The non-streamed response from each prompt's final output. Its choices are made one at a time as
    `json_bytes` writes them, so a large body never lives whole as Python objects."""
    def choices() -> Iterator[dict]:
        for i, out in enumerate(outs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                lps = _CompletionLogprobs.new(req.logprobs) if req.logprobs is not None else None
                choice, _ = completion_choice(served, i * req.n + c.index, c, prompts[i], texts[i],
                                              out.prompt_logprobs, req.echo, lps, 0)
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs, prompts[i],
                                                                     req.prompt_logprobs)
                yield choice
    completion_tokens = sum(len(c.token_ids) for out in outs for c in out.outputs)
    return {**head, "choices": choices(), "usage": usage(sum(map(len, prompts)), completion_tokens)}


async def _completion_chunks(served: Served, req: CompletionRequest, streams: list[RequestStream],
                             prompts: list[list[int]], texts: list[str], head: dict) -> AsyncIterator[str]:
    include_usage, continuous = stream_usage(req)
    prompt_tokens, completion_tokens = sum(map(len, prompts)), 0
    offsets: dict[int, int] = {}  # choice index -> characters sent (for text_offset)
    prompt_lps: dict[int, list] = {}  # prompt -> its log-probs, which come once for all its n choices
    try:
        async for i, out in merged(streams):
            if out.prompt_logprobs is not None:
                prompt_lps[i] = out.prompt_logprobs
            for c in out.outputs:
                index = i * req.n + c.index
                first = index not in offsets
                completion_tokens += len(c.token_ids)
                if not c.text and not c.finished and not (first and req.echo) and req.logprobs is None:
                    continue  # nothing to show yet (text held back, e.g. a possible stop string)
                lps = _CompletionLogprobs.new(req.logprobs) if req.logprobs is not None else None
                choice, offsets[index] = completion_choice(
                    served, index, c, prompts[i], texts[i], prompt_lps.get(i), req.echo and first, lps,
                    offsets.get(index, 0))
                chunk = {**head, "choices": [choice]}
                if include_usage:
                    chunk["usage"] = usage(prompt_tokens, completion_tokens) if continuous else None
                yield json.dumps(chunk)
        if include_usage:
            yield json.dumps({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
        yield "[DONE]"
    finally:
        await close_all(streams)
