"""Chapter 8 — the OpenAI request schemas the server accepts, validated by pydantic at the edge.

Fields follow OpenAI's API and vLLM's additions (`top_k`, `min_p`, `ignore_eos`, `stop_token_ids`,
`allowed_token_ids`, `bad_words`, `truncate_prompt_tokens`, `prompt_logprobs`, `chat_template_kwargs`, ...).
Chapter 10 adds structured output: `response_format` (JSON mode and JSON schemas), vLLM's `structured_outputs` and
its older `guided_*` fields, and `tools` with a `tool_choice` that requires a call. Every field named here is
honoured, or refused with a 400 naming it when set to something the engine cannot do (`logit_bias`, beam search,
`suffix`, `best_of` other than n, `tool_choice: "auto"`: the `UNSUPPORTED` tables and the checks below); `user` is
an end-user label and only accepted. Other fields (a typo such as `max_token`) are accepted and
ignored, as vLLM does, and logged once per request. Value ranges are checked by `SamplingParams` and by the
server's limits.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, StrictBool, StrictInt, StrictStr

from ..sampling import SEED_RANGE, check_truncate_prompt_tokens
from .tool_calls import tool_constraint

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

    def check_unsupported(self, prefix: str = "") -> None:
        """A 400 naming the first field of `UNSUPPORTED` set to a value other than its neutral ones (its path under
        `prefix` in a part of the body)."""
        extra = self.model_extra or {}
        for name, neutral in self.UNSUPPORTED.items():
            if name in extra and extra[name] not in neutral:
                raise _unsupported(prefix + name)

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


class JsonSchemaFormat(Request):
    """OpenAI's `response_format.json_schema`: the schema the reply must match (`strict` or not: it always does)."""

    name: StrictStr
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(Request):
    """OpenAI's `response_format`: free text, any JSON object (JSON mode), or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Request):
    """vLLM's `structured_outputs` object: one constraint (json, regex, choice, grammar, json_object) and the JSON
    whitespace options; there is one grammar backend (llguidance) and nothing to fall back to."""

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {"structural_tag": (None,),
                                               "disable_additional_properties": (None, False)}

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool = False
    whitespace_pattern: StrictStr | None = None
    disable_fallback: StrictBool = False  # a constraint is always enforced here: there is no fallback to disable


# the constraints of structured output, as (field name in a request, StructuredOutputsParams field)
_STRUCTURED = (("json_", "json"), ("regex", "regex"), ("choice", "choice"), ("grammar", "grammar"),
               ("json_object", "json_object"))
_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))

# beam search and the other fields the engine has no machinery for: refused unless they ask for nothing
_SHARED_UNSUPPORTED = {
    **dict.fromkeys(["logits_processors", "kv_transfer_params", "cache_salt", "vllm_xargs"], (None,)),
    "guided_decoding_backend": (None, "auto", "guidance"),  # the one backend is llguidance (vLLM's "guidance")
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
    # chapter 10, structured output: at most one of these constrains a request's output
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | StrictStr | None = None  # vLLM's older names for structured_outputs' fields
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    guided_whitespace_pattern: StrictStr | None = None

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
        if self.structured_outputs is not None:
            self.structured_outputs.check_unsupported("structured_outputs.")
        self.constraint()
        super().check()

    def constraints(self) -> list[tuple[str, dict]]:
        """Each constraint on the output the request gives: (the field that gives it, `StructuredOutputsParams`
        keywords)."""
        found = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise OpenAIError("response_format.json_schema is required with type json_schema",
                                  param="response_format.json_schema")
            if fmt.json_schema.schema_ is None:
                raise OpenAIError("response_format.json_schema.schema is required: the JSON schema of the reply",
                                  param="response_format.json_schema.schema")
            found.append(("response_format.json_schema.schema", {"json": fmt.json_schema.schema_}))
        so = self.structured_outputs
        found += [(f"structured_outputs.{kind}", {kind: getattr(so, name)}) for name, kind in _STRUCTURED
                  if so is not None and getattr(so, name) is not None]
        found += [(name, {kind: getattr(self, name)}) for name, kind in _GUIDED if getattr(self, name) is not None]
        return found

    def constraint(self) -> tuple[str, dict] | None:
        """The one constraint on the output (None without one), with the JSON whitespace options: a 400 if several
        are given, or options without a constraint."""
        found = self.constraints()
        if len(found) > 1:
            raise OpenAIError(f"{found[1][0]} and {found[0][0]} both constrain the output; give one",
                              param=found[1][0])
        so = self.structured_outputs
        options = {}
        if so is not None:
            options["disable_any_whitespace"] = so.disable_any_whitespace
        pattern = so.whitespace_pattern if so is not None and so.whitespace_pattern is not None else \
            self.guided_whitespace_pattern
        if pattern is not None:
            options["whitespace_pattern"] = pattern
        if not found:
            if so is not None:
                raise OpenAIError("structured_outputs needs one of json, regex, choice, grammar, json_object",
                                  param="structured_outputs")
            return None
        param, kwargs = found[0]
        return param, {**kwargs, **options}


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
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls, for the template to show
    tool_call_id: StrictStr | None = None  # a tool's reply: the call it answers

    def template_dict(self, index: int) -> dict:
        """The message as a chat template reads it: role, text content, and the name, tool calls and tool call id
        if given."""
        extra = {k: getattr(self, k) for k in ("name", "tool_calls", "tool_call_id") if getattr(self, k)}
        return {"role": self.role, "content": self.text(index), **extra}

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


class FunctionDefinition(Request):
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # the JSON schema of its arguments (None: takes none)
    strict: StrictBool | None = None  # the arguments always match the schema here


class Tool(Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Request):
    name: StrictStr


class NamedToolChoice(Request):
    type: Literal["function"]
    function: FunctionName


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
    # chapter 10: tools the reply may call, and whether it must (see tool_calls.py)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: "auto" with tools
    parallel_tool_calls: StrictBool | None = None  # a reply makes one call, which either value allows

    # the older function calling, per-request templates, documents and other modalities
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **_SHARED_UNSUPPORTED, "functions": (None, []), "function_call": (None, "none"), "chat_template": (None,),
        "documents": (None,), "mm_processor_kwargs": (None,), "audio": (None,), "modalities": (None, ["text"]),
        "web_search_options": (None,), "reasoning_effort": (None,)}

    def check(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError("top_logprobs needs logprobs set to true", param="top_logprobs")
        check_continue(self.continue_final_message, self.add_generation_prompt)
        self.tool_call()
        super().check()

    def tool_call(self) -> Tool | Literal["required"] | None:
        """What `tool_choice` asks for: a call of this tool, of any tool ("required"), or none (free text, the tools
        left out); a 400 for "auto" (as vLLM without a tool-call parser), which is the default when tools are
        given, and for a choice the tools cannot meet."""
        tools = self.tools or []
        choice = self.tool_choice if self.tool_choice is not None else "auto" if tools else "none"
        if choice == "none":
            return None
        if not tools:
            raise OpenAIError(f"tool_choice {choice!r} needs tools", param="tool_choice")
        names = [t.function.name for t in tools]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise OpenAIError(f"tools.{i}.function.name: {name!r} names two tools",
                                  param=f"tools.{i}.function.name")
        if choice == "auto":
            raise OpenAIError('tool_choice "auto" is not supported: this server does not parse tool calls out of free '
                              'text. Use "required", {"type": "function", "function": {"name": ...}} or "none"',
                              param="tool_choice")
        if choice == "required":
            return choice
        if choice.function.name not in names:
            raise OpenAIError(f"tool_choice.function.name: no tool is named {choice.function.name!r}",
                              param="tool_choice.function.name")
        return tools[names.index(choice.function.name)]

    def constraints(self) -> list[tuple[str, dict]]:
        """Those any request may give, and the one a tool choice that requires a call puts on the reply."""
        call = self.tool_call()
        return super().constraints() + ([tool_constraint(self.tools, call)] if call is not None else [])

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template reads them (its `tools` variable), unless tool_choice leaves them out."""
        if self.tool_call() is None:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

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
