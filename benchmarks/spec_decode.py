"""Speculative decoding on the default model against the same engine without it (chapter 10): prompt lookup, and a
draft model (the same model in int4, drafting for the float32 engine).

Two workloads: copy-heavy (the model is asked to repeat a passage of the packaged text, so what it writes occurred
in its prompt) and chat (the book's chat workload). For each, batch 1, 4, 16 and 32: decode tokens per second
without speculation, with prompt lookup and with the int4 draft, the three alternating, greedy, and the outputs
asserted identical; the acceptance (tokens kept per draft token), the mean tokens per verify step (kept drafts and
the model's own token) and, for the draft model, the share of steps that kept the draft at each position. Then, for
each method, the batch where its gain turns into a loss, and the roofline quantities that explain it (chapter 2):
the float32 model's step at each batch for 1 and for k + 1 tokens per sequence, measured (the verify step's cost),
the int4 draft's step, and the float32 step's arithmetic intensity beside this machine's ridge point. Decode speed
is measured while the whole batch decodes (`timed`); a draft model reads each prompt at its first drafting round,
after the request's first token, so that time counts in it when the whole batch starts in one step (at batch 1
always). Run it on an otherwise idle machine:

    .venv/bin/python -m benchmarks.spec_decode [--threads 2] [--tokens 96] [--k 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minillm import LLM, SamplingParams
from minillm.bench import corpus_ids, make_workload
from minillm.metrics import RequestMetrics
from minillm.roofline import (arithmetic_intensity, forward_costs, measure_bandwidth, measure_matmul_flops, ridge_point,
                              step_weight_bytes, time_interleaved)
from minillm.scheduler import SchedulerOutput
from minillm.sequence import Sequence
from minillm.workload import describe_machine

METHODS = ("ngram", "draft_model")
CONTEXT = 256  # tokens each sequence holds in the step-time measurements


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
    """Decode tokens per second while every request of the batch decodes: the tokens that came between the last
    request's first token and the first request's last, over that time (prefill comes before it, and the tail
    where fewer requests are left, which speculation makes uneven, after it), and the outputs."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    outs = llm.generate(prompts, params, use_tqdm=False)
    start = max(o.metrics.first_token_time for o in outs)
    end = min(o.metrics.finished_time for o in outs)
    if end <= start:
        raise RuntimeError("a request finished before the last one started: use more --tokens")
    count = sum(start < t <= end for o in outs for t in o.metrics.token_times)
    return count / (end - start), [o.outputs[0].token_ids for o in outs]


def step_seconds(worker, batch: int, new_tokens: tuple[int, ...], repeats: int) -> list[float]:
    """Median seconds of one forward pass of `worker` (an engine, or its draft model: anything with a `block_manager`
    and a `runner`) over `batch` sequences of `CONTEXT` tokens, each bringing n new tokens, for each n of
    `new_tokens`, interleaved: 1 is a decode step, k + 1 a verify step (the drafts checked as the engine checks
    them). The cache's contents do not change the time, so the sequences are never prefilled."""
    bm = worker.block_manager
    seqs = [Sequence(f"step-{i}", None, [i] * CONTEXT, SamplingParams(), RequestMetrics(0.0)) for i in range(batch)]
    try:
        for seq in seqs:
            if not bm.allocate(seq) or not bm.can_grow(seq, CONTEXT + max(new_tokens) - 1):
                raise RuntimeError(f"the KV pool cannot hold {batch} sequences of {CONTEXT} tokens")
            bm.grow(seq, CONTEXT + max(new_tokens) - 1)
            seq.num_cached_tokens = CONTEXT - 1

        def step(n: int):
            def run() -> None:
                out = SchedulerOutput()
                for seq in seqs:
                    seq.draft_token_ids = [0] * (n - 1)
                    out.add(seq, n)
                worker.runner.run(out)
            return run
        times = time_interleaved([step(n) for n in new_tokens], worker.runner.device, repeats)
        return [statistics.median(t) for t in times]
    finally:
        for seq in seqs:
            bm.free(seq)


def acceptance(before: dict, after: dict) -> tuple[float, float, list[float]]:
    """Draft tokens kept per draft token, mean tokens per verify step (the model's own one included), and the share
    of verify steps that kept the draft at each position, between two `stats()`."""
    drafted, kept, steps = (after[key] - before[key] for key in ("spec_decode_num_draft_tokens",
                                                                  "spec_decode_num_accepted_tokens",
                                                                  "spec_decode_num_drafts"))
    positions = [(a - b) / max(steps, 1) for a, b in zip(after["spec_decode_num_accepted_tokens_per_pos"],
                                                         before["spec_decode_num_accepted_tokens_per_pos"])]
    return kept / max(drafted, 1), (kept + steps) / max(steps, 1), positions


