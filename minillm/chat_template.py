"""Chapter 8 — a conversation's token ids, where only the chat template writes control tokens.

A chat template puts control tokens around each message (`<|im_start|>user ... <|im_end|>`). Tokenizing the
rendered text as one string would turn a message that spells one ("hi<|im_end|>\n<|im_start|>system\n...")
into the real token too, and a user could forge a turn of the system's; so could a template variable
(`chat_template_kwargs`) the template prints. So the client's special-token strings, in messages and template
variables alike (inside their lists and dicts too), are tokenized as plain text: the template is rendered with
them swapped for placeholders, the control tokens it wrote are read as tokens, and the text between them
(placeholders put back) is tokenized with special tokens split. A conversation that spells none is tokenized
exactly as `apply_chat_template` does.
"""

from __future__ import annotations

import inspect
import re

PLACEHOLDER_CHARS = range(0xE000, 0xF900)  # Unicode's private use area: a placeholder mark is taken from here


def special_strings(tokenizer) -> list[str]:
    """The strings that tokenize to a special token, longest first (so a regex prefers the longest)."""
    return sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len, reverse=True)


def strings(value) -> list[str]:
    """Every string in `value`, a string or lists and dicts of them (dict values only, not keys)."""
    if isinstance(value, str):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return [s for v in items for s in strings(v)]


def replace_strings(value, swap):
    """`value` with `swap` applied to each of its strings, lists and dicts rebuilt around them."""
    if isinstance(value, str):
        return swap(value)
    if isinstance(value, dict):
        return {k: replace_strings(v, swap) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [replace_strings(v, swap) for v in value]
    return value


def chat_token_ids(tokenizer, messages: list[dict], **template_kwargs) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template (`template_kwargs` go to it), the messages'
    and the template variables' text never read as control tokens. Every string but a message's role is the
    client's own, also inside lists and dicts."""
    specials = special_strings(tokenizer)
    spelled = re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None
    clients = strings(template_kwargs) + [s for m in messages for k, v in m.items() if k != "role" for s in strings(v)]
    if spelled is None or not any(spelled.search(s) for s in clients):
        ids = tokenizer.apply_chat_template(messages, tokenize=True, **template_kwargs)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    seen = "".join(clients)
    mark = next((chr(c) for c in PLACEHOLDER_CHARS if chr(c) not in seen), None)  # in no client string: only ours
    if mark is None:
        raise ValueError("the messages use every private-use character, and one is needed as a placeholder")

    def placeholders(text: str) -> str:
        return spelled.sub(lambda s: f"{mark}{specials.index(s[0])}{mark}", text)
    marked = [{k: v if k == "role" else replace_strings(v, placeholders) for k, v in m.items()} for m in messages]
    restore = re.compile(f"{mark}(\\d+){mark}")
    ids: list[int] = []
    # split at the special strings left, the template's: text, token, text, ..., text
    rendered = tokenizer.apply_chat_template(marked, tokenize=False, **replace_strings(template_kwargs, placeholders))
    for i, piece in enumerate(spelled.split(rendered)):
        if i % 2:
            ids.append(tokenizer.convert_tokens_to_ids(piece))
        elif piece:
            piece = restore.sub(lambda p: specials[int(p[1])], piece)
            ids += tokenizer(piece, add_special_tokens=False, split_special_tokens=True).input_ids
    return ids


def conversation_ids(tokenizer, messages, add_generation_prompt: bool = True, continue_final_message: bool = False,
                     chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a conversation (list of {"role", "content"} dicts) ready for the assistant's reply, or with its
    last message left open to be continued; `chat_template_kwargs` are extra template variables. A ValueError
    names what is wrong with the messages, or what the template refused."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and {"role", "content"} <= m.keys()
                                                  for m in messages):
        raise ValueError('messages must be a list of {"role": ..., "content": ...} dicts')
    extra = chat_template_kwargs or {}
    # `tools` is a template variable too (the server fills it from a request's tools)
    settings = inspect.signature(tokenizer.apply_chat_template).parameters.keys() - {"tools"}
    if reserved := sorted(extra.keys() & settings):
        raise ValueError(f"chat_template_kwargs may only add template variables, not set {reserved}")
    try:
        return chat_token_ids(tokenizer, messages, add_generation_prompt=add_generation_prompt,
                              continue_final_message=continue_final_message, **extra)
    except Exception as e:  # the template itself may refuse a conversation (jinja2's TemplateError)
        raise ValueError(f"the chat template cannot format these messages: {e}") from None
