"""Structured output (chapter 10) on a tiny random model, whose free output is noise: under a grammar every sample
matches it (a JSON schema, a regex, a choice, an EBNF grammar), a greedy output the grammar already allows is left
token for token as it was (then ends on EOS), each of n sequences advances its own matcher, unconstrained neighbours
in the batch are untouched, preemption and speculative decoding keep it exact, and a bad spec is refused by name.
Through the server: `response_format`, `structured_outputs`, the `guided_*` fields and tool calls, with the official
`openai` client."""

import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest
import torch

from conftest import requires_default_model
from minillm import LLM, SamplingParams
from minillm.sampling import StructuredOutputsParams
from minillm.spec_decode import speculates
from minillm.structured_output import COMPILED_GRAMMARS, MAX_GRAMMAR_CHARS, allowed_tokens
from serving_utils import serve_engine, stream_json, tiny_engine, wait_idle

pytest.importorskip("llguidance")

ENGINE = dict(device="cpu", dtype=torch.float32, block_size=4, num_kv_blocks=1024)
PROMPT = "The quick brown fox"
# held out from the engine's code: a nested object, an enum of mixed types, an array, bounded integers; strings
# and lengths bounded, so that even noise ends within the tiny model's 256-token context
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "kind": {"enum": ["cat", "dog", 3, None]},
        "age": {"type": "integer", "minimum": -5, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[A-Z]{1,3}$"}, "minItems": 1,
                 "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                                                   "ok": {"type": "boolean"}},
                  "required": ["id", "ok"], "additionalProperties": False},
        "note": {"type": "string", "pattern": "^[0-9]{2}$"},  # optional
    },
    "required": ["name", "kind", "age", "tags", "owner"],
    "additionalProperties": False,
}
COMPACT_SCHEMA = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
REGEX = r"(yes|no)-[0-9]{2,4}"
CHOICES = ["alpha", "beta", "gamma delta"]
GBNF = 'root ::= "sum(" num "," num ")"\nnum ::= [0-9] | [1-9] [0-9]'


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, **ENGINE)


def sampled(llm, spec: StructuredOutputsParams, count: int, max_tokens: int = 200, **kw) -> list:
    """`count` completions at temperature 1, one seed each."""
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, structured_outputs=spec, **kw)
              for i in range(count)]
    return [o.outputs[0] for o in llm.generate([PROMPT] * count, params, use_tqdm=False)]


def all_blocks_free(llm) -> bool:
    stats = llm.stats()
    return stats["kv_blocks_free"] == stats["kv_blocks_total"]


# --- what is generated ---------------------------------------------------------------------------------------------

def test_200_samples_of_noise_all_match_a_held_out_schema(llm):
    eos = llm.get_tokenizer().eos_token_id
    outs = sampled(llm, COMPACT_SCHEMA, 200)
    for out in outs:
        assert out.finish_reason == "stop" and out.token_ids[-1] == eos, out
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({o.text for o in outs}) > 150  # noise: nearly every sample differs
    assert all_blocks_free(llm)


def test_regex_choice_and_grammar_hold_for_every_seed(llm):
    for out in sampled(llm, StructuredOutputsParams(regex=REGEX), 40):
        assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text), out.text
    choices = sampled(llm, StructuredOutputsParams(choice=CHOICES), 40)
    assert {o.text for o in choices} == set(CHOICES)  # each seen, nothing else
    for out in sampled(llm, StructuredOutputsParams(grammar=GBNF), 40):
        assert re.fullmatch(r"sum\(([0-9]|[1-9][0-9]),([0-9]|[1-9][0-9])\)", out.text), out.text


def test_json_whitespace_is_free_unless_disabled(llm):
    items = {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2}
    spaced = [o.text for o in sampled(llm, StructuredOutputsParams(json=items, whitespace_pattern="[ ]{1,2}"), 30)]
    compact = [o.text for o in sampled(llm, StructuredOutputsParams(json=items, disable_any_whitespace=True), 30)]
    for text in spaced + compact:
        assert set(json.loads(text)) <= {1, 2} and len(json.loads(text)) <= 2, text
    assert any(" " in t for t in spaced) and not any(re.search(r"\s", t.replace(" ", "")) for t in spaced)
    assert not any(re.search(r"\s", t) for t in compact)


