"""Prefill/decode disaggregation (chapter 9): a prompt prefilled by one engine and decoded by another, its KV blocks
pulled between them, gives one engine's tokens; the bytes moved are the formula's; aborts anywhere free every block
on both sides; a dead instance is an error, not a hang.

The first tests join two engines in this process (their connectors' gloo group over 127.0.0.1, one thread per
side), so each state can be reached by stepping; the slow ones run `PDPair`, two spawned processes."""

import multiprocessing
import os
import signal
import threading
import time

import pytest

from minillm import LLM, LLMEngine, SamplingParams
from minillm.sampling import RequestOutputKind
from minillm.disagg.connector import CONSUMER, PRODUCER, KVConnector
from minillm.disagg.kv_transfer import pd_comm
from minillm.kv_handoff import KVLayout
from minillm.disagg.pair import PDPair, decode_params, prefill_params
from minillm.ports import free_port
from minillm.sequence import SequenceStatus
from serving_utils import wait_for

BLOCK = 4
ENGINE = dict(device="cpu", block_size=BLOCK, num_kv_blocks=96, max_num_batched_tokens=64)
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
SHARED = [7, 8, 9, 10, 11, 12, 13, 14, 15]  # two full blocks and one token
PROMPTS = [
    [5, 6, 7],  # shorter than a block
    [20, 21, 22, 23, 24, 25, 26, 27],  # exactly two blocks
    SHARED + [40, 41, 42],  # these two share two full blocks
    SHARED + [50],
    list(range(60, 90)),  # several blocks and a partial one
]


def tiny_bytes_per_token(itemsize: int, scales: bool = False) -> int:
    """The tiny model's K/V bytes per token by formula: layers x 2 x KV heads x (head dim x bytes [+ 4-byte scale])."""
    return 2 * 2 * 2 * (16 * itemsize + (4 if scales else 0))


