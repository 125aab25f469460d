"""Chapter 10 — structured output: a grammar (a JSON schema, a regex, a list of choices, an EBNF grammar) decides,
before each token is sampled, which tokens may come next, so that what the model writes always matches it.

`StructuredOutputsParams` (vLLM's name and fields) says what the output must match, and `SamplingParams(
structured_outputs=...)` carries it; it is checked when built (a ValueError naming the field). An engine's
`StructuredOutputManager` compiles it against the tokenizer with llguidance (an Earley parser over a lexer whose
token masks walk the tokenizer's trie), once per spec while it is in use or among the last few. Each sequence gets
a matcher of its own, advanced by every token the sequence emits; before sampling, `apply_masks` sets to -inf every
token the matcher refuses: EOS only where the output is complete, and nothing but EOS once nothing more may follow.
The mask allows every token whose bytes keep the output inside the grammar, however it splits the text (llguidance's
`no_forcing`: the model picks the tokenization, even where the grammar leaves one text possible), so an output the
grammar already allows comes out token for token as it would without it. llguidance's limits bound the work of
compiling a grammar and of each mask, so a hostile grammar is refused, or ends its own sequence, rather than
stalling the engine step.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections import OrderedDict
from copy import copy
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

MAX_GRAMMAR_CHARS = 1 << 15  # characters of a schema, regex, grammar or choice list (its JSON): bounds compile work
COMPILED_GRAMMARS = 64  # compiled grammars kept after their last use (those in use are kept besides)
KINDS = ("json", "regex", "choice", "grammar", "json_object")  # vLLM's constraints: exactly one is given
NO_FORCING = '%llguidance {"no_forcing": true}\n'  # every tokenization of the grammar's text is allowed
WHAT = {"json": "JSON schema", "regex": "regular expression", "choice": "list of choices",
        "grammar": "grammar (Lark or GBNF)", "json_object": "JSON object", "whitespace_pattern": "regular expression"}

log = logging.getLogger("minillm")


def llguidance():
    """The llguidance package (imported on first use: the engine runs without it until a request asks for a
    grammar)."""
    try:
        import llguidance
    except ModuleNotFoundError:
        raise ValueError("structured_outputs needs the llguidance package: pip install llguidance") from None
    return llguidance


@lru_cache(maxsize=1)
def limits():
    """llguidance's bounds on the work of building a grammar and of computing one mask (its defaults), and error
    messages that do not repeat the grammar."""
    return llguidance().LLParserLimits(verbose_errors=False)


class GrammarError(ValueError):
    """A spec the engine cannot use: the field (`json`, `regex`, ...) and why, so a server can name its own field."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"structured_outputs.{field} {reason}")
        self.field, self.reason = field, reason


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's fields): exactly one of `json` (a JSON schema: a dict or its JSON text),
    `regex`, `choice` (one of these strings), `grammar` (EBNF, in Lark or GBNF syntax) or `json_object=True` (any
    JSON object). In JSON, whitespace is free unless `disable_any_whitespace` (compact JSON) or `whitespace_pattern`
    (a regex for it) says otherwise. Checked here: a ValueError (a `GrammarError`) names the field."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}, got "
                             f"{' and '.join(given) if given else 'none'}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise GrammarError("disable_any_whitespace", f"must be True or False, got {self.disable_any_whitespace!r}")
        if self.whitespace_pattern is not None:
            if not isinstance(self.whitespace_pattern, str) or not self.whitespace_pattern:
                raise GrammarError("whitespace_pattern", f"must be a non-empty string, got {self.whitespace_pattern!r}")
            checked_grammar("whitespace_pattern", self.whitespace_pattern, False, None)
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        checked_grammar(*self.key)

    @property
    def kind(self) -> str:
        """Which constraint is given: one of `KINDS`."""
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def key(self) -> tuple[str, str, bool, str | None]:
        """What identifies the grammar: its kind, its text (a schema as JSON, keys in their order: llguidance keeps
        properties in the schema's order), and the whitespace options. A ValueError for a value of the wrong type."""
        kind, value = self.kind, getattr(self, self.kind)
        if kind == "json":
            text = _schema_text(value)
        elif kind == "json_object":
            if value is not True:
                raise GrammarError(kind, f"must be True (or None), got {value!r}")
            text = '{"type": "object"}'
        elif kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
                raise GrammarError(kind, f"must be a non-empty list of strings, got {value!r}")
            text = json.dumps(value, ensure_ascii=False)
        elif not isinstance(value, str) or not value:
            raise GrammarError(kind, f"must be a non-empty string, got {value!r}")
        else:
            text = value
        if len(text) > MAX_GRAMMAR_CHARS:
            raise GrammarError(kind, f"has {len(text)} characters; at most {MAX_GRAMMAR_CHARS} are accepted")
        return kind, text, self.disable_any_whitespace, self.whitespace_pattern


