"""Chapter 8 — the OpenAI request schemas the server accepts, validated by pydantic at the edge.

Fields follow OpenAI's API and vLLM's additions (`top_k`, `min_p`, `ignore_eos`, `stop_token_ids`,
`prompt_logprobs`, `chat_template_kwargs`, ...). Every field named here is honoured, or refused with a 400
naming it when set to something the engine cannot do (`logit_bias`, `tools`, JSON mode, `suffix`, `best_of`
other than n); `user` is an end-user label and only accepted. Fields not named here are accepted and
ignored, as vLLM does. Value ranges are checked by `SamplingParams` and by the server's limits.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, StrictBool, StrictInt, StrictStr

from ..sampling import SEED_RANGE


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
Count = Annotated[StrictInt, Field(ge=0)]
Seed = Annotated[StrictInt, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])]


class StreamOptions(Request):
    include_usage: StrictBool = False  # a last chunk with the usage of the whole request
    continuous_usage_stats: StrictBool = False  # vLLM: the usage so far in every chunk


class SamplingRequest(Request):
    """Fields shared by completions and chat completions."""

    model: StrictStr | None = None
    n: Annotated[StrictInt, Field(ge=1)] = 1
    temperature: Annotated[FiniteFloat, Field(ge=0)] | None = None  # None: 1.0, as OpenAI
    top_p: Annotated[FiniteFloat, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    min_p: FiniteFloat | None = None
    seed: Seed | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: StrictBool = False
    min_tokens: Count = 0
    ignore_eos: StrictBool = False
    repetition_penalty: FiniteFloat | None = None
    presence_penalty: FiniteFloat | None = None
    frequency_penalty: FiniteFloat | None = None
    skip_special_tokens: StrictBool = True
    prompt_logprobs: Count | None = None  # vLLM: log-probs of the prompt's tokens, in the response
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # accepted at their neutral values only: the engine implements neither
    logit_bias: dict[str, Any] | None = None
    best_of: StrictInt | None = None

    def check(self) -> None:
        """A 400 naming the first field set to something this server cannot do, or that contradicts another."""
        if self.logit_bias:
            raise _unsupported("logit_bias")
        if self.best_of not in (None, self.n):
            raise _unsupported("best_of")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options is only allowed with stream set to true", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:  # as vLLM: they come in the response body
            raise OpenAIError("prompt_logprobs is not available with stream set to true", param="prompt_logprobs")


def _unsupported(field: str) -> OpenAIError:
    return OpenAIError(f"{field} is not supported by this server", param=field)


class CompletionRequest(SamplingRequest):
    """POST /v1/completions: a prompt (text or token ids, or a batch of either) to continue."""

    prompt: StrictStr | TokenIds | list[StrictStr] | list[TokenIds]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = 16
    logprobs: Count | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None

    def check(self) -> None:
        if self.suffix:
            raise _unsupported("suffix")
        super().check()

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: one string or token list each."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise OpenAIError("prompt is empty", param="prompt")
        return list(p)


class Message(Request):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None

    def template_dict(self, index: int) -> dict:
        """The message as a chat template reads it: role, text content, and the name if given."""
        return {"role": self.role, "content": self.text(index), **({"name": self.name} if self.name else {})}

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
    top_logprobs: Count | None = None
    echo: StrictBool = False  # vLLM: the reply starts with the last message's content when that is the assistant's
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False  # the last (assistant) message is left open and continued
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        if self.tools:
            raise _unsupported("tools")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise _unsupported("response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError("top_logprobs needs logprobs set to true", param="top_logprobs")
        check_continue(self.continue_final_message, self.add_generation_prompt)
        super().check()

    def echoed(self) -> str:
        """What `echo` puts before the reply: the last message's text when it is the assistant's (as vLLM)."""
        last = self.messages[-1]
        return last.text(len(self.messages) - 1) if self.echo and last.role == "assistant" else ""


def check_continue(continue_final_message: bool, add_generation_prompt: bool) -> None:
    if continue_final_message and add_generation_prompt:  # as vLLM (and the template) refuse
        raise OpenAIError("continue_final_message continues the last message, so add_generation_prompt must be "
                          "false", param="continue_final_message")


class TokenizeRequest(Request):
    """POST /tokenize (vLLM): a prompt, or messages to format with the chat template."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[Message] | None = None
    # a prompt's default is true; with messages the default is false (the template writes its own), and true puts
    # the tokenizer's own special tokens ahead of the template's, as vLLM does
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise OpenAIError("give either prompt or messages", param="prompt")
        check_continue(self.continue_final_message, self.add_generation_prompt)


class DetokenizeRequest(Request):
    """POST /detokenize (vLLM): token ids back to text."""

    model: StrictStr | None = None
    tokens: TokenIds