def test_greedy_output_the_grammar_allows_is_unchanged(llm):
    """Free greedy output over letters, digits and spaces (random weights alone write stray bytes), then the same
    with a grammar that allows exactly that text: the same tokens, then EOS."""
    tok = llm.get_tokenizer()
    plain = [i for i in range(len(tok)) if (t := tok.decode([i])) and all(c.isascii() and (c.isalnum() or c == " ")
                                                                          for c in t)]
    free = llm.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True, allowed_token_ids=plain),
                        use_tqdm=False)[0].outputs[0]
    exact = "".join(c if c.isalnum() else f"\\x{{{ord(c):X}}}" for c in free.text)
    for spec in (StructuredOutputsParams(choice=[free.text, "other"]), StructuredOutputsParams(regex=exact)):
        params = SamplingParams(max_tokens=30, allowed_token_ids=plain + [tok.eos_token_id], structured_outputs=spec)
        out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
        assert (out.token_ids, out.text, out.finish_reason) == (free.token_ids + [tok.eos_token_id], free.text, "stop")


def test_a_complete_output_ends_on_eos_even_with_ignore_eos(llm):
    eos = llm.get_tokenizer().eos_token_id
    out = llm.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=0,
                                              structured_outputs=StructuredOutputsParams(choice=["ab"])),
                       use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.token_ids[-1]) == ("ab", "stop", eos)


def test_each_of_n_sequences_has_its_own_matcher_and_neighbours_are_untouched(llm):
    regex = StructuredOutputsParams(regex=REGEX)
    free = SamplingParams(max_tokens=10, ignore_eos=True)
    free_seeded = SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, seed=5)
    constrained = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=40, structured_outputs=regex)
    json_one = SamplingParams(temperature=1.0, seed=3, max_tokens=200, structured_outputs=COMPACT_SCHEMA)
    prompts = [PROMPT, "Prefill builds the cache", "1 2 3 4", "Le modèle lit"]
    together = llm.generate(prompts, [constrained, free, free_seeded, json_one], use_tqdm=False)
    alone = [llm.generate(p, s, use_tqdm=False)[0] for p, s in zip(prompts[1:], [free, free_seeded, json_one])]
    assert [o.outputs[0].token_ids for o in together[1:]] == [o.outputs[0].token_ids for o in alone]
    siblings = [llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=11 + i, max_tokens=40,
                                                    structured_outputs=regex), use_tqdm=False)[0].outputs[0]
                for i in range(2)]
    assert [c.token_ids for c in together[0].outputs] == [c.token_ids for c in siblings]
    assert all(re.fullmatch(REGEX, c.text) for c in together[0].outputs)


def test_preempted_sequences_keep_their_grammar(tiny_llama, llm):
    small = LLM(tiny_llama, **dict(ENGINE, num_kv_blocks=40))  # too few blocks for all six: some are preempted
    prompts = [PROMPT, "Prefill builds the cache", "1 2 3 4", "Le modèle lit", "decode reads it", "模型逐个"]
    params = SamplingParams(max_tokens=200, structured_outputs=COMPACT_SCHEMA)
    got = [o.outputs[0] for o in small.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert small.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for out in got:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert all_blocks_free(small)


def test_constrained_sequences_are_not_drafted(tiny_llama, llm, monkeypatch):
    import minillm.engine

    assert not speculates(SamplingParams(structured_outputs=COMPACT_SCHEMA), 0) and speculates(SamplingParams(), 0)
    spec = LLM(tiny_llama, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **ENGINE)
    monkeypatch.setattr(minillm.engine, "propose_ngram", lambda tokens, k, *_: [5] * k)  # a draft at every step
    spec.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    drafted = spec.stats()["spec_decode_num_drafts"]
    assert drafted > 0
    params = SamplingParams(max_tokens=60, structured_outputs=StructuredOutputsParams(regex="[0-9a-z ]{1,40}!"))
    got = spec.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert spec.stats()["spec_decode_num_drafts"] == drafted
    assert got.token_ids == llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids


def test_compiled_grammars_are_cached_by_spec(llm):
    manager = llm.engine.structured_output
    held = manager.compile(COMPACT_SCHEMA)
    assert manager.compile(StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True)) is held
    assert manager.compile(StructuredOutputsParams(json=SCHEMA)) is not held  # whitespace is part of the grammar
    dropped = StructuredOutputsParams(regex="a")
    manager.compile(dropped)  # not held by anyone: kept only while among the last COMPILED_GRAMMARS
    for i in range(COMPILED_GRAMMARS):
        manager.compile(StructuredOutputsParams(regex=f"b{{{i + 1}}}"))
    assert dropped.key not in manager._recent and dropped.key not in manager._in_use
    assert manager.compile(COMPACT_SCHEMA) is held  # in use: kept however many came since


