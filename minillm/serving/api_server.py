"""Chapter 8 — the HTTP front door: an OpenAI-compatible FastAPI app over an `AsyncLLM`.

Routes: /v1/completions, /v1/chat/completions, /v1/models (and /v1/models/{id}), /health, /metrics,
/version, and vLLM's /tokenize, /detokenize and (when enabled) /tokenizer_info. Every error a client can
cause comes back as a 4xx with an OpenAI error body `{"error": {"message", "type", "param", "code"}}`; a bug
or a failed engine is a 500 that says only "internal error" (the details go to the log). Streams are
Server-Sent Events written by sse-starlette, one `data: {json}` event per chunk and `data: [DONE]` at the end.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from .async_llm import AsyncLLM, EngineDeadError, EngineOverloaded, EngineUnavailable, RequestFailed
from .chat import chat_completion, template_error
from .completions import completion
from ..service.gateway import AUTH_FAILURE_LIMIT, AuthFailureLimit, RateLimit, RateLimiter
from .limits import ServerLimits
from .middleware import (LOOPBACK_HOSTS, ApiKeyAuth, BodyLimit, HostCheck, RequestId, api_keys, error_response,
                         host_patterns, internal_error)
from .prometheus import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, OpenAIError, TokenizeRequest
from .serving_engine import ClientDisconnected, Served, Stream, close_all

MAX_BODY_BYTES = 4 << 20  # a request body above this is refused (413) before it is read whole
BODY_TIMEOUT_S = 30.0  # a request body still arriving this long after the request began is cut (408)
# The request's OpenAI `user` field while its handler runs: chapter 9's RemoteLLM hands it to the replica
# router (session affinity) without widening the engine interface the handlers use.
REQUEST_USER: ContextVar[str | None] = ContextVar("minillm_request_user", default=None)
log = logging.getLogger("minillm.serving")


def _version() -> str:
    try:
        return importlib.metadata.version("minillm")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """The first pydantic complaint, named by its field path (`messages.0.content`).

    A field that may take several shapes (a prompt: text, token ids, or a batch of either) fails once per
    shape; those complaints are joined, and pydantic's shape names are left out of the path.
    """
    errors = exc.errors() or [{"loc": (), "msg": "invalid request", "type": ""}]
    first = errors[0]
    if first.get("type") == "json_invalid":
        return OpenAIError(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    param = _field_path(first.get("loc", ()))
    if not param and first.get("type") in ("model_attributes_type", "dict_type"):
        return OpenAIError("the request body must be a JSON object")
    msgs = dict.fromkeys(e["msg"] for e in errors if _field_path(e.get("loc", ())) == param)
    return OpenAIError(f"{param + ': ' if param else ''}{' / '.join(msgs)}", param=param or None)


def _field_path(loc) -> str:
    """`("body", "prompt", "list[int]", 0)` -> "prompt": the fields, up to the first shape name."""
    parts = []
    for p in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(p, str) and not p.isidentifier() or p in _SHAPES:
            break
        parts.append(str(p))
    return ".".join(parts)


_SHAPES = {"str", "int", "float", "bool", "list", "dict", "none", "Message", "StreamOptions", "NamedToolChoice"}


def build_app(llm: AsyncLLM, model_name: str, limits: ServerLimits | None = None,
              api_key: str | Sequence[str] | None = None, allowed_origins: list[str] | None = None,
              max_body_bytes: int = MAX_BODY_BYTES, on_started: Callable[[], None] | None = None,
              rate_limit: RateLimit | None = None, auth_failure_limit: RateLimit = AUTH_FAILURE_LIMIT,
              allowed_hosts: Sequence[str] = LOOPBACK_HOSTS, body_timeout_s: float = BODY_TIMEOUT_S,
              enable_tokenizer_info_endpoint: bool = False,
              shared_buckets: Callable[[str], object] | None = None) -> FastAPI:
    """The app; its lifespan starts the engine loop (then calls `on_started`) and stops it at shutdown.

    `api_key`: every route but /health, /metrics and /version needs it as a bearer token; several keys (a list,
    or comma-separated) are one per client. `auth_failure_limit`: the failed keys each address may send before
    a 429. `allowed_origins`: browsers on these origins may call the API (CORS); none by default.
    `rate_limit`: each client's token bucket (chapter 9's gateway), keyed by its key when there are several,
    else by its address. `allowed_hosts`: the Host header names answered (default: loopback ones; `*`: any).
    `body_timeout_s`: how long a request body may take to arrive (408 beyond). `enable_tokenizer_info_endpoint`:
    serve /tokenizer_info (it shows the chat template; off by default, as vLLM). `shared_buckets`: where the
    gateway keeps its buckets when several ingress replicas share them ("requests", "auth failures" -> a map
    with `take` and `wait` coroutines, as `gateway.LocalBuckets`); default: in this process.
    """
    served = Served(llm, model_name, limits or ServerLimits())
    metrics = ServerMetrics(llm, model_name)
    created, version = int(time.time()), _version()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await llm.start()
        if on_started is not None:
            on_started()
        yield
        await llm.stop()
        served.pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="minillm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout_s=body_timeout_s)
    if rate_limit is not None:
        app.add_middleware(RateLimiter, limit=rate_limit,
                           buckets=shared_buckets("requests") if shared_buckets else None)
    if api_key:
        app.add_middleware(ApiKeyAuth, keys=api_keys(api_key))
        app.add_middleware(AuthFailureLimit, limit=auth_failure_limit,
                           failures=shared_buckets("auth failures") if shared_buckets else None)
    app.add_middleware(HostCheck, allowed=host_patterns(allowed_hosts))
    app.add_middleware(RequestId)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["*"], expose_headers=["X-Request-Id"])
    app.state.served, app.state.metrics = served, metrics

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, e: OpenAIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        return error_response(_validation_error(e))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        messages = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}",
                    408: f"the request body did not arrive within {body_timeout_s:g} s",
                    413: f"the request body is larger than {max_body_bytes} bytes"}
        return error_response(OpenAIError(messages.get(e.status_code, str(e.detail)), status=e.status_code,
                                          headers=e.headers))

    @app.exception_handler(EngineOverloaded)
    async def _overloaded(request: Request, e: EngineOverloaded):
        metrics.rejected.labels(**metrics.labels, reason="overloaded").inc()
        return error_response(OpenAIError(str(e), status=429, type="rate_limit_error", code="server_overloaded",
                                          headers={"Retry-After": "1"}))

    @app.exception_handler(EngineUnavailable)
    async def _unavailable(request: Request, e: EngineUnavailable):
        metrics.rejected.labels(**metrics.labels, reason="unavailable").inc()
        return error_response(OpenAIError(str(e), status=503, type="service_unavailable", code="unavailable"))

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, e: EngineDeadError):
        return error_response(internal_error())  # the engine loop logged the cause

    @app.exception_handler(RequestFailed)
    async def _failed(request: Request, e: RequestFailed):
        return error_response(request_failed(e))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, e: ClientDisconnected):
        log.info("client left before its response was ready; request %s aborted", request.state.request_id)
        return error_response(OpenAIError("client disconnected"))  # never sent: nobody is listening

    async def respond(body: Response | Stream):
        if isinstance(body, Response):
            return body
        return EventSourceResponse(_sse(body.chunks), sep="\n", ping=15,
                                   background=BackgroundTask(close_all, body.streams))

    def disconnected(request: Request):
        async def wait() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        return wait

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        REQUEST_USER.set(req.user)
        return await respond(await completion(served, req, disconnected(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        REQUEST_USER.set(req.user)
        return await respond(await chat_completion(served, req, disconnected(request)))

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "minillm",
                "max_model_len": llm.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        served.check_model(model_id)
        return model_card()

    @app.get("/health")
    async def health():
        try:
            llm.check_accepting()
        except (EngineDeadError, EngineUnavailable) as e:  # failed, stuck, stopping, or (Ray) no replica up
            return error_response(OpenAIError(str(e), status=503, type="service_unavailable", code="unavailable"))
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def server_version():
        return {"version": version}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        served.check_model(req.model)
        req.check()
        if req.prompt is not None:
            served.limits.over("prompt", "characters", len(req.prompt), "max_prompt_chars")
            ids = await served.off_loop(llm.encode, req.prompt, req.add_special_tokens is not False)
        else:
            served.limits.check_messages(req.messages)
            messages = [m.template_dict(i) for i, m in enumerate(req.messages)]
            try:
                ids = await served.off_loop(llm.apply_chat_template, messages, req.add_generation_prompt,
                                            req.continue_final_message, req.chat_template_kwargs)
            except ValueError as e:
                raise template_error(e) from None
            if req.add_special_tokens:  # what the tokenizer adds to any text (a BOS), ahead of the template
                ids = llm.encode("", True) + ids
        return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        served.check_model(req.model)
        req.check()
        if bad := [t for t in req.tokens if t >= llm.vocab_size]:
            raise OpenAIError(f"token ids outside the vocabulary [0, {llm.vocab_size}): {bad[:5]}", param="tokens")
        return {"prompt": await served.off_loop(llm.tokenizer.decode, req.tokens)}

    if enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info():
            tok = llm.tokenizer
            return {"tokenizer_class": type(tok).__name__, "vocab_size": len(tok),
                    "model_max_length": llm.max_model_len, "bos_token": tok.bos_token,
                    "eos_token": tok.eos_token, "pad_token": tok.pad_token, "unk_token": tok.unk_token,
                    "chat_template": tok.chat_template}

    return app


async def _sse(chunks):
    """SSE events from a chunk generator; a failure mid-stream becomes an error event, then [DONE]."""
    try:
        async for chunk in chunks:
            yield {"data": chunk}
    except Exception as e:
        if isinstance(e, EngineUnavailable):
            error = OpenAIError(str(e), status=503, type="service_unavailable")
        elif isinstance(e, OpenAIError):
            error = e
        elif isinstance(e, RequestFailed):
            error = request_failed(e)
        else:
            if not isinstance(e, EngineDeadError):  # the engine loop logged that one
                log.exception("internal error in a stream")
            error = internal_error()
        yield {"data": json.dumps(error.body())}
        yield {"data": "[DONE]"}


def request_failed(e: RequestFailed) -> OpenAIError:
    """One request's failure, named: the engine and every other request go on."""
    return OpenAIError(str(e), status=500, type="internal_error", code="generation_failed")
