"""vLLM's request fields through the server, on a tiny model: allowed_token_ids and bad_words (the server's output
equals `LLM.generate` with the same SamplingParams, and differs without them), truncate_prompt_tokens and
add_special_tokens (what `usage.prompt_tokens` counts), a 400 naming each field the engine cannot honour, and
unknown fields accepted but logged once per request (structured output and tools: test_structured_output.py). The tokenizer here puts a BOS before any text, so that
add_special_tokens has something to add."""

import logging

import httpx
import openai
import pytest
from tokenizers.processors import TemplateProcessing

from minillm import LLM, SamplingParams
from serving_utils import Records, serve_engine, stream_json, tiny_engine, wait_idle
from tiny_models import spelled_word

MODEL = "test-model"
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Tell a story."}]


def add_bos(tokenizer) -> None:
    """Make the tokenizer put its BOS (<|im_start|>) before every text it encodes with special tokens."""
    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.bos_token_id)])
    assert tokenizer("a").input_ids[0] == tokenizer.bos_token_id


@pytest.fixture(scope="module")
def server(tiny_llama):
    engine = tiny_engine(tiny_llama, num_kv_blocks=256, block_size=4)
    add_bos(engine.tokenizer)
    srv = serve_engine(engine, MODEL)
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
        wait_idle(c)  # a refused request left no work and no KV block behind


@pytest.fixture(scope="module")
def offline(tiny_llama):
    llm = LLM(tiny_llama, device="cpu", num_kv_blocks=256, block_size=4)
    add_bos(llm.get_tokenizer())
    return llm


@pytest.fixture
def records():
    """What the server logs while a test runs."""
    handler, logger = Records(), logging.getLogger("minillm.serving")
    logger.addHandler(handler)
    yield handler.records
    logger.removeHandler(handler)


def post(client, path: str, body: dict) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def refused(client, path: str, body: dict) -> str:
    """The field a 400 names (without the item's index: `allowed_token_ids.0` is `allowed_token_ids`)."""
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    return r.json()["error"]["param"].split(".")[0]


def chat_ids(offline, messages=MESSAGES) -> list[int]:
    return offline.engine.apply_chat_template(messages)


def offline_run(offline, prompt, **params):
    return offline.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0]


def served_text(client, path: str, body: dict) -> str:
    choice = post(client, path, body)["choices"][0]
    return choice["text"] if path == "/v1/completions" else choice["message"]["content"]


ENDPOINTS = [("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MESSAGES})]


def prompt_of(offline, path: str):
    return PROMPT if path == "/v1/completions" else chat_ids(offline)


# --- 1. allowed_token_ids ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path,base", ENDPOINTS)
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 3}])
def test_allowed_token_ids_are_the_only_tokens_sampled(client, offline, path, base, sampling):
    allowed = list(range(60, 100))
    body = {**base, "max_tokens": 12, "ignore_eos": True, **sampling}
    want = offline_run(offline, prompt_of(offline, path), max_tokens=12, ignore_eos=True, allowed_token_ids=allowed,
                       **sampling)
    assert set(want.token_ids) <= set(allowed)
    assert served_text(client, path, {**body, "allowed_token_ids": allowed}) == want.text
    assert served_text(client, path, body) != want.text  # the mask changed something: honoured, not ignored


def test_allowed_token_ids_report_the_models_own_logprobs(client, offline):
    """As vLLM (logprobs_mode "raw_logprobs"): the mask decides the draw; log-probs are those of the unmasked model."""
    allowed = list(range(60, 100))
    want = offline_run(offline, PROMPT, max_tokens=4, ignore_eos=True, allowed_token_ids=allowed, logprobs=2)
    plain = offline_run(offline, PROMPT, max_tokens=1, logprobs=2)
    body = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "temperature": 0, "logprobs": 2,
            "allowed_token_ids": allowed}
    got = post(client, "/v1/completions", body)["choices"][0]["logprobs"]
    assert got["token_logprobs"] == pytest.approx([e[t].logprob for t, e in zip(want.token_ids, want.logprobs)],
                                                  abs=1e-4)
    assert got["top_logprobs"][0] == pytest.approx({offline.engine.output_processor.token_text(t): x.logprob
                                                    for t, x in plain.logprobs[0].items()}, abs=1e-4)