def _schema_text(schema) -> str:
    """A JSON schema (a dict, or its JSON text) as JSON text; a GrammarError unless it is a JSON object."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError("json", f"is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise GrammarError("json", "must be a JSON schema object (a dict or its JSON text), got "
                                   f"{type(schema).__name__}")
    try:
        return json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise GrammarError("json", f"is not JSON: {e}") from None


@lru_cache(maxsize=COMPILED_GRAMMARS)
def checked_grammar(kind: str, text: str, disable_any_whitespace: bool, whitespace_pattern: str | None) -> str:
    """The llguidance grammar of a spec (in Lark, the JSON schema inlined with `%json`, under `NO_FORCING`), checked
    without a tokenizer: a GrammarError naming the field if it is invalid or over the limits. Cached: a request's
    params are checked, then compiled, from the same text."""
    ll = llguidance()
    matcher = ll.LLMatcher
    try:
        if kind in ("json", "json_object"):
            options = {"whitespace_flexible": not disable_any_whitespace}
            if whitespace_pattern is not None:
                options["whitespace_pattern"] = whitespace_pattern
            grammar = matcher.grammar_from_json_schema(text, defaults=options)
        elif kind == "whitespace_pattern":
            grammar = matcher.grammar_from_regex(text)
        else:
            grammar = ll.grammar_from(kind, text)
    except ValueError as e:
        raise GrammarError(kind, f"is not a valid {WHAT[kind]}: {e}") from None
    if grammar.startswith("{"):  # llguidance's JSON form: one grammar, either in Lark or a JSON schema
        (part,) = json.loads(grammar)["grammars"]
        grammar = part["lark_grammar"] or "start: %json " + json.dumps(part["json_schema"], ensure_ascii=False)
    grammar = NO_FORCING + grammar
    failed, messages = matcher.validate_grammar_with_warnings(grammar, None, limits=limits())
    if failed:
        raise GrammarError(kind, f"is not a valid {WHAT[kind]}: {messages[0]}")
    return grammar


class CompiledGrammar:
    """A grammar compiled against one tokenizer: a matcher at the start, copied for each sequence."""

    def __init__(self, start):
        self.start = start

    def matcher(self):
        """A new matcher at the start of the grammar, for one sequence."""
        return self.start.deep_copy()


class StructuredOutputManager:
    """One engine's grammars (vLLM's name): its tokenizer as llguidance reads it (built on first use, about a
    second for a large vocabulary), and the compiled grammars, by spec: those in use, and the last
    `COMPILED_GRAMMARS` compiled. Safe from any thread (a server compiles in its tokenizer pool)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, sorted(eos_token_ids)
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._recent: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._in_use: weakref.WeakValueDictionary[tuple, CompiledGrammar] = weakref.WeakValueDictionary()

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of `params` (cached); a GrammarError if this tokenizer cannot serve it."""
        key = params.key
        with self._lock:
            compiled = self._in_use.get(key) or self._recent.get(key)
            if compiled is not None:
                self._keep(key, compiled)
                return compiled
        grammar = checked_grammar(*key)
        start = llguidance().LLMatcher(self.ll_tokenizer(), grammar, log_level=0, limits=limits())
        if start.is_error():
            raise GrammarError(key[0], f"cannot be used with this model's tokenizer: {start.get_error()}")
        compiled = CompiledGrammar(start)
        with self._lock:  # compiled outside the lock: two compiles of one spec may race, and either result serves
            compiled = self._in_use.setdefault(key, compiled)
            self._keep(key, compiled)
        return compiled

    def _keep(self, key: tuple, compiled: CompiledGrammar) -> None:
        self._recent[key] = compiled
        self._recent.move_to_end(key)
        while len(self._recent) > COMPILED_GRAMMARS:
            self._recent.popitem(last=False)

    def ll_tokenizer(self):
        """The tokenizer as llguidance reads it: every token's bytes, over the model's whole vocabulary (the width
        of its logits), with the engine's EOS tokens."""
        with self._lock:
            if self._ll_tokenizer is None:
                try:
                    spec = tokenizer_json(self.tokenizer)
                    self._ll_tokenizer = llguidance().LLTokenizer(spec, n_vocab=self.vocab_size,
                                                                  eos_token=self.eos_token_ids)
                except ValueError as e:
                    raise ValueError(f"structured_outputs cannot be used with this tokenizer: {e}") from None
            return self._ll_tokenizer


def tokenizer_json(tokenizer) -> str:
    """A fast tokenizer's JSON, as llguidance reads it to learn each token's bytes. A byte-level vocabulary whose
    decoder is a sequence ending in ByteLevel (the GGUF conversion writes ByteFallback, Fuse, Replace, ByteLevel)
    gets the plain ByteLevel decoder, which decodes its tokens the same way: llguidance would take the ByteFallback
    for a SentencePiece vocabulary and misread every token that starts with a space."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("llguidance needs a fast (Rust) tokenizer")
    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    spec = json.loads(backend.to_str())
    steps = (spec.get("decoder") or {}).get("decoders") or []
    if steps and steps[-1].get("type") == "ByteLevel":
        spec["decoder"] = steps[-1]
    return json.dumps(spec, ensure_ascii=False)


def allowed_tokens(matchers: list, vocab_size: int) -> torch.Tensor:
    """`[len(matchers), vocab_size]` booleans on the CPU: the tokens each matcher allows next, filled by llguidance
    into one bitmask (bit j of word i is token 32 i + j), one matcher after the other in this thread (each takes
    microseconds to a fraction of a millisecond). A matcher in an error state (a grammar past its step limits)
    allows nothing, so its sequence ends with "error"."""
    words = (vocab_size + 31) // 32
    bitmask = np.zeros((len(matchers), words), dtype=np.int32)
    for i, m in enumerate(matchers):
        m.unsafe_compute_mask_ptr(bitmask[i].ctypes.data, words * 4)
        if m.is_error():
            log.warning("a grammar stopped its sequence: %s", m.get_error())
            bitmask[i] = 0
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab_size, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_))
