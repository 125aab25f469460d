"""The default model on several processes against one: step time, what each rank sent per processed token, and
the pipeline bubble by micro-batch count. Every layout gives one process's greedy tokens (checked here too).

On one CPU machine the ranks share its cores, so the ratios measure what the split costs, not what it buys on
GPUs. Layouts run one after another, each timed on the same requests. Usage:

    .venv/bin/python -m benchmarks.parallel [--requests 8] [--tokens 32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minillm import LLM, SamplingParams


def _run(llm: LLM, prompts, params) -> tuple[list, float]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], time.perf_counter() - start


def _bubble(events, stages: int) -> float:
    span = max(e.end for e in events) - min(e.start for e in events)
    return 1 - sum(e.end - e.start for e in events) / (stages * span)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.parallel", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args(argv)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    with LLM(device="cpu", enable_prefix_caching=False) as one:
        prompts = [one.apply_chat_template([{"role": "user", "content": f"Tell me fact number {i} about the sea."}])
                   for i in range(args.requests)]
        want, base = _run(one, prompts, params)
    processed = sum(map(len, prompts)) + len(prompts) * (args.tokens - 1)
    print(f"{args.requests} requests x {args.tokens} tokens, greedy; 1 process: {base:.2f} s")
    for tp, pp in [(3, 1), (1, 2), (1, 3)]:
        with LLM(device="cpu", tensor_parallel_size=tp, pipeline_parallel_size=pp, enable_prefix_caching=False) as llm:
            executor = llm.engine.executor
            executor.collect()
            got, seconds = _run(llm, prompts, params)
            reports = executor.collect()
            assert got == want, f"TP={tp} PP={pp} changed the greedy tokens"
            sent = {f"{group}.{op}": s for r in reports[:1] for group in ("tp", "world") for op, s in r[group].items()
                    if s.bytes}
            print(f"TP={tp} PP={pp}: {seconds:.2f} s ({seconds / base:.2f}x one process), identical tokens; rank 0 sent "
                  + ", ".join(f"{name} {s.calls} calls {s.bytes / processed / 1e3:.2f} kB/token"
                              for name, s in sent.items()))
            if pp > 1:
                executor.tracing = True
                prefill = SamplingParams(temperature=0.0, max_tokens=1)
                for m in (1, 2, 4, 8):
                    executor.num_micro_batches = m
                    executor.collect()
                    llm.generate(prompts, prefill, use_tqdm=False)
                    events = [e for r in executor.collect() for e in r["trace"]]
                    print(f"    one prefill step, m={m}: bubble {_bubble(events, pp):.0%} measured, "
                          f"{(pp - 1) / (m + pp - 1):.0%} by (p-1)/(m+p-1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
