"""Hostile sampling values hold the service up: every extreme a client can send gets a 200, or a 400 naming the
field, never a 500 that stops the server; a sequence whose logits have no finite value ends alone with finish_reason
"error" while the rest of its batch samples as before and its blocks come back; a prefill/decode pair refuses what
its prefill instance cannot run when the request is added, not from inside a step."""

import json
import math
import time

import httpx
import pytest
import torch

from conftest import DEVICE
from minillm import LLMEngine, SamplingParams, model_runner
from minillm.disagg.connector import check_remote_decode
from minillm.disagg.pair import PDPair
from minillm.metrics import RequestMetrics
from minillm.sampling import REPETITION_PENALTY_RANGE, apply_penalties, sample
from minillm.sequence import Sequence
from serving_utils import serve_engine, tiny_engine, wait_idle

PROMPT = "The quick brown fox"
NORMAL = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
POISON_SEED = 424242  # the server test's poisoned request is the one with this seed
SERVED = [  # extremes the sampler carries: a 200
    {"temperature": 1e-45}, {"temperature": 3.4e38}, {"temperature": 1.0, "top_p": 1e-45},
    {"temperature": 1.0, "min_p": 1.0}, {"temperature": 1.0, "seed": 2 ** 63 - 1},
    {"temperature": 1.0, "seed": -2 ** 63}, {"temperature": 1.0, "seed": 2 ** 64 - 1},
    {"temperature": 1.0, "repetition_penalty": REPETITION_PENALTY_RANGE[0]},
    {"temperature": 1.0, "repetition_penalty": REPETITION_PENALTY_RANGE[1]},
    {"temperature": 1.0, "presence_penalty": 2, "frequency_penalty": -2},
    {"temperature": 1e-45, "top_p": 1e-45, "min_p": 1.0, "top_k": 1, "repetition_penalty": 1e30, "seed": 2 ** 63 - 1},
]
REFUSED = [  # beyond float32's reach, or outside the field's range: a 400 naming the field
    ("repetition_penalty", 1e-300), ("repetition_penalty", 1e-40), ("repetition_penalty", 1e300),
    ("repetition_penalty", 0), ("presence_penalty", 1e300), ("frequency_penalty", -1e300), ("temperature", -1e-45),
    ("top_p", 0), ("min_p", 1.0000001), ("top_k", -2), ("seed", 2 ** 64), ("seed", -2 ** 63 - 1),
]


def poison(monkeypatch, chosen, value: float) -> None:
    """Give the rows of the sequences `chosen(seq)` picks no finite top logit, as a broken model or an overflowing
    penalty would: one logit set to `value` (NaN or +inf), or every logit when `value` is -inf."""
    apply = model_runner.apply_penalties

    def poisoned(logits, seqs):
        logits = apply(logits, seqs).clone()
        for i, seq in enumerate(seqs):
            if chosen(seq):
                logits[i, slice(None) if value == -math.inf else 7] = value
        return logits
    monkeypatch.setattr(model_runner, "apply_penalties", poisoned)


# --- the edge -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0.0, 1e-300, 1e-40, 9.9e-31, 1.1e30, 1e300, math.inf, math.nan])
def test_repetition_penalties_float32_cannot_carry_are_named(value):
    with pytest.raises(ValueError, match="^repetition_penalty "):
        SamplingParams(repetition_penalty=value)


def test_at_the_repetition_penalty_bounds_logits_up_to_1e8_stay_finite():
    logits = torch.linspace(-1e8, 1e8, 64).repeat(2, 1)
    seqs = [Sequence("r", None, list(range(64)), SamplingParams(temperature=1.0, repetition_penalty=p),
                     RequestMetrics(0.0)) for p in REPETITION_PENALTY_RANGE]
    penalized = apply_penalties(logits, seqs)
    assert penalized.isfinite().all()
    assert None not in sample(penalized, [s.params for s in seqs], [torch.Generator().manual_seed(0)] * 2)


def test_seeds_across_the_whole_range_seed_a_generator():
    for seed in (-2 ** 63, -1, 2 ** 63 - 1, 2 ** 64 - 1):
        assert Sequence("r", None, [1], SamplingParams(seed=seed), RequestMetrics(0.0)).generator is not None


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = serve_engine(tiny_engine(tiny_llama, num_kv_blocks=128, block_size=4))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def normal_text(client):
    """A greedy completion taken before any hostile request: the server must keep giving exactly this."""
    r = client.post("/v1/completions", json=NORMAL)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def body(path: str, fields: dict) -> dict:
    if path == "/v1/completions":
        return {"prompt": PROMPT, "max_tokens": 4, **fields}
    return {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, **fields}


def still_serves(server, client, normal_text: str) -> None:
    r = client.post("/v1/completions", json=NORMAL)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == normal_text, r.text
    assert not server.failed and server.llm.error is None
    wait_idle(client)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("fields", SERVED, ids=lambda f: ",".join(f"{k}={v:g}" for k, v in f.items()))
