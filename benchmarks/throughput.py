"""Offline throughput: minillm's continuous batching against Hugging Face `generate`, in one run.

Two seeded workloads of real text (the text shipped with minillm), every request running to its own
`max_tokens` (ignore_eos):
  chat  prompts 16-128 tokens, answers 64-256 tokens
  rag   prompts 256-1024 tokens, answers 16-64 tokens
Each is run by (a) HF `generate` one request at a time, (b) HF `generate` in static batches of 8 (left
padding; a batch runs until its longest answer is done), (c) minillm with all requests submitted at
once, for each of several request counts (the first requests of one seeded list). The HF baselines run on
a seeded subset and are reported as output tokens per second, which does not depend on how many requests
were timed. Usage:

    python -m benchmarks.throughput [--workload chat|rag|both] [--requests N [N ...]] [--hf-requests N]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from minillm import LLM
from minillm.bench import WORKLOADS, make_workload, run_hf, run_minillm

STATIC_BATCH = 8


def prefill_tokens_per_s(llm: LLM, hf, prompts: list[list[int]]) -> tuple[float, float]:
    """Prompt tokens/s of one forward pass over each prompt alone, minillm and HF (median over prompts).

    `llm` must not cache prefixes: the warm-up pass would otherwise leave the timed prompt already cached.
    """
    assert not llm.engine.block_manager.enable_prefix_caching
    def rate(fn, p):
        fn(p)  # warm-up for this shape
        start = time.perf_counter()
        fn(p)
        return len(p) / (time.perf_counter() - start)

    with torch.inference_mode():
        ours = sorted(rate(llm.engine.next_token_logits, p) for p in prompts)
        theirs = sorted(rate(lambda p: hf(torch.tensor([p])), p) for p in prompts)
    return ours[len(ours) // 2], theirs[len(theirs) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=["chat", "rag", "both"], default="both")
    parser.add_argument("--requests", type=int, nargs="+", default=[16, 32, 48],
                        help="request counts minillm runs per workload (each its own run)")
    parser.add_argument("--hf-requests", type=int, default=8, help="seeded subset the HF baselines run")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    llm = LLM()
    tok = llm.get_tokenizer()
    hf = AutoModelForCausalLM.from_pretrained(str(llm.engine.path), dtype=llm.engine.dtype).to(llm.engine.device).eval()
    print(f"device {llm.engine.device}, dtype {llm.engine.dtype}, torch threads {torch.get_num_threads()}")
    run_minillm(llm, make_workload("chat", 4, tok, seed=123))  # warm-up
    names = ["chat", "rag"] if args.workload == "both" else [args.workload]
    for name in names:
        work = make_workload(name, max(args.requests), tok)
        subset = random.Random(1).sample(work, min(args.hf_requests, len(work)))
        results = {
            "HF one at a time": run_hf(hf, subset, 1, tok.pad_token_id),
            f"HF static batch {STATIC_BATCH}": run_hf(hf, subset, STATIC_BATCH, tok.pad_token_id),
        }
        for n in args.requests:
            llm.reset_prefix_cache()  # each run computes its prompts, as HF does, rather than reusing the last run's
            results[f"minillm, {n} requests"] = run_minillm(llm, work[:n])
        print(f"\n{name}: {len(subset)} requests for HF; "
              f"prompts {WORKLOADS[name][0]}, answers {WORKLOADS[name][1]} tokens")
        rates = {k: r["output_tokens"] / r["seconds"] for k, r in results.items()}
        for k, r in results.items():
            print(f"  {k:22s} {r['output_tokens']:6d} output tokens in {r['seconds']:7.1f} s = {rates[k]:7.1f} tok/s")
        a, b = rates["HF one at a time"], rates[f"HF static batch {STATIC_BATCH}"]
        for n in args.requests:
            ours = rates[f"minillm, {n} requests"]
            print(f"  minillm with {n:3d} requests / (a) = {ours / a:5.2f}x   / (b) = {ours / b:5.2f}x")
        if name == "rag":
            cold = LLM(enable_prefix_caching=False)
            ours, theirs = prefill_tokens_per_s(cold, hf, [p for p, _ in subset[:4]])
            del cold
            print(f"  prefill: minillm {ours:.0f} tok/s, HF {theirs:.0f} tok/s, ratio {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
