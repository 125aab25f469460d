"""Chapter 8 — /v1/chat/completions: a conversation through the chat template into one engine request
(n completions), its outputs into OpenAI chat JSON, whole or as a stream of deltas. Chapter 10: a reply held to a
tool call comes back as `tool_calls` (`tool_calls.py`)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from starlette.responses import Response

from ..outputs import CompletionOutput, RequestOutput
from ..sampling import SamplingParams
from .async_llm import RequestStream
from .protocol import ChatCompletionRequest, OpenAIError
from .serving_engine import (Served, Stream, compile_grammar_ahead, compile_stops_ahead, finals, json_response, lp,
                             prompt_logprobs_json, sampling_params, start, stream_usage, structured_outputs, truncate,
                             usage)
from .tool_calls import ToolCallStream, finished_call, tool_call_id, tool_call_json


def template_error(e: ValueError) -> OpenAIError:
    """A chat template's refusal as a 400: on the kwargs if they were the trouble, else on the messages."""
    message = str(e)
    return OpenAIError(message, param="chat_template_kwargs" if message.startswith("chat_template_kwargs") else
                       "messages")


def prepare_chat(served: Served, req: ChatCompletionRequest) -> tuple[list[int], SamplingParams, object]:
    """The conversation's token ids, the engine parameters, and the compiled grammar of a constrained reply (held
    until the request is added). Blocking (the chat template, the grammar): the handler runs it in the tokenizer
    pool."""
    messages = [m.template_dict(i) for i, m in enumerate(req.messages)]
    kwargs = req.chat_template_kwargs
    if (tools := req.template_tools()) is not None:
        kwargs = {**(kwargs or {}), "tools": tools}
    try:
        ids = served.llm.apply_chat_template(messages, req.add_generation_prompt, req.continue_final_message, kwargs)
    except ValueError as e:
        raise template_error(e) from None
    if req.add_special_tokens:  # what the tokenizer adds to any text (a BOS), ahead of the template's
        ids = served.llm.encode("", True) + ids
    ids = truncate(served, ids, req.truncate_prompt_tokens)
    served.check_prompt(ids, "messages")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    structured, param = structured_outputs(req)
    params = compile_stops_ahead(sampling_params(served, req, len(ids), max_tokens, logprobs, req.prompt_logprobs,
                                                 structured))
    return ids, params, compile_grammar_ahead(served, req, params, param)


def chat_logprobs(served: Served, c: CompletionOutput, top: int) -> dict:
    content = []
    for token_id, entry in zip(c.token_ids, c.logprobs):
        def item(t: int, logprob: float) -> dict:
            text = served.llm.token_text(t)
            return {"token": text, "logprob": lp(logprob), "bytes": list(text.encode())}
        alternatives = sorted(entry.items(), key=lambda kv: kv[1].rank)[:top]
        content.append({**item(token_id, entry[token_id].logprob),
                        "top_logprobs": [item(t, x.logprob) for t, x in alternatives]})
    return {"content": content}


async def chat_completion(served: Served, req: ChatCompletionRequest, disconnected) -> Response | Stream:
    served.check_model(req.model)
    req.check()
    served.limits.check_chat(req, served.llm.max_waiting_requests)
    served.llm.check_room(req.n)  # a 429 before the template, if the engine is full now
    ids, params, grammar = await served.off_loop(prepare_chat, served, req)
    request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    streams = start(served, request_id, [ids], [params])
    del grammar  # held until here, so that adding the request found it compiled
    head = {"id": request_id, "object": "chat.completion", "created": created, "model": served.model_name}
    if req.stream:
        return Stream(_chat_chunks(served, req, streams[0], len(ids), {**head, "object": "chat.completion.chunk"},
                                   req.top_logprobs or 0), streams)
    (out,) = await finals(streams, disconnected)
    return await json_response(chat_body, served, req, out, ids, head)


def chat_body(served: Served, req: ChatCompletionRequest, out: RequestOutput, ids: list[int], head: dict) -> dict:
    """The non-streamed response from the request's final output; its choices are made as `json_bytes` writes
    them."""
    top = req.top_logprobs or 0
    echoed, call = req.echoed(), req.tool_call()

    def message(c: CompletionOutput) -> tuple[dict, str | None]:
        done = finished_call(call, c.text, c.finish_reason, c.stop_reason) if call is not None else None
        if done is None:
            return {"role": "assistant", "content": echoed + c.text}, c.finish_reason
        return {"role": "assistant", "content": None, "tool_calls": [tool_call_json(*done, tool_call_id())]}, \
            "tool_calls"
    choices = ({"index": c.index, "message": msg, "logprobs": chat_logprobs(served, c, top) if req.logprobs else None,
                "finish_reason": finish, "stop_reason": c.stop_reason}
               for c in out.outputs for msg, finish in [message(c)])
    body = {**head, "choices": choices, "usage": usage(len(ids), sum(len(c.token_ids) for c in out.outputs))}
    if req.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs, ids, req.prompt_logprobs)
    return body


async def _chat_chunks(served: Served, req: ChatCompletionRequest, stream: RequestStream, prompt_tokens: int,
                       head: dict, top: int) -> AsyncIterator[str]:
    include_usage, continuous = stream_usage(req)
    completion_tokens = 0
    call = req.tool_call()
    calls = [ToolCallStream(call) for _ in range(req.n)] if call is not None else None

    def chunk(choice: dict) -> str:
        body = {**head, "choices": [choice]}
        if include_usage:
            body["usage"] = usage(prompt_tokens, completion_tokens) if continuous else None
        return json.dumps(body)

    try:
        for i in range(req.n):  # the role comes first, before any token (and no content for a tool call)
            yield chunk({"index": i, "delta": {"role": "assistant", "content": None if calls else ""},
                         "logprobs": None, "finish_reason": None})
        if echoed := req.echoed():
            for i in range(req.n):
                yield chunk({"index": i, "delta": {"content": echoed}, "logprobs": None, "finish_reason": None})
        async for out in stream:
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                if calls is not None:
                    delta, finish = calls[c.index].delta(c.text, c.finish_reason, c.stop_reason)
                else:
                    delta, finish = {"content": c.text} if c.text else {}, c.finish_reason
                if not delta and not c.finished and not req.logprobs:
                    continue
                yield chunk({"index": c.index, "delta": delta,
                             "logprobs": chat_logprobs(served, c, top) if req.logprobs else None,
                             "finish_reason": finish, "stop_reason": c.stop_reason})
        if include_usage:
            yield json.dumps({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
        yield "[DONE]"
    finally:
        await stream.aclose()