def crossover(ratios: dict[int, float]) -> str:
    """Where a method's gain turns into a loss along the batch sizes measured."""
    losing = [batch for batch, ratio in sorted(ratios.items()) if ratio < 1]
    if not losing:
        return f"a gain at every batch up to {max(ratios)}"
    gaining = [batch for batch in ratios if batch < losing[0]]
    return (f"a gain up to batch {max(gaining)}, a loss from batch {losing[0]}" if gaining
            else f"a loss from batch {losing[0]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.spec_decode", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96, help="tokens generated per request")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    configs = {"ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
                         "prompt_lookup_min": 2},
               "draft_model": {"method": "draft_model", "model": None, "num_speculative_tokens": args.k,
                               "quantization": "int4"}}
    llms = {"plain": LLM(num_threads=args.threads)}
    llms.update({method: LLM(num_threads=args.threads, speculative_config=configs[method]) for method in METHODS})
    print(describe_machine().replace("Ran on", "Machine") + f"; load average {load:.2f} at the start")
    tokenizer = llms["plain"].get_tokenizer()
    workloads = {"copy-heavy": copy_prompts(llms["plain"], max(args.batches)),
                 "chat": [p for p, _ in make_workload("chat", max(args.batches), tokenizer, seed=4)]}
    print(f"\nk = {args.k}; {args.tokens} tokens per request, greedy; decode tok/s while the whole batch decodes "
          f"(median of {args.repeats}, the three engines alternating); ngram: prompt lookup (n = 4..2); draft: the "
          "same model in int4 drafting for float32; accept: drafts kept per draft; len: tokens per verify step")
    print(f"{'workload':<11} {'batch':>5} {'plain':>7} | {'ngram':>7} {'ratio':>6} {'accept':>6} {'len':>5} | "
          f"{'draft':>7} {'ratio':>6} {'accept':>6} {'len':>5}  draft kept by position")
    ratios: dict[tuple[str, str], dict[int, float]] = {}
    for name, prompts in workloads.items():
        for batch in args.batches:
            rates: dict[str, list[float]] = {label: [] for label in llms}
            before = {method: llms[method].stats() for method in METHODS}
            for _ in range(args.repeats):
                for label, llm in llms.items():
                    rate, outs = timed(llm, prompts[:batch], args.tokens)
                    rates[label].append(rate)
                    if label == "plain":
                        want = outs
                    else:
                        assert outs == want, f"{name}, batch {batch}: {label} changed the greedy output"
            plain = statistics.median(rates["plain"])
            row = f"{name:<11} {batch:>5} {plain:>7.1f}"
            for method in METHODS:
                rate = statistics.median(rates[method])
                ratios.setdefault((name, method), {})[batch] = rate / plain
                kept, length, positions = acceptance(before[method], llms[method].stats())
                row += f" | {rate:>7.1f} {rate / plain:>5.2f}x {kept:>6.2f} {length:>5.2f}"
            print(row + "  " + " ".join(f"{p:.2f}" for p in positions))

    print("\nwhere the gain turns into a loss:")
    for (name, method), by_batch in ratios.items():
        print(f"  {method:<11} {name:<11} {crossover(by_batch)}")

    target, drafter = llms["plain"].engine, llms["draft_model"].engine.drafter
    bandwidth, peak = measure_bandwidth(), measure_matmul_flops()
    ridge = ridge_point(peak, bandwidth)
    share = step_weight_bytes(drafter.runner.model) / step_weight_bytes(target.model)
    print(f"\nroofline (chapter 2): bandwidth {bandwidth / 1e9:.1f} GB/s, float32 matmul {peak / 1e9:.0f} GFLOP/s, "
          f"ridge point {ridge:.1f} FLOP/byte; the int4 draft reads {share:.2f} of the float32 weight bytes per step")
    print(f"one step over {CONTEXT}-token sequences, ms (median); intensity in FLOP/byte of the float32 step")
    print(f"{'batch':>5} {'1 tok/seq':>10} {f'{args.k + 1} tok/seq':>10} {'verify/decode':>13} {'draft step':>10} "
          f"{'intensity 1':>11} {f'intensity {args.k + 1}':>11}")
    for batch in args.batches:
        one, verify = step_seconds(target, batch, (1, args.k + 1), repeats=10)
        (draft_step,) = step_seconds(drafter, batch, (1,), repeats=10)
        intensity = [arithmetic_intensity(forward_costs(target.config, [n] * batch, [CONTEXT + n - 1] * batch,
                                                        dtype_bytes=4)) for n in (1, args.k + 1)]
        print(f"{batch:>5} {one * 1e3:>10.1f} {verify * 1e3:>10.1f} {verify / one:>12.2f}x {draft_step * 1e3:>10.1f} "
              f"{intensity[0]:>11.1f} {intensity[1]:>11.1f}")

    copy_ratio, chat_ratio = ratios[("copy-heavy", "ngram")].get(1), ratios[("chat", "draft_model")].get(1)
    if copy_ratio is not None:
        print(f"\ntarget: prompt lookup >= 1.5x batch-1 decode on copy-heavy: "
              f"{'met' if copy_ratio >= 1.5 else 'missed'} ({copy_ratio:.2f}x)")
    if chat_ratio is not None:
        print(f"target: int4 draft >= 2x the float32 engine's batch-1 decode on chat, same greedy output: "
              f"{'met' if chat_ratio >= 2 else 'missed'} ({chat_ratio:.2f}x)")
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