def test_extremes_the_sampler_carries_are_served(server, client, normal_text, path, fields):
    r = client.post(path, json=body(path, fields))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    still_serves(server, client, normal_text)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field,value", REFUSED, ids=lambda v: f"{v:g}" if isinstance(v, (int, float)) else v)
def test_values_beyond_reach_are_refused_by_name(server, client, normal_text, path, field, value):
    r = client.post(path, json=body(path, {"temperature": 1.0, field: value}))
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    still_serves(server, client, normal_text)


def test_a_request_with_no_finite_logit_ends_with_an_error_and_the_server_carries_on(server, client, normal_text,
                                                                                      monkeypatch):
    poison(monkeypatch, lambda seq: seq.params.seed == POISON_SEED, math.nan)
    r = client.post("/v1/completions", json={**NORMAL, "temperature": 1.0, "seed": POISON_SEED})
    assert r.status_code == 500 and r.json()["error"]["code"] == "generation_failed", r.text
    assert "no finite logits" in r.json()["error"]["message"]
    still_serves(server, client, normal_text)
    with client.stream("POST", "/v1/completions",
                       json={**NORMAL, "temperature": 1.0, "seed": POISON_SEED, "stream": True}) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "generation_failed"
    still_serves(server, client, normal_text)


# --- the sampler and the engine -------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9, min_p=0.01)])
def test_sample_leaves_out_only_the_rows_without_a_finite_top_logit(params):
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    broken = logits.clone()
    broken[1, 3], broken[2, 4], broken[3] = math.nan, math.inf, -math.inf
    generators = [[torch.Generator().manual_seed(i) for i in range(5)] for _ in range(2)]
    want = sample(logits, [params] * 5, generators[0])
    assert sample(broken, [params] * 5, generators[1]) == [want[0], None, None, None, want[4]]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(tiny_llama, device=DEVICE, dtype=torch.float32, num_kv_blocks=64, block_size=4)


def run_to_end(engine: LLMEngine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
    return finals


BAD, GOOD = [5, 6, 7, 8, 9, 10], list(range(20, 31))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("bad_params", [SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2),
                                        SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)],
                         ids=["greedy", "sampled"])
def test_a_row_without_a_finite_logit_ends_alone_with_an_error(engine, reference, monkeypatch, value, bad_params):
    poison(monkeypatch, lambda seq: seq.request_id == "bad" and len(seq.output_token_ids) >= 2, value)
    engine.add_request("bad", BAD, bad_params)
    engine.add_request("good", GOOD, SamplingParams(max_tokens=10, ignore_eos=True))
    finals = run_to_end(engine)
    bad, good = finals["bad"].outputs[0], finals["good"].outputs[0]
    assert bad.finish_reason == "error" and len(bad.token_ids) == 2
    if bad_params.greedy:
        assert bad.token_ids == reference(tuple(BAD), 2) and len(bad.logprobs) == 2
    assert good.finish_reason == "length" and good.token_ids == reference(tuple(GOOD), 10)
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    monkeypatch.undo()
    engine.add_request("after", BAD, SamplingParams(max_tokens=8, ignore_eos=True))
    assert run_to_end(engine)["after"].outputs[0].token_ids == reference(tuple(BAD), 8)


# --- prefill/decode disaggregation ----------------------------------------------------------------------------


def test_a_prefill_for_a_remote_decode_refuses_min_tokens_past_its_first_token():
    check_remote_decode(SamplingParams(max_tokens=4, min_tokens=1))
    with pytest.raises(ValueError, match="^min_tokens must be at most 1"):
        check_remote_decode(SamplingParams(max_tokens=4, min_tokens=2))


@pytest.mark.slow
def test_a_pair_refuses_at_add_time_and_the_others_finish(tiny_llama):
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    with PDPair(tiny_llama, device="cpu", block_size=4, num_kv_blocks=96, max_num_batched_tokens=64) as pair:
        kept = pair.add_request(None, BAD, greedy)
        with pytest.raises(ValueError, match="^min_tokens "):
            pair.add_request(None, GOOD, SamplingParams(max_tokens=6, min_tokens=2))
        with pytest.raises(ValueError, match="^stop_token_ids "):
            pair.add_request(None, GOOD, SamplingParams(stop_token_ids=[10 ** 6]))
        with pytest.raises(ValueError, match=r"^sampling_params\[1\]: min_tokens "):
            pair.generate([GOOD, GOOD], [greedy, SamplingParams(max_tokens=6, min_tokens=2)])
        outs, deadline = [], time.monotonic() + 60
        while pair.has_unfinished_requests():
            assert time.monotonic() < deadline, "the kept request did not finish"
            outs += [o for o in pair.step(timeout=0.05) if o.finished]  # as an engine, it reports every step
        assert [(o.request_id, o.outputs[0].finish_reason, len(o.outputs[0].token_ids)) for o in outs] == \
            [(kept, "length", 6)]
