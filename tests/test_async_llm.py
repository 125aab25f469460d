"""AsyncLLM without HTTP: the engine loop in its thread, a stream per request, aborts, overload, merging."""

import asyncio

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.engine import LLMEngine
from minillm.outputs import CompletionOutput, RequestOutput
from minillm.sampling import RequestOutputKind
from minillm.serving import AsyncLLM, EngineOverloaded, EngineUnavailable

DELTA = RequestOutputKind.DELTA


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(tiny_llama, device="cpu", dtype=torch.float32, num_kv_blocks=64, block_size=4)


def idle(engine) -> bool:
    return engine.block_manager.num_free_blocks == engine.block_manager.num_blocks and \
        not engine.has_unfinished_requests()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def test_concurrent_generates_equal_offline_greedy(engine, tiny_llama):
    offline = LLM(tiny_llama, device="cpu", num_kv_blocks=64, block_size=4)
    prompts = ["The quick brown fox", "Prefill builds the cache", "模型"]
    want = [o.outputs[0].token_ids for o in
            offline.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)]

    async def main():
        llm = AsyncLLM(engine)
        await llm.start()

        async def one(i):
            tokens = []
            async for out in llm.generate(prompts[i], SamplingParams(max_tokens=12, ignore_eos=True,
                                                                     output_kind=DELTA), f"r{i}"):
                tokens += out.outputs[0].token_ids
            return tokens
        try:
            return await asyncio.gather(*(one(i) for i in range(3)))
        finally:
            await llm.stop()
    assert run(main()) == want and idle(engine)


def test_abort_from_another_task_ends_the_stream_with_abort(engine):
    async def main():
        llm = AsyncLLM(engine)
        await llm.start()
        stream = llm.add_request("long", "The quick", SamplingParams(max_tokens=200, ignore_eos=True,
                                                                     output_kind=DELTA))
        outs = [await stream.__anext__()]
        await llm.abort("long")
        outs += [out async for out in stream]
        await stream.aclose()
        await llm.stop()
        return outs
    outs = run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort" and idle(engine)


def test_closing_a_stream_early_aborts_its_request(engine):
    async def main():
        llm = AsyncLLM(engine)
        await llm.start()
        gen = llm.generate("The quick", SamplingParams(max_tokens=200, ignore_eos=True, output_kind=DELTA), "x")
        await gen.__anext__()
        await gen.aclose()  # the reader leaves
        for _ in range(100):
            if idle(engine):
                break
            await asyncio.sleep(0.01)
        await llm.stop()
    run(main())
    assert idle(engine)


def test_overload_and_shutdown_refuse_new_requests(engine):
    async def main():
        llm = AsyncLLM(engine, max_waiting_requests=2)
        with pytest.raises(EngineUnavailable):  # not started yet
            llm.add_request("a", "x", SamplingParams())
        await llm.start()
        with pytest.raises(EngineOverloaded):
            llm.add_request("big", "x", SamplingParams(n=3))
        with pytest.raises(ValueError, match="empty"):
            llm.add_request("bad", "", SamplingParams())
        stream = llm.add_request("ok", "x", SamplingParams(max_tokens=3))
        outs = [out async for out in stream]
        await stream.aclose()
        llm.stop_accepting()
        with pytest.raises(EngineUnavailable):
            llm.add_request("late", "x", SamplingParams())
        await llm.stop()
        return outs
    assert run(main())[-1].finished and idle(engine)


def test_a_slow_reader_gets_queued_deltas_merged(engine):
    def delta(text, tokens, reason=None, index=0):
        return RequestOutput("m", None, [1], [CompletionOutput(index, text, tokens, reason)], reason is not None,
                             None)

    async def main():
        llm = AsyncLLM(engine)
        await llm.start()
        stream = llm.add_request("m", "x", SamplingParams(max_tokens=50, ignore_eos=True, output_kind=DELTA,
                                                          n=2, temperature=1.0, seed=0))
        await llm.abort("m")  # the engine's own outputs end here; feed the queue by hand instead
        while not stream.queue.empty():
            stream.queue.get_nowait()
        for out in (delta("He", [5]), delta("a", [9], index=1), delta("llo", [6, 7]), delta("!", [8], "stop")):
            stream.queue.put_nowait(out)
        merged = await stream.__anext__()
        await stream.aclose()
        await llm.stop()
        return merged
    merged = run(main())
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in merged.outputs] == \
        [(0, "Hello!", [5, 6, 7, 8], "stop"), (1, "a", [9], None)]