def connect(prefill: LLMEngine, decode: LLMEngine, hold_timeout: float = 60.0) -> None:
    """Join two engines of this process as a pair: a gloo group of two ranks over loopback, one per thread."""
    port, comms = free_port(), {}
    threads = [threading.Thread(target=lambda r: comms.__setitem__(r, pd_comm(r, 2, port)), args=(r,))
               for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    prefill.kv_connector = KVConnector(PRODUCER, comms[0], prefill.kv_cache, hold_timeout)
    decode.kv_connector = KVConnector(CONSUMER, comms[1], decode.kv_cache)


def step_until(engine: LLMEngine, done, *others: LLMEngine, timeout: float = 30.0) -> list:
    """Step `engine` (and `others`, whose outputs are dropped) until `done(outputs so far)`."""
    outputs, deadline = [], time.monotonic() + timeout
    while not done(outputs):
        assert time.monotonic() < deadline, "the engines did not get there in time"
        outputs += engine.step()
        for other in others:
            other.step()
        time.sleep(0.001)
    return outputs


def hand_over(prefill: LLMEngine, request_id: str, prompt, params: SamplingParams):
    prefill.add_request(request_id, prompt, prefill_params(params), do_remote_decode=True)
    outs = step_until(prefill, lambda outs: any(o.finished for o in outs))
    return [o for o in outs if o.finished][0]


def run_split(prefill: LLMEngine, decode: LLMEngine, request_id: str, prompt, params: SamplingParams):
    """One request through both engines, as the pair's coordinator routes it (the first token's prefill output
    returned when nothing is left to decode)."""
    first = hand_over(prefill, request_id, prompt, params)
    if params.n == 1 and first.outputs[0].finish_reason == "stop":
        prefill.abort(request_id)
        return first
    decode.add_request(request_id, first.prompt_token_ids, decode_params(params), first.metrics.arrival_time,
                       remote_prefill=first.kv_transfer_params)
    outs = step_until(decode, lambda outs: any(o.finished for o in outs), prefill)
    return [o for o in outs if o.finished][0]


def all_free(*engines: LLMEngine) -> bool:
    for engine in engines:
        engine.step()
    return all(e.stats()["kv_blocks_free"] == e.stats()["kv_blocks_total"] and not e.kv_connector.num_held
               for e in engines)


def wait_all_free(*engines: LLMEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not all_free(*engines):
        assert time.monotonic() < deadline, [e.stats()["kv_blocks_free"] for e in engines]
        time.sleep(0.005)


@pytest.fixture(scope="module")
def engines(tiny_llama):
    prefill, decode = LLMEngine(tiny_llama, **ENGINE), LLMEngine(tiny_llama, **ENGINE)
    connect(prefill, decode)
    yield prefill, decode
    decode.shutdown()
    prefill.shutdown()


@pytest.fixture(scope="module")
def single(tiny_llama):
    llm = LLM(tiny_llama, **ENGINE)
    return lambda prompts, params: llm.generate(prompts, params, use_tqdm=False)


def test_split_equals_one_engine_and_moves_the_formulas_bytes(engines, single):
    prefill, decode = engines
    for prompt, want in zip(PROMPTS, single(PROMPTS, GREEDY)):
        sent = len(decode.kv_connector.transfers)
        out = run_split(prefill, decode, f"eq{len(prompt)}-{prompt[-1]}", prompt, GREEDY)
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        assert out.outputs[0].text == want.outputs[0].text
        metrics = out.metrics  # one record across both engines: the first token's time is the prefill's
        assert metrics.arrival_time < metrics.first_token_time == metrics.token_times[0] < metrics.token_times[1]
        assert metrics.output_tokens == len(metrics.token_times) == GREEDY.max_tokens
        (record,) = decode.kv_connector.transfers[sent:]
        cached = 2 if prompt == SHARED + [50] else 0  # the decode side has SHARED's two full blocks already
        assert record.num_blocks == -(-len(prompt) // BLOCK) - cached
        assert record.nbytes == record.num_blocks * BLOCK * tiny_bytes_per_token(4)
    wait_all_free(prefill, decode)
    # what the prefill side sent: every pulled block once, plus a 16-byte reply per pull
    records = prefill.kv_connector.transfers
    assert prefill.kv_connector.comm.stats["send"].bytes == sum(r.nbytes for r in records) + 16 * len(records)


def test_n_seeds_logprobs_and_stops_carry_over(engines, single):
    prefill, decode = engines
    cases = [SamplingParams(n=3, max_tokens=8, ignore_eos=True),
             SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=8, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=3, max_tokens=8, logprobs=2),
             SamplingParams(max_tokens=30)]  # may stop at EOS, perhaps already at the first token
    for i, params in enumerate(cases):
        prompt = PROMPTS[i % len(PROMPTS)]
        (want,) = single([prompt], params)
        got = run_split(prefill, decode, f"carry{i}", prompt, params)
        assert [(c.token_ids, c.finish_reason) for c in got.outputs] == \
            [(c.token_ids, c.finish_reason) for c in want.outputs]
        if params.logprobs:
            assert [sorted(p) for p in got.outputs[0].logprobs] == [sorted(p) for p in want.outputs[0].logprobs]
    wait_all_free(prefill, decode)


def test_aborts_anywhere_free_both_sides(engines, single):
    prefill, decode = engines
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    # 1. on the prefill side, before its first token
    prefill.add_request("a1", PROMPTS[4], long, do_remote_decode=True)
    assert prefill.abort("a1").outputs[0].finish_reason == "abort"
    # 2. handed over, not pulled yet: the held blocks go back at once
    first = hand_over(prefill, "a2", PROMPTS[4], long)
    assert prefill.stats()["kv_blocks_free"] < prefill.stats()["kv_blocks_total"]
    assert prefill.abort("a2") is None and all_free(prefill)
    # 3. on the decode side, while its K/V are on the way
    first = hand_over(prefill, "a3", PROMPTS[1], long)
    decode.add_request("a3", first.prompt_token_ids, long, remote_prefill=first.kv_transfer_params)
    decode.step()
    (seq,) = decode.scheduler.loading
    assert seq.status == SequenceStatus.WAITING_FOR_REMOTE_KVS and seq.block_table
    assert decode.abort("a3").outputs[0].finish_reason == "abort"
    # 4. on the decode side, while decoding
    first = hand_over(prefill, "a4", PROMPTS[2], long)
    decode.add_request("a4", first.prompt_token_ids, long, remote_prefill=first.kv_transfer_params)
    step_until(decode, lambda outs: decode.scheduler.running, prefill)
    assert decode.abort("a4").outputs[0].finish_reason == "abort"
    wait_all_free(prefill, decode)


def test_blocks_gone_from_the_prefill_side_are_recomputed(engines, single):
    """Held past `hold_timeout`, a prefill's blocks are freed; its decode, told they are gone, computes the prompt
    itself and still continues from the prefill's first token."""
    prefill, decode = engines
    prefill.kv_connector.hold_timeout = 0.0
    try:
        first = hand_over(prefill, "late", PROMPTS[4], GREEDY)
        assert all_free(prefill) and prefill.kv_connector.num_expired >= 1
    finally:
        prefill.kv_connector.hold_timeout = 60.0
    decode.add_request("late", first.prompt_token_ids, GREEDY, remote_prefill=first.kv_transfer_params)
    out = [o for o in step_until(decode, lambda outs: any(o.finished for o in outs), prefill) if o.finished][0]
    assert out.outputs[0].token_ids == single([PROMPTS[4]], GREEDY)[0].outputs[0].token_ids
    assert "late" not in {r.request_id for r in decode.kv_connector.transfers}  # nothing came: it was computed here
    wait_all_free(prefill, decode)


def test_int8_cache_moves_its_scales(tiny_llama):
    kwargs = dict(ENGINE, kv_cache_dtype="int8")
    prefill, decode = LLMEngine(tiny_llama, **kwargs), LLMEngine(tiny_llama, **kwargs)
    connect(prefill, decode)
    try:
        want = LLM(tiny_llama, **kwargs).generate(PROMPTS, GREEDY, use_tqdm=False)
        for i, (prompt, w) in enumerate(zip(PROMPTS, want)):
            first = hand_over(prefill, f"q{i}", prompt, GREEDY)
            src = first.kv_transfer_params.block_ids
            decode.add_request(f"q{i}", prompt, GREEDY, remote_prefill=first.kv_transfer_params)
            decode.step()
            (seq,) = decode.scheduler.loading
            step_until(decode, lambda outs: not decode.scheduler.loading)
            dst = seq.block_table[:len(src)]
            for a, b in ((prefill.kv_cache.k_scale, decode.kv_cache.k_scale),
                         (prefill.kv_cache.v, decode.kv_cache.v)):  # the prompt's scales and values, bit for bit
                a, b = a[:, src].flatten(1, 2)[:, :len(prompt)], b[:, dst].flatten(1, 2)[:, :len(prompt)]
                assert a.eq(b).all() and a.abs().sum() > 0
            out = [o for o in step_until(decode, lambda outs: any(o.finished for o in outs)) if o.finished][0]
            assert out.outputs[0].token_ids == w.outputs[0].token_ids
        record = decode.kv_connector.transfers[0]
        assert record.nbytes == record.num_blocks * BLOCK * tiny_bytes_per_token(1, scales=True)
        wait_all_free(prefill, decode)
    finally:
        decode.shutdown()
        prefill.shutdown()


def test_refusals_are_named(engines, tiny_llama):
    prefill, decode = engines
    with pytest.raises(ValueError, match=r"one completion \(n = 1, got 2\)"):
        prefill.add_request(None, PROMPTS[0], SamplingParams(n=2), do_remote_decode=True)
    with pytest.raises(ValueError, match="needs the kv_consumer side"):
        prefill.add_request(None, PROMPTS[0], GREEDY, remote_prefill=object())
    first = hand_over(prefill, "r1", PROMPTS[0], GREEDY)
    handle = first.kv_transfer_params
    with pytest.raises(ValueError, match="prompt differs"):
        decode.add_request("r1", PROMPTS[1], GREEDY, remote_prefill=handle)
    handle.layout = KVLayout(8, 2, 2, 16, "bfloat16", False)
    with pytest.raises(ValueError, match="block_size 8 vs 4 here, dtype bfloat16 vs float32 here"):
        decode.add_request("r1", PROMPTS[0], GREEDY, remote_prefill=handle)
    with pytest.raises(ValueError, match="need a KV connector"):
        LLMEngine(tiny_llama, **ENGINE).add_request(None, PROMPTS[0], GREEDY, do_remote_decode=True)
    prefill.abort("r1")
    wait_all_free(prefill, decode)


# --- two processes --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_pair_equals_one_engine(tiny_llama, single):
    before = set(multiprocessing.active_children())
    prompts = PROMPTS + ["The quick brown fox jumps over the lazy dog."]
    cases = [GREEDY, SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=6, ignore_eos=True, prompt_logprobs=1)]
    with PDPair(tiny_llama, **ENGINE) as pair:
        for params in cases:
            want = single(prompts, params)
            got = pair.generate(prompts, params, timeout=120)
            assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
            assert [o.prompt for o in got] == [o.prompt for o in want]
            if params.prompt_logprobs:
                assert [None if p is None else sorted(p) for p in got[0].prompt_logprobs] == \
                    [None if p is None else sorted(p) for p in want[0].prompt_logprobs]
        with pytest.raises(ValueError, match="allowed_token_ids has token ids outside"):  # refused before queuing
            pair.add_request(None, PROMPTS[0], SamplingParams(allowed_token_ids=[10 ** 6]))
        # abort while the pair works: every block comes back on both sides
        rid = pair.add_request(None, PROMPTS[4], SamplingParams(max_tokens=200, ignore_eos=True,
                                                                output_kind=RequestOutputKind.FINAL_ONLY))
        deadline = time.monotonic() + 30
        while not pair.stats()["num_running"]:  # as the instances last reported: read as the pool steps
            assert time.monotonic() < deadline and not pair.step(timeout=0.05)
        pair.abort(rid)
        outs = []
        while not outs:
            assert time.monotonic() < deadline
            outs = pair.step(timeout=0.05)
        assert [(o.request_id, o.outputs[0].finish_reason) for o in outs] == [(rid, "abort")]
        # the prefill side frees a pulled request's blocks in its next loop after the send ends, which can come
        # after the decode side's abort: every block must come back, within a bound
        def all_free():
            stats = pair.instance_stats()
            return stats if all(s["kv_blocks_free"] == s["kv_blocks_total"] for ss in stats.values() for s in ss) \
                else None

        (prefill,), (decode,) = wait_for(all_free, 10, "every block freed on both instances").values()
        records = decode["transfers"]
        assert all(r.nbytes == r.num_blocks * BLOCK * tiny_bytes_per_token(4) for r in records)
        assert sum(r.nbytes for r in records) + 16 * len(records) == prefill["comm"]["send"].bytes
    assert set(multiprocessing.active_children()) <= before


@pytest.mark.slow
def test_killed_decode_instance_is_an_error(tiny_llama):
    before = set(multiprocessing.active_children())
    pair = PDPair(tiny_llama, **ENGINE)
    os.kill(pair._instances["decode"][0].process.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="decode"):
        pair.generate(PROMPTS, GREEDY, timeout=60)
    assert time.monotonic() - start < 30
    with pytest.raises(RuntimeError, match="shut down"):
        pair.generate(PROMPTS, GREEDY)
    assert set(multiprocessing.active_children()) <= before
