"""Speculative decoding with prompt lookup on the default model, against the same engine without it (chapter 10).

Two workloads: copy-heavy (the model is asked to repeat a passage of the packaged text, so what it writes occurred
in its prompt) and chat (the book's chat workload). For each, batch 1, 4, 16 and 32: decode tokens per second
with and without speculation, alternating, greedy, and the output asserted identical. Also the acceptance: tokens
kept per draft token, and the mean tokens per verify step. Run it on an otherwise idle machine:

    .venv/bin/python -m benchmarks.spec_decode [--threads 2] [--tokens 96] [--k 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minillm import LLM, SamplingParams
from minillm.bench import corpus_ids, make_workload
from minillm.workload import describe_machine


def copy_prompts(llm: LLM, n: int, passage_tokens: int = 96) -> list[list[int]]:
    """Chat prompts asking to repeat a passage of the packaged text (a different passage each)."""
    tokenizer = llm.get_tokenizer()
    ids = corpus_ids(tokenizer)
    prompts = []
    for i in range(n):
        passage = tokenizer.decode(ids[1000 + 400 * i:1000 + 400 * i + passage_tokens])
        prompts.append(llm.apply_chat_template([{"role": "user", "content": "Repeat this passage word for word:"
                                                 f"\n\n{passage}"}]))
    return prompts


def timed(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    """Decode tokens per second over the batch (prefill excluded: first-token times subtracted), and the outputs."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    end = time.perf_counter()
    first = max(o.metrics.first_token_time for o in outs)
    return sum(len(o.outputs[0].token_ids) - 1 for o in outs) / (end - first), [o.outputs[0].token_ids for o in outs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.spec_decode", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96, help="tokens generated per request")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    plain = LLM(num_threads=args.threads)
    spec = LLM(num_threads=args.threads, speculative_config=config)
    print(describe_machine().replace("Ran on", "Machine") + f"; load average {load:.2f} at the start")
    tokenizer = plain.get_tokenizer()
    workloads = {"copy-heavy": copy_prompts(plain, max(args.batches)),
                 "chat": [p for p, _ in make_workload("chat", max(args.batches), tokenizer, seed=4)]}
    print(f"\nprompt lookup, k = {args.k}; {args.tokens} tokens per request, greedy; decode tok/s (median of "
          f"{args.repeats}, alternating)")
    print(f"{'workload':<11} {'batch':>5} {'plain':>8} {'spec':>8} {'ratio':>6} {'kept/drafted':>13} "
          f"{'tokens/step':>11}")
    for name, prompts in workloads.items():
        for batch in args.batches:
            rates = {"plain": [], "spec": []}
            before = spec.stats()
            for _ in range(args.repeats):
                for label, llm in (("plain", plain), ("spec", spec)):
                    rate, outs = timed(llm, prompts[:batch], args.tokens)
                    rates[label].append(rate)
                    if label == "plain":
                        want = outs
                    else:
                        assert outs == want, f"{name}, batch {batch}: speculation changed the greedy output"
            after = spec.stats()
            drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
            kept = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
            steps = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
            p, s = statistics.median(rates["plain"]), statistics.median(rates["spec"])
            print(f"{name:<11} {batch:>5} {p:>8.1f} {s:>8.1f} {s / p:>5.2f}x {kept / max(drafted, 1):>13.2f} "
                  f"{(kept + steps) / max(steps, 1):>11.2f}")
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
