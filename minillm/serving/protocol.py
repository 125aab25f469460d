"""The OpenAI request schemas the server accepts, validated by pydantic at the edge.

Fields follow OpenAI's API and vLLM's additions (`top_k`, `ignore_eos`, `continuous_usage_stats`).
Unknown fields are accepted and ignored, as vLLM does. Known features the engine does not implement
(penalties, logit bias, tools, JSON mode, `suffix`) are refused with a 400 naming the field rather than
silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, StrictBool, StrictInt, StrictStr

from ..sampling import MAX_LOGPROBS, MAX_N, SEED_RANGE


class OpenAIError(Exception):
    """A client error, turned into an OpenAI-style error body `{"error": {message, type, param, code}}`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are tolerated


TokenIds = list[Annotated[StrictInt, Field(ge=0)]]
Seed = Annotated[StrictInt, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])]


class StreamOptions(Request):
    include_usage: StrictBool = False  # a last chunk with the usage of the whole request
    continuous_usage_stats: StrictBool = False  # vLLM: the usage so far in every chunk


class SamplingRequest(Request):
    """Fields shared by completions and chat completions."""

    model: StrictStr | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    temperature: Annotated[FiniteFloat, Field(ge=0)] | None = None  # None: 1.0, as OpenAI
    top_p: Annotated[FiniteFloat, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    seed: Seed | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    user: StrictStr | None = None
    # accepted at their neutral values only: the engine implements none of them
    presence_penalty: FiniteFloat | None = None
    frequency_penalty: FiniteFloat | None = None
    logit_bias: dict[str, Any] | None = None
    best_of: StrictInt | None = None

    def unsupported(self) -> str | None:
        """The first field set to something the engine cannot do, if any."""
        if self.presence_penalty:
            return "presence_penalty"
        if self.frequency_penalty:
            return "frequency_penalty"
        if self.logit_bias:
            return "logit_bias"
        if self.best_of not in (None, self.n):
            return "best_of"
        return None


class CompletionRequest(SamplingRequest):
    """POST /v1/completions: a prompt (text or token ids, or a batch of either) to continue."""

    prompt: StrictStr | TokenIds | list[StrictStr] | list[TokenIds]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = 16
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None

    def unsupported(self) -> str | None:
        return "suffix" if self.suffix else super().unsupported()

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: one string or token list each."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise OpenAIError("prompt is empty", param="prompt")
        return list(p)


class TextPart(Request):
    type: Literal["text"]
    text: StrictStr


class Message(Request):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None

    def text(self, index: int) -> str:
        """The message's text: a string, or a list of text parts joined (other parts are refused)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError(f"only text content parts are supported, got {part.get('type')!r}",
                                  param=f"messages.{index}.content.{j}")
            texts.append(part["text"])
        return "\n".join(texts)


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions: a conversation to answer."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None  # None: up to the end of the context
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools"
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return "response_format"
        return super().unsupported()


class TokenizeRequest(Request):
    """POST /tokenize (vLLM): a prompt, or messages to format with the chat template."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[Message] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(Request):
    """POST /detokenize (vLLM): token ids back to text."""

    model: StrictStr | None = None
    tokens: TokenIds