def test_a_matcher_in_error_allows_nothing(llm):
    tok = llm.get_tokenizer()
    compiled = llm.engine.structured_output.compile(StructuredOutputsParams(regex="ab"))
    fine, broken = compiled.matcher(), compiled.matcher()
    (b,) = tok("b", add_special_tokens=False).input_ids
    assert not broken.consume_token(b) and broken.is_error()  # "b" cannot start "ab"
    allowed = allowed_tokens([fine, broken], len(tok))
    (a,) = tok("a", add_special_tokens=False).input_ids
    assert allowed[0, a] and not allowed[0, b] and not allowed[1].any()


# --- what is refused -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,field", [
    ({}, "structured_outputs needs exactly one"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs needs exactly one"),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "structured_outputs.json"),
    ({"json": {"type": "strnig"}}, "structured_outputs.json"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": [1]}, "structured_outputs.json"),
    ({"regex": "(unclosed"}, "structured_outputs.regex"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 1]}, "structured_outputs.choice"),
    ({"grammar": "root ::= (("}, "structured_outputs.grammar"),
    ({"json_object": False}, "structured_outputs.json_object"),
    ({"regex": "a" * (MAX_GRAMMAR_CHARS + 1)}, "structured_outputs.regex"),
    ({"json_object": True, "whitespace_pattern": "[ "}, "structured_outputs.whitespace_pattern"),
    ({"json_object": True, "disable_any_whitespace": 1}, "structured_outputs.disable_any_whitespace"),
])
def test_bad_specs_are_refused_by_name(kwargs, field):
    with pytest.raises(ValueError) as e:
        StructuredOutputsParams(**kwargs)
    assert str(e.value).startswith(field), str(e.value)


def test_sampling_params_take_only_a_structured_outputs_params(llm):
    with pytest.raises(ValueError, match="^structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})
    with pytest.raises(ValueError, match="^min_tokens cannot be used with structured_outputs"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))
    assert all_blocks_free(llm) and not llm.engine.has_unfinished_requests()


# --- through the server --------------------------------------------------------------------------------------------

MODEL = "test-model"
MESSAGES = [{"role": "user", "content": "Describe a pet."}]
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(pattern="^[a-z]{1,6}$")
    kind: str = pydantic.Field(pattern="^(cat|dog)$")
    age: int = pydantic.Field(ge=0, le=30)
    vaccinated: bool


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = serve_engine(tiny_engine(tiny_llama, num_kv_blocks=1024, block_size=4), MODEL)
    yield srv
    srv.stop()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
        wait_idle(c)  # no request and no KV block left behind


@pytest.fixture
def oai(server, http):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def post(http, path: str, body: dict) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_response_format_json_schema_on_both_routes(http):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    chat = post(http, "/v1/chat/completions", {"messages": MESSAGES, "response_format": fmt, "n": 4, "seed": 1,
                                               "max_tokens": 200, **COMPACT})
    done = post(http, "/v1/completions", {"prompt": PROMPT, "response_format": fmt, "n": 4, "seed": 1,
                                          "max_tokens": 200, **COMPACT})
    texts = [c["message"]["content"] for c in chat["choices"]] + [c["text"] for c in done["choices"]]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert {c["finish_reason"] for c in chat["choices"] + done["choices"]} == {"stop"}


@pytest.mark.parametrize("field,value,check", [
    ("structured_outputs", {"regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
    ("structured_outputs", {"choice": CHOICES}, lambda t: t in CHOICES),
    ("structured_outputs", {"grammar": GBNF}, lambda t: t.startswith("sum(") and t.endswith(")")),
    ("guided_regex", REGEX, lambda t: re.fullmatch(REGEX, t)),
    ("guided_choice", CHOICES, lambda t: t in CHOICES),
    ("guided_grammar", GBNF, lambda t: t.startswith("sum(") and t.endswith(")")),
    ("guided_json", {"enum": [1, "two", [3]]}, lambda t: json.loads(t) in (1, "two", [3])),
])
def test_structured_outputs_and_the_guided_fields(http, field, value, check):
    body = {"prompt": PROMPT, field: value, "n": 8, "seed": 2, "temperature": 1.0, "max_tokens": 60}
    for choice in post(http, "/v1/completions", body)["choices"]:
        assert choice["finish_reason"] == "stop" and check(choice["text"]), choice["text"]


def test_openai_client_parses_into_a_pydantic_model(oai):
    for seed in range(4):
        reply = oai.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Pet, seed=seed,
                                           max_tokens=120, extra_body=COMPACT)
        pet = reply.choices[0].message.parsed
        assert isinstance(pet, Pet) and reply.choices[0].finish_reason == "stop"


def test_streamed_chat_with_a_response_format_parses(http):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    chunks = stream_json(http, "/v1/chat/completions", {"messages": MESSAGES, "response_format": fmt, "seed": 4,
                                                        "stream": True, "max_tokens": 200, **COMPACT})
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    jsonschema.validate(json.loads(text), SCHEMA)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_named_tool_choice_returns_a_call_whose_arguments_validate(oai):
    for seed in range(3):
        reply = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK], seed=seed,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            max_tokens=100, extra_body=COMPACT)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])