@pytest.mark.parametrize("path,base", ENDPOINTS)
@pytest.mark.parametrize("bad", [[], [-1], [10 ** 6], "5", [1.5], [True], "vocab+1"])
def test_bad_allowed_token_ids_are_refused_by_name(client, offline, path, base, bad):
    if bad == "vocab+1":
        bad = [1] * (offline.engine.config.vocab_size + 1)
    assert refused(client, path, {**base, "allowed_token_ids": bad}) == "allowed_token_ids"


# --- 2. bad_words --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path,base", ENDPOINTS)
@pytest.mark.parametrize("length", [1, 2])
def test_bad_words_are_never_generated(client, offline, path, base, length):
    prompt = prompt_of(offline, path)
    plain = offline_run(offline, prompt, max_tokens=40, ignore_eos=True)
    _, word = spelled_word(offline.get_tokenizer(), plain.token_ids, length)
    want = offline_run(offline, prompt, max_tokens=40, ignore_eos=True, bad_words=[word])
    body = {**base, "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    assert served_text(client, path, {**body, "bad_words": [word]}) == want.text != plain.text
    assert served_text(client, path, body) == plain.text


# the last two are over --max-stops (16) and --max-stop-chars (256), as stop strings: each bad word is tokenized
# when the request is added and checked at every step
@pytest.mark.parametrize("bad", [[""], ["  "], "word", [3], [None], ["w"] * 17, ["w" * 257]])
def test_bad_bad_words_are_refused_by_name(client, bad):
    assert refused(client, "/v1/completions", {"prompt": PROMPT, "bad_words": bad}) == "bad_words"


def test_masked_and_plain_prompts_in_one_request_match_their_runs_alone(client, offline):
    """A completions batch is one engine step for all its prompts: each row keeps its own masks, or none."""
    prompts = [PROMPT, "Large language models", "Prefill builds"]
    _, word = spelled_word(offline.get_tokenizer(), offline_run(offline, prompts[1], max_tokens=30,
                                                                ignore_eos=True).token_ids, 2)
    masks = {"allowed_token_ids": list(range(60, 100)), "bad_words": [word]}
    body = {"prompt": prompts, "max_tokens": 10, "ignore_eos": True, "temperature": 0}
    together = [c["text"] for c in post(client, "/v1/completions", {**body, **masks})["choices"]]
    alone = [served_text(client, "/v1/completions", {**body, **masks, "prompt": p}) for p in prompts]
    assert together == alone == [offline_run(offline, p, max_tokens=10, ignore_eos=True, **masks).text
                                 for p in prompts]


# --- 3. truncate_prompt_tokens -------------------------------------------------------------------------------------

def test_truncate_prompt_tokens_keeps_the_last_tokens(client, offline):
    ids = offline.get_tokenizer()(PROMPT).input_ids
    body = {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "temperature": 0, "echo": True}
    got = post(client, "/v1/completions", {**body, "truncate_prompt_tokens": 3})
    want = offline_run(offline, ids[-3:], max_tokens=6, ignore_eos=True)
    echoed = offline.get_tokenizer().decode(ids[-3:])
    assert got["usage"]["prompt_tokens"] == 3 and got["choices"][0]["text"] == echoed + want.text
    assert post(client, "/v1/completions", {**body, "prompt": ids, "truncate_prompt_tokens": 3}) \
        ["choices"][0]["text"] == echoed + want.text
    assert post(client, "/v1/completions", {**body, "truncate_prompt_tokens": 100})["usage"]["prompt_tokens"] == \
        len(ids)
    messages = {"messages": MESSAGES, "max_tokens": 3, "ignore_eos": True, "temperature": 0}
    chat = post(client, "/v1/chat/completions", {**messages, "truncate_prompt_tokens": 5})
    want = offline_run(offline, chat_ids(offline)[-5:], max_tokens=3, ignore_eos=True)
    assert chat["usage"]["prompt_tokens"] == 5 and chat["choices"][0]["message"]["content"] == want.text


def test_truncate_prompt_tokens_minus_one_fits_the_context(client, offline):
    context = offline.engine.max_model_len
    long = list(range(5, 45)) * (context // 40 + 2)
    body = {"prompt": long, "max_tokens": 1}
    assert refused(client, "/v1/completions", body) == "prompt"  # too long for the context
    got = post(client, "/v1/completions", {**body, "truncate_prompt_tokens": -1})
    assert got["usage"]["prompt_tokens"] == context - 1  # one place left for the reply


def test_truncate_prompt_tokens_offline_runs_the_last_tokens(offline):
    """SamplingParams' field: `LLM.generate` runs the prompt's last k tokens, as the server does (the same code)."""
    ids = offline.get_tokenizer()(PROMPT).input_ids
    out = offline.generate(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True, truncate_prompt_tokens=3),
                           use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-3:] and out.outputs[0].text == offline_run(offline, ids[-3:], max_tokens=6,
                                                                                     ignore_eos=True).text
    context = offline.engine.max_model_len
    long = list(range(5, 45)) * (context // 40 + 2)
    with pytest.raises(ValueError, match="context"):
        offline_run(offline, long, max_tokens=1)
    fits = offline.generate(long, SamplingParams(max_tokens=1, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert fits.prompt_token_ids == long[-(context - 1):]
    for bad in (0, -2, 1.5, "3", context):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            offline.generate(PROMPT, SamplingParams(truncate_prompt_tokens=bad), use_tqdm=False)
    assert not offline.engine.has_unfinished_requests()


@pytest.mark.parametrize("path,base", ENDPOINTS)
@pytest.mark.parametrize("bad", [0, -2, 10 ** 6, "3", 1.5])
def test_bad_truncate_prompt_tokens_are_refused_by_name(client, path, base, bad):
    assert refused(client, path, {**base, "truncate_prompt_tokens": bad}) == "truncate_prompt_tokens"


# --- 4. add_special_tokens -----------------------------------------------------------------------------------------

def test_add_special_tokens_on_completions_and_chat(client, offline):
    tok = offline.get_tokenizer()
    with_bos, bare = tok(PROMPT).input_ids, tok(PROMPT, add_special_tokens=False).input_ids
    assert with_bos == [tok.bos_token_id] + bare
    body = {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    for fields, ids in [({}, with_bos), ({"add_special_tokens": True}, with_bos),
                        ({"add_special_tokens": False}, bare)]:  # vLLM's default for completions: true
        got = post(client, "/v1/completions", {**body, **fields})
        assert got["usage"]["prompt_tokens"] == len(ids), fields
        assert got["choices"][0]["text"] == offline_run(offline, ids, max_tokens=6, ignore_eos=True).text
    chat = {"messages": MESSAGES, "max_tokens": 3, "ignore_eos": True, "temperature": 0}
    template = chat_ids(offline)
    for fields, ids in [({}, template), ({"add_special_tokens": True}, [tok.bos_token_id] + template)]:
        got = post(client, "/v1/chat/completions", {**chat, **fields})  # vLLM's default for chat: false
        assert got["usage"]["prompt_tokens"] == len(ids), fields
        assert got["choices"][0]["message"]["content"] == offline_run(offline, ids, max_tokens=3,
                                                                      ignore_eos=True).text
    assert refused(client, "/v1/completions", {**body, "add_special_tokens": "no"}) == "add_special_tokens"


# --- 5. fields the engine cannot honour, and unknown ones ----------------------------------------------------------

UNSUPPORTED = {  # a field and a value that asks for something
    "guided_decoding_backend": "xgrammar", "use_beam_search": True, "length_penalty": 0.5, "logit_bias": {"5": 10}, "logits_processors": ["x"], "kv_transfer_params": {"a": 1},
    "cache_salt": "s", "vllm_xargs": {"a": 1}, "return_tokens_as_token_ids": True, "return_token_ids": True,
    "spaces_between_special_tokens": False, "priority": 1}
CHAT_ONLY = {
    "functions": [{"name": "f"}], "function_call": "auto", "chat_template": "{{ messages }}",
    "documents": [{"text": "d"}], "mm_processor_kwargs": {"a": 1}, "audio": {"voice": "x"},
    "modalities": ["text", "audio"], "web_search_options": {}, "reasoning_effort": "low"}
NEUTRAL = {"guided_json": None, "response_format": {"type": "text"}, "use_beam_search": False, "length_penalty": 1.0,
           "logit_bias": {}, "priority": 0, "spaces_between_special_tokens": True, "return_token_ids": False,
           "guided_decoding_backend": "auto"}
CHAT_NEUTRAL = {"tools": [], "tool_choice": "none", "functions": None, "modalities": ["text"],
                "parallel_tool_calls": True}


@pytest.mark.parametrize("path,base,field,value",
                         [(p, b, f, v) for p, b in ENDPOINTS for f, v in UNSUPPORTED.items()] +
                         [("/v1/chat/completions", {"messages": MESSAGES}, f, v) for f, v in CHAT_ONLY.items()] +
                         [("/v1/completions", {"prompt": PROMPT}, "prompt_embeds", "AAAA")])
def test_fields_the_engine_cannot_honour_are_refused_by_name(client, path, base, field, value):
    r = client.post(path, json={**base, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": f"{field} is not supported by this server", "type": "invalid_request_error",
                                 "param": field, "code": None}


def test_their_neutral_values_are_accepted_quietly(client, records):
    post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **NEUTRAL})
    post(client, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, **NEUTRAL, **CHAT_NEUTRAL})
    assert not [r for r in records if "ignored" in r.getMessage()]


@pytest.mark.parametrize("path,base", ENDPOINTS)
def test_unknown_fields_are_accepted_and_logged_once_per_request(client, offline, records, path, base):
    body = {**base, "max_tokens": 3, "ignore_eos": True, "temperature": 0}
    typo = {**body, "max_token": 50, "stream_options_x": 1}
    assert served_text(client, path, typo) == served_text(client, path, body)  # as vLLM: accepted, not read
    warned = [r for r in records if "ignored" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert warned[0].getMessage() == ("The following fields were present in the request but ignored: "
                                      "{'max_token', 'stream_options_x'}")
    if path == "/v1/chat/completions":  # and those of the messages, named by their path
        post(client, path, {**body, "messages": [{**MESSAGES[0], "tone": "dry"}]})
        assert records[-1].getMessage().endswith("{'messages.0.tone'}")


@pytest.mark.parametrize("path,body,unknown,named", [
    ("/tokenize", {"prompt": PROMPT}, {"max_token": 50, "stream_options_x": 1}, "{'max_token', 'stream_options_x'}"),
    ("/tokenize", {"messages": MESSAGES}, {"max_token": 50}, "{'max_token'}"),
    ("/tokenize", {"messages": MESSAGES}, {"messages": [{**MESSAGES[0], "tone": "dry"}]}, "{'messages.0.tone'}"),
    ("/detokenize", {"tokens": [60, 61]}, {"max_token": 50}, "{'max_token'}"),
])
def test_tokenize_and_detokenize_log_their_unknown_fields_once(client, records, path, body, unknown, named):
    assert post(client, path, {**body, **unknown}) == post(client, path, body)  # accepted, not read
    warned = [r for r in records if "ignored" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert warned[0].getMessage() == f"The following fields were present in the request but ignored: {named}"


def test_the_openai_client_sends_nothing_spurious(server, records):
    """The official client sends only what the caller sets: none of it is refused, and none of it goes unread."""
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as oai:
        oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0.5, top_p=0.9, n=2, seed=1,
                               stop=["\n"], logprobs=1, echo=True, presence_penalty=0.5, frequency_penalty=0.5,
                               user="u", best_of=2)
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=3, temperature=0.5,
                                    logprobs=True, top_logprobs=2, user="u", tool_choice="none",
                                    response_format={"type": "text"}, parallel_tool_calls=False)
        stream = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, stream=True,
                                             stream_options={"include_usage": True})
        assert [c for c in stream][-1].usage.prompt_tokens > 0
        allowed = list(range(60, 100))
        reply = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                       extra_body={"allowed_token_ids": allowed, "truncate_prompt_tokens": 3})
        assert reply.usage.prompt_tokens == 3
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=MODEL, messages=MESSAGES, logit_bias={"5": 10})
        assert e.value.body["param"] == "logit_bias"
    assert not [r.getMessage() for r in records if "ignored" in r.getMessage()]


def test_refusals_leave_the_engine_serving(client, offline):
    """After every kind of 400 above, a plain request still gets the same answer (the fixture checks no KV block
    is held)."""
    stream_json(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stream": True,
                                            "allowed_token_ids": [70]})
    want = offline_run(offline, PROMPT, max_tokens=5, ignore_eos=True)
    for field, value in [("guided_regex", "(unclosed"), ("allowed_token_ids", [10 ** 6]), ("bad_words", [""]),
                         ("truncate_prompt_tokens", 0)]:
        refused(client, "/v1/completions", {"prompt": PROMPT, field: value})
        assert served_text(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True,
                                                       "temperature": 0}) == want.text
