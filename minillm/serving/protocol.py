"""Chapter 8 — the OpenAI request schemas the server accepts, validated by pydantic at the edge.

Fields follow OpenAI's API and vLLM's additions (`top_k`, `min_p`, `ignore_eos`, `stop_token_ids`,
`allowed_token_ids`, `bad_words`, `truncate_prompt_tokens`, `prompt_logprobs`, `chat_template_kwargs`, ...).
Every field named here is honoured, or refused with a 400 naming it when set to something the engine cannot do
(`logit_bias`, guided decoding, tools, JSON mode, beam search, `suffix`, `best_of` other than n: the `UNSUPPORTED`
tables); `user` is an end-user label and only accepted. Other fields (a typo such as `max_token`) are accepted and
ignored, as vLLM does, and logged once per request. Value ranges are checked by `SamplingParams` and by the
server's limits.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, StrictBool, StrictInt, StrictStr

from ..sampling import SEED_RANGE, check_truncate_prompt_tokens

log = logging.getLogger("minillm.serving")


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
    """A request body (or a part of one). Unknown fields are tolerated; `ignored_fields` names them.

    `UNSUPPORTED` maps the fields this server knows but cannot honour to the values that ask for nothing (their
    defaults): any other value is refused by `check_unsupported`."""

    model_config = ConfigDict(extra="allow")
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {}

    def check(self) -> None:
        """A 400 for a field this server cannot honour; a warning naming the fields that nothing reads."""
        self.check_unsupported()
        self.log_ignored()

    def check_unsupported(self) -> None:
        """A 400 naming the first field of `UNSUPPORTED` set to a value other than its neutral ones."""
        extra = self.model_extra or {}
        for name, neutral in self.UNSUPPORTED.items():
            if name in extra and extra[name] not in neutral:
                raise _unsupported(name)

    def ignored_fields(self, prefix: str = "") -> list[str]:
        """The unknown fields here and in the parts within (dotted paths): what the server leaves unread."""
        names = [prefix + k for k in self.model_extra or {} if k not in self.UNSUPPORTED]
        for name in type(self).model_fields:
            value = getattr(self, name)
            for i, part in enumerate(value if isinstance(value, list) else [value]):
                if isinstance(part, Request):
                    names += part.ignored_fields(f"{prefix}{name}.{i}." if isinstance(value, list) else
                                                 f"{prefix}{name}.")
        return names

    def log_ignored(self) -> None:
        """One warning per request naming the fields it sent that nothing reads (vLLM's wording)."""
        if names := self.ignored_fields():
            log.warning("The following fields were present in the request but ignored: {%s}",
                        ", ".join(repr(n) for n in names))


TokenIds = list[Annotated[StrictInt, Field(ge=0)]]
Count = Annotated[StrictInt, Field(ge=0)]
Seed = Annotated[StrictInt, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])]


class StreamOptions(Request):
    include_usage: StrictBool = False  # a last chunk with the usage of the whole request
    continuous_usage_stats: StrictBool = False  # vLLM: the usage so far in every chunk


# guided decoding (vLLM's guided_* fields, structured_outputs, OpenAI's JSON modes), beam search and the other
# fields the engine has no machinery for: refused unless they ask for nothing
_SHARED_UNSUPPORTED = {
    **dict.fromkeys(["guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                     "guided_whitespace_pattern", "structured_outputs", "logits_processors", "kv_transfer_params",
                     "cache_salt", "vllm_xargs"], (None,)),
    "response_format": (None, {"type": "text"}),
    "logit_bias": (None, {}),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1),  # scores beams: beam search only
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "spaces_between_special_tokens": (None, True),
    "priority": (None, 0),  # the scheduler serves requests first come, first served
}


class SamplingRequest(Request):
    """Fields shared by completions and chat completions."""

    UNSUPPORTED: ClassVar[dict[str, tuple]] = _SHARED_UNSUPPORTED

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
    allowed_token_ids: TokenIds | None = None  # vLLM: only these tokens may be sampled
    bad_words: list[StrictStr] | None = None  # vLLM: words never generated
    truncate_prompt_tokens: StrictInt | None = None  # vLLM: keep the prompt's last k tokens (-1: what fits)
    best_of: StrictInt | None = None  # accepted equal to n only: the engine returns every completion it makes

    def check(self) -> None:
        """A 400 naming the first field set to something this server cannot do, or that contradicts another; a
        warning naming the fields that nothing reads."""
        if self.best_of not in (None, self.n):
            raise _unsupported("best_of")
        try:
            check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        except ValueError as e:
            raise OpenAIError(str(e), param="truncate_prompt_tokens") from None
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options is only allowed with stream set to true", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:  # as vLLM: they come in the response body
            raise OpenAIError("prompt_logprobs is not available with stream set to true", param="prompt_logprobs")
        super().check()


def _unsupported(field: str) -> OpenAIError:
    return OpenAIError(f"{field} is not supported by this server", param=field)


class CompletionRequest(SamplingRequest):
    """POST /v1/completions: a prompt (text or token ids, or a batch of either) to continue."""

    prompt: StrictStr | TokenIds | list[StrictStr] | list[TokenIds]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = 16
    logprobs: Count | None = None
    echo: StrictBool = False
    add_special_tokens: StrictBool = True  # vLLM: the tokenizer's special tokens (a BOS) around a text prompt
    suffix: StrictStr | None = None

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {**_SHARED_UNSUPPORTED, "prompt_embeds": (None,)}

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
    add_special_tokens: StrictBool = False  # vLLM: the tokenizer's special tokens (a BOS) ahead of the template's
    parallel_tool_calls: StrictBool | None = None  # about tools, which are refused: nothing to do

    # tool and function calling, per-request templates, documents and other modalities
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **_SHARED_UNSUPPORTED, "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"),
        "function_call": (None, "none"), "chat_template": (None,), "documents": (None,), "mm_processor_kwargs": (None,),
        "audio": (None,), "modalities": (None, ["text"]), "web_search_options": (None,), "reasoning_effort": (None,)}

    def check(self) -> None:
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
        super().check()


class DetokenizeRequest(Request):
    """POST /detokenize (vLLM): token ids back to text."""

    model: StrictStr | None = None
    tokens: TokenIds
