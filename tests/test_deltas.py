"""Chapter 9's slim stream deltas, without Ray: after a request's first output a replica sends neither the prompt
nor the token times it sent before, so a delta's pickled size does not grow with the prompt or the tokens so
far, and the ingress rebuilds outputs equal to the engine's."""

import asyncio
import pickle

from minillm.sampling import RequestOutputKind, SamplingParams
from minillm.service.deltas import Slim, Widen
from minillm.serving import AsyncLLM
from serving_utils import tiny_engine

PROMPT = [i % 300 + 10 for i in range(180)]  # a delta carrying these 180 tokens would weigh hundreds of bytes more


def test_deltas_carry_only_what_is_new_and_widen_back_to_the_engine_s_outputs(tiny_llama):
    async def run():
        llm = AsyncLLM(tiny_engine(tiny_llama, num_kv_blocks=64))
        await llm.start()
        try:
            params = SamplingParams(max_tokens=60, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            slim, widen, seen = Slim(), Widen(), []
            async for out in llm.generate(PROMPT, params, "r"):
                sent = pickle.loads(pickle.dumps(slim(out)))  # across processes, as Serve sends it
                seen.append((out, list(out.metrics.token_times), len(pickle.dumps(sent)), widen(sent), sent))
            return seen
        finally:
            await llm.stop()

    seen = asyncio.run(run())
    assert len(seen) > 10
    sizes = [size for _, _, size, _, _ in seen]
    assert seen[0][4].prompt_token_ids == PROMPT  # the prompt went once, with the first output
    assert all(sent.prompt is None and sent.prompt_token_ids == [] for *_, sent in seen[1:])
    # a loaded machine may coalesce several tokens into one delta: sizes are compared between one-token deltas
    one_token = [size for out, _, size, _, _ in seen[1:-1] if len(out.outputs[0].token_ids) == 1]
    assert len(one_token) > 5 and max(one_token) < sizes[0] - 300, sizes  # lighter by the prompt's weight
    assert max(one_token) - min(one_token) < 32, sizes  # nor grow with the tokens so far
    for out, times, _, whole, _ in seen:
        assert whole.prompt_token_ids == PROMPT and whole.outputs == out.outputs
        assert whole.metrics.token_times[:len(times)] == times and whole.finished == out.finished
    assert seen[-1][3].metrics.token_times == seen[-1][0].metrics.token_times  # every token's time, once