def test_required_tool_choice_calls_one_of_the_tools(oai):
    names = set()
    for seed in range(8):
        reply = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK], seed=seed,
                                            tool_choice="required", max_tokens=120, temperature=1.0,
                                            extra_body=COMPACT)
        (call,) = reply.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        names.add(call.function.name)
    assert names == set(SCHEMAS)


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_streamed_tool_calls_accumulate_in_the_openai_client(oai, tool_choice):
    kw = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK], tool_choice=tool_choice, seed=6,
              max_tokens=120, extra_body=COMPACT)
    whole = oai.chat.completions.create(**kw).choices[0]
    with oai.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content in (None, "")
    (call,), (want,) = final.message.tool_calls, whole.message.tool_calls
    assert (call.function.name, call.function.arguments) == (want.function.name, want.function.arguments)
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_none_ignores_the_tools(http):
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    plain = post(http, "/v1/chat/completions", body)
    with_tools = post(http, "/v1/chat/completions", {**body, "tools": [WEATHER], "tool_choice": "none"})
    assert with_tools["choices"][0]["message"] == plain["choices"][0]["message"]
    assert with_tools["usage"] == plain["usage"]


BIG = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 40} for i in range(800)}}


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strnig"}}}}, "response_format.json_schema.schema"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BIG}}},
     "response_format.json_schema.schema"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ("/v1/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("/v1/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/completions", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ("/v1/completions", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ("/v1/completions", {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ("/v1/completions", {"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"json_object": True, "whitespace_pattern": "[ "}},
     "structured_outputs.whitespace_pattern"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"guided_grammar": "root ::= (("}, "guided_grammar"),
    ("/v1/completions", {"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ("/v1/completions", {"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend"),
    ("/v1/completions", {"guided_regex": "a+", "min_tokens": 2}, "min_tokens"),
    ("/v1/chat/completions", {"tools": [WEATHER]}, "tool_choice"),  # "auto", the default with tools
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice.function.name"),
    ("/v1/chat/completions", {"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools.1.function.name"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strnig"}}}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools.0.function.parameters"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "tools"),
])
def test_bad_specs_are_a_400_naming_the_field(http, path, extra, param):
    base = {"messages": MESSAGES} if path == "/v1/chat/completions" else {"prompt": PROMPT}
    r = http.post(path, json={**base, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error


def test_refusals_leave_the_server_serving(http):
    want = post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    for extra in ({"guided_regex": "("}, {"structured_outputs": {"choice": []}}):
        assert http.post("/v1/completions", json={"prompt": PROMPT, **extra}).status_code == 400
    again = post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert again["choices"] == want["choices"]


# --- on the real model ---------------------------------------------------------------------------------------------

@pytest.mark.slow
@requires_default_model
def test_the_default_tokenizer_is_read_byte_for_byte(default_llm):
    """The default model's tokenizer (converted from GGUF) decodes through ByteFallback, Fuse, Replace and ByteLevel:
    llguidance must still see every token's own bytes, or no token that starts with a space is ever allowed."""
    tok, manager = default_llm.get_tokenizer(), default_llm.engine.structured_output
    ll_tok = manager.ll_tokenizer()
    for i in range(len(tok)):
        text = tok.decode([i])
        if "\ufffd" not in text and i not in tok.all_special_ids:
            assert ll_tok.decode_bytes([i]) == text.encode(), (i, text)
    params = SamplingParams(temperature=1.0, seed=0, structured_outputs=StructuredOutputsParams(choice=[" yes", " no"]))
    outs = default_llm.generate(["Is the sky blue? Answer:"] * 4, params, use_tqdm=False)
    assert all(o.outputs[0].text in (" yes", " no") and o.outputs[0].finish_reason == "stop" for o in outs)


@pytest.mark.slow
@requires_default_model
def test_json_mode_on_the_default_model(default_llm):
    spec = StructuredOutputsParams(json_object=True)
    out = default_llm.chat([{"role": "user", "content": "Give a JSON object with a name and an age."}],
                           SamplingParams(max_tokens=80, structured_outputs=spec), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out.text
