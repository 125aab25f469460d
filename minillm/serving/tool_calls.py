"""Chapter 10 — tool calls over structured output: a `tool_choice` that requires a call becomes a JSON schema the
reply is held to, and the reply becomes OpenAI's `tool_calls`.

A `tool_choice` naming a function holds the reply to that function's `parameters` schema: the reply is the call's
arguments. `"required"` holds it to one call of any of the tools, `{"name": ..., "parameters": {...}}` (vLLM's
shape). `"auto"` would need the model's free text searched for calls it chose to make, which depends on how each
model was trained to write them: it is refused, as vLLM refuses it without a tool-call parser. `"none"` leaves the
tools out altogether.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from .protocol import FunctionDefinition, Tool

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}  # a function without parameters


def arguments_schema(function: FunctionDefinition) -> dict:
    """The JSON schema of a function's arguments."""
    return function.parameters if function.parameters is not None else NO_ARGUMENTS


def tool_constraint(tools: list[Tool], call: Tool | Literal["required"]) -> tuple[str, dict]:
    """The constraint a tool choice puts on the reply: (the field it comes from, `StructuredOutputsParams`
    keywords). One tool: its arguments. "required": an object naming one of the tools, with its arguments."""
    if call != "required":
        return f"tools.{tools.index(call)}.function.parameters", {"json": arguments_schema(call.function)}
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                               "parameters": arguments_schema(t.function)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    return "tools", {"json": calls[0] if len(calls) == 1 else {"anyOf": calls}}


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def finished_call(call: Tool | Literal["required"], text: str, finish_reason: str | None,
                  stop_reason: str | int | None) -> tuple[str, str] | None:
    """The call a finished reply makes: the function's name and its arguments (JSON text). None for a reply cut
    short (by max_tokens, a stop string or a stop token), or not the JSON of a call (the stop token's text kept)."""
    if finish_reason != "stop" or stop_reason is not None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if call != "required":
        return call.function.name, text
    return value["name"], json.dumps(value["parameters"], ensure_ascii=False)


def tool_call_json(name: str, arguments: str, call_id: str) -> dict:
    """One entry of OpenAI's `message.tool_calls`."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class ToolCallStream:
    """One choice's tool call as it streams, in deltas the `openai` client accumulates: a named function's
    arguments as they come (its id and name with the first piece); for "required", the whole call once the reply
    is complete (its name is known only then). A reply cut short ends as text (for "required") or as the arguments
    so far, with its own finish_reason."""

    def __init__(self, call: Tool | Literal["required"]):
        self.call, self.text, self.id = call, "", tool_call_id()

    def delta(self, text: str, finish_reason: str | None, stop_reason: str | int | None) -> tuple[dict, str | None]:
        """The chunk's delta for this piece of the reply, and the choice's finish_reason."""
        first, self.text = not self.text, self.text + text
        done = finished_call(self.call, self.text, finish_reason, stop_reason) if finish_reason else None
        finish = "tool_calls" if done else finish_reason
        if self.call != "required":
            if not text:
                return {}, finish
            name = self.call.function.name
            piece = tool_call_json(name, text, self.id) if first else {"function": {"arguments": text}}
            return {"tool_calls": [{"index": 0, **piece}]}, finish
        if done:
            return {"tool_calls": [{"index": 0, **tool_call_json(*done, self.id)}]}, finish
        return ({"content": self.text} if finish_reason and self.text else {}), finish
