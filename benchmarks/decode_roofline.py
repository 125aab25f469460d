"""Batch-1 decode speed of minillm against two ceilings and Hugging Face transformers, all measured in one run.

(a) physical ceiling:   stream bandwidth / bytes of the weights (every step reads every weight once);
(b) attainable ceiling: 1 / time of the bare matrix-vector products of one decode step (the model's own
    weight tensors, fused qkv and gate_up and the tied head included, through the model's own linear layers).
Decode speeds are 1 / median time per token (prefill excluded). Every round measures everything, and each
engine step is followed by one bare step, so a noisy neighbour slows both alike; ratios are paired medians.

    .venv/bin/python -m benchmarks.decode_roofline [--rounds 5] [--tokens 32] [--threads 1] [--profile]

With `MINILLM_HUGE_PAGES=1` in the environment the weights go into 2 MiB pages (chapter 2 measures the difference).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.record import add_threads_option, use_threads
from minillm import LLM, SamplingParams
from minillm.roofline import engine_and_bare, matvec_step, measure_bandwidth

PROMPT = "Explain in a few sentences why generating text one token at a time is limited by memory bandwidth."
TARGET = 0.85  # the engine should reach this share of the attainable ceiling (b)


class TimingStreamer:
    """A transformers streamer that notes when each new token arrives (its first `put` is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value):
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self):
        pass


def hf_gaps(hf, prompt_ids: list[int], tokens: int, device) -> list[float]:
    """Seconds between consecutive new tokens of transformers' own greedy `generate`, batch 1."""
    ids = torch.tensor([prompt_ids], device=device)
    streamer = TimingStreamer()
    with torch.inference_mode():
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                    do_sample=False, streamer=streamer, pad_token_id=hf.generation_config.eos_token_id)
    return [b - a for a, b in zip(streamer.times, streamer.times[1:])]


def profile_engine(llm: LLM, prompt_ids: list[int], steps: int = 20) -> None:
    """Where one decode step's time goes: torch.profiler over `steps` engine steps, ops by self time."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    engine.add_request("profile", prompt_ids, SamplingParams(max_tokens=steps + 5, ignore_eos=True))
    for _ in range(4):  # prefill and a few warm-up decode steps
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    engine.abort("profile")
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    print(f"\nprofile of {steps} decode steps: {total / steps / 1e3:.1f} ms of op self time per step")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]:
        print(f"  {e.key:<50} {e.self_cpu_time_total / steps / 1e3:7.2f} ms/step  "
              f"{e.count // steps:4d} calls/step  {100 * e.self_cpu_time_total / total:5.1f} %")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_roofline", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved measurement rounds (medians over all)")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per generate call")
    parser.add_argument("--profile", action="store_true", help="also profile the engine's decode steps")
    add_threads_option(parser)
    args = parser.parse_args(argv)
    use_threads(args)

    from transformers import AutoModelForCausalLM

    llm = LLM()
    engine = llm.engine
    device, dtype, model = engine.device, engine.dtype, engine.model
    hf = AutoModelForCausalLM.from_pretrained(str(engine.path), dtype=dtype).to(device).eval()
    prompt_ids = llm.get_tokenizer()(PROMPT).input_ids
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # the tied head counted once
    step = matvec_step(model)

    hf_gaps(hf, prompt_ids, 8, device), engine_and_bare(engine, prompt_ids, 8, step)  # warm-up
    rounds = []
    for _ in range(args.rounds):
        copy, triad = (measure_bandwidth(kind, device=device, repeats=5) for kind in ("copy", "triad"))
        engine_times, bare_times = engine_and_bare(engine, prompt_ids, args.tokens, step)
        hf_times = hf_gaps(hf, prompt_ids, args.tokens, device)
        rounds.append({"copy": copy, "triad": triad, "engine": engine_times, "bare": bare_times, "hf": hf_times})

    med = statistics.median
    bandwidth = [max(r["copy"], r["triad"]) for r in rounds]  # a ceiling: the best the machine showed
    a_tps = [bw / weight_bytes for bw in bandwidth]  # (a) per round
    engine_tps, hf_tps = ([1 / med(r[k]) for r in rounds] for k in ("engine", "hf"))
    pairs = [b / e for r in rounds for e, b in zip(r["engine"], r["bare"])]  # engine/(b), step by step
    bare_all, engine_all = [t for r in rounds for t in r["bare"]], [t for r in rounds for t in r["engine"]]
    print(f"decode at batch 1: {engine.config.num_params / 1e6:.1f} M params, {weight_bytes / 1e6:.1f} MB of weights, "
          f"{device.type}, {str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds x {args.tokens} tokens, prompt of {len(prompt_ids)} tokens")
    print(f"stream bandwidth (median of rounds): copy {med([r['copy'] for r in rounds]) / 1e9:.1f} GB/s, "
          f"triad {med([r['triad'] for r in rounds]) / 1e9:.1f} GB/s; each round's ceiling uses the larger")
    print(f"(a) physical ceiling    bandwidth / weight bytes   {med(a_tps):7.1f} tok/s")
    print(f"(b) attainable ceiling  bare matvecs of one step   {1 / med(bare_all):7.1f} tok/s  "
          f"({1e3 * med(bare_all):.1f} ms/step, {weight_bytes / med(bare_all) / 1e9:.1f} GB/s effective)")
    print(f"minillm engine          LLMEngine.step             {1 / med(engine_all):7.1f} tok/s  "
          f"({1e3 * med(engine_all):.1f} ms/step)")
    print(f"HF transformers         generate, token gaps       {med(hf_tps):7.1f} tok/s  ({1e3 / med(hf_tps):.1f} ms/step)")
    ratio = med(pairs)
    print(f"engine/(a) = {med([e / a for e, a in zip(engine_tps, a_tps)]):.2f}   "
          f"engine/(b) = {ratio:.2f} (target >= {TARGET}; quartiles {statistics.quantiles(pairs, n=4)[0]:.2f}"
          f"-{statistics.quantiles(pairs, n=4)[2]:.2f})   HF/(a) = {med([h / a for h, a in zip(hf_tps, a_tps)]):.2f}   "
          f"engine/HF = {med([e / h for e, h in zip(engine_tps, hf_tps)]):.2f}")
    print("ratios are medians of per-round (per-step for engine/(b)) ratios, so slow spells cancel out")
    if args.profile or ratio < TARGET:
        profile_engine(llm, prompt_ids)
    return 0


if __name__ == "__main__":
    sys.exit(main())
